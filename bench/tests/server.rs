//! `bench server` as a process: it warns before listening on a non-loopback address, and it
//! stops cleanly on SIGTERM and SIGINT, removing its Unix socket file and exiting with status 0.

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Every wait in these tests ends by then.
const BOUND: Duration = Duration::from_secs(20);
/// Interval of the bounded polls (the socket file appearing, the child exiting).
const POLL: Duration = Duration::from_millis(10);

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

/// Polls `done` until it is true or `BOUND` passes; returns whether it became true.
fn poll_until(mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + BOUND;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(POLL);
    }
    done()
}

/// Starts `bench server --uds SOCK` (TCP on an ephemeral loopback port), waits for SOCK,
/// sends `signal`, and returns the exit status and whether SOCK was still there.
fn stop_with(signal: Signal) -> (ExitStatus, bool) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("b.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["server", "--listen", "127.0.0.1:0", "--uds"])
        .arg(&sock)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    assert!(
        poll_until(|| sock.exists() || !matches!(server.0.try_wait(), Ok(None))),
        "bench server did not create {} within {BOUND:?}",
        sock.display()
    );
    assert!(
        matches!(server.0.try_wait(), Ok(None)),
        "bench server exited before the signal"
    );
    let pid = Pid::from_raw(i32::try_from(server.0.id()).unwrap());
    kill(pid, signal).unwrap();
    let mut status = None;
    let exited = poll_until(|| {
        status = server.0.try_wait().unwrap();
        status.is_some()
    });
    assert!(
        exited,
        "bench server still running {BOUND:?} after {signal}"
    );
    (status.unwrap(), Path::new(&sock).exists())
}

#[test]
fn sigterm_stops_the_server_and_removes_its_socket() {
    let (status, left) = stop_with(Signal::SIGTERM);
    assert!(status.success(), "{status}");
    assert!(!left, "the Unix socket file is still there");
}

#[test]
fn sigint_stops_the_server_and_removes_its_socket() {
    let (status, left) = stop_with(Signal::SIGINT);
    assert!(status.success(), "{status}");
    assert!(!left, "the Unix socket file is still there");
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
