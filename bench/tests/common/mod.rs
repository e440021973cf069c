//! Shared by the CLI tests: run the built `bench` binary as a user would.

use std::process::{Command, Output};

/// Runs `bench ARGS` and returns its output.
pub fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(args)
        .output()
        .expect("run bench")
}

/// The run's standard error, as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
