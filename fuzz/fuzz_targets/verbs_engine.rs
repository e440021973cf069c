//! The verbs engine under a hostile peer: arbitrary peer messages (built from header fields,
//! or raw bytes), READ completions, application reads and time. The engine must not panic or
//! overflow, must hold no more than its bound, must READ only inside ranges the peer
//! announced, and must post nothing once failed (`transport_verbs::fuzz::run` checks these
//! after every step; the property test in the engine's unit tests runs the same driver).
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport_verbs::fuzz::{run, Step};

fuzz_target!(|steps: Vec<Step>| {
    if let Err(broken) = run(&steps) {
        panic!("the engine broke a promise: {broken}");
    }
});
