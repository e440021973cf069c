//! `bench server` as a process: it warns before listening on a non-loopback address.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A child process killed if the test ends without having waited for it.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// The first thing a server asked to listen on a non-loopback address says is the warning.
/// 192.0.2.1 (TEST-NET-1) is normally on no interface, so nothing is exposed: the listen
/// fails right after the warning.
#[test]
fn non_loopback_listen_prints_the_warning_first() {
    let child = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["server", "--listen", "192.0.2.1:5201"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let stderr = server.0.stderr.take().unwrap();
    // Does not wait for long: the server prints a line whether the listen fails (the error)
    // or not (the address it serves); the guard kills it in the second case.
    let mut first = String::new();
    BufReader::new(stderr).read_line(&mut first).unwrap();
    assert!(first.contains("warning"), "{first}");
    assert!(first.contains("192.0.2.1:5201"), "{first}");
    assert!(first.contains("unauthenticated"), "{first}");
}
