//! Shared by the CLI tests: run the built `bench` binary as a user would.

use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Longest a test's `bench` run may take (debug build, a loaded machine): a run that hangs
/// fails its test instead of stalling the suite.
const RUN_BOUND: Duration = Duration::from_secs(300);

/// Runs `bench ARGS` and returns its output; kills it and panics if it runs longer than
/// [`RUN_BOUND`].
pub fn bench(args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run bench");
    let pid = child.id();
    let (done, outcome) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match outcome.recv_timeout(RUN_BOUND) {
        Ok(output) => output.expect("wait for bench"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("bench {args:?} ran longer than {RUN_BOUND:?}");
        }
    }
}

/// The run's standard error, as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
