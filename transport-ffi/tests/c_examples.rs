//! The C examples (examples/c) compiled with the system's C compiler against the static
//! library and the committed header, then run over Unix sockets and TCP: an echo server and
//! client in two processes, an RPC server with a C handler called from a client, the ping
//! tool's server and client in two processes, and an event-loop server (poll(2) on the
//! handles' descriptors) serving two clients at once.
//!
//! With valgrind installed, the clients also run under memcheck (no error, no definite
//! leak); `TRANSPORT_FFI_MEMCHECK=1` (set by `cargo xtask test`) makes a missing valgrind a
//! failure instead of a note.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(300);

/// The static library, built now: `cargo test` builds this crate as an rlib only, so the
/// `.a` beside it could be older than the sources. A second cargo in the same target
/// directory and profile (it waits for the build lock, which the running tests do not hold).
fn static_lib() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test executable path");
            // target/<profile>/deps/<test>
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile>");
            let target_dir = profile_dir.parent().expect("target");
            let release = profile_dir.file_name().is_some_and(|n| n == "release");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args(["build", "-p", "transport-ffi", "--lib", "--quiet"])
                .arg("--target-dir")
                .arg(target_dir);
            if release {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("run cargo build");
            assert!(
                status.success(),
                "cargo build -p transport-ffi --lib failed"
            );
            let lib = profile_dir.join("libtransport_ffi.a");
            assert!(lib.exists(), "no {}", lib.display());
            lib
        })
        .clone()
}

/// Compiles examples/c/`name`.c into `out`/`name`, warnings as errors.
fn compile(name: &str, out: &Path) -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = out.join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args([
            "-std=c11",
            "-O1",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-D_POSIX_C_SOURCE=200809L",
        ])
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join(format!("examples/c/{name}.c")))
        .arg(static_lib())
        .args(["-lpthread", "-ldl", "-lm", "-o"])
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(status.success(), "{name}.c did not compile");
    exe
}

/// Waits for `child` at most [`LIMIT`], killing it past that.
fn finish(child: Child, what: &str) -> Output {
    let id = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(LIMIT) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).status();
            panic!("{what} did not finish within {LIMIT:?}");
        }
    }
}

/// `cmd` (under memcheck when `memcheck`), run to its end; panics unless it exits 0.
fn run(cmd: &[&str], memcheck: bool, what: &str) -> String {
    let mut full: Vec<&str> = Vec::new();
    if memcheck {
        full.extend([
            "valgrind",
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
            "--show-leak-kinds=definite",
            "-q",
        ]);
    }
    full.extend(cmd);
    let child = Command::new(full[0])
        .args(&full[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start {}: {e}", full[0]));
    let out = finish(child, what);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Whether to run under memcheck: valgrind is there; required by `TRANSPORT_FFI_MEMCHECK=1`.
fn memcheck() -> bool {
    let have = Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let required = std::env::var("TRANSPORT_FFI_MEMCHECK").is_ok_and(|v| v == "1");
    assert!(
        have || !required,
        "TRANSPORT_FFI_MEMCHECK=1 but valgrind is not installed"
    );
    if !have {
        eprintln!("valgrind not installed: the C examples ran without memcheck");
    }
    have
}

/// Starts a server (`cmd`, standard input piped) and reads the URI it prints first
/// ("listening URI").
fn start_server(cmd: &[&str]) -> (Child, String) {
    let mut child = Command::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", cmd[0]));
    let mut first = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut first)
        .expect("the server's first line");
    let bound = first
        .strip_prefix("listening ")
        .unwrap_or_else(|| panic!("{} said {first:?}", cmd[0]))
        .trim()
        .to_string();
    (child, bound)
}

/// Over `uri`: the echo server in one process and the echo client in another, the RPC
/// example, and the ping tool's server and client; then again under memcheck.
fn examples_over(uri: &str) {
    let dir = tempfile::tempdir().unwrap();
    let server = compile("echo_server", dir.path());
    let client = compile("echo_client", dir.path());
    let rpc = compile("rpc", dir.path());
    let ping = compile("ping", dir.path());
    let poll_server = compile("poll_server", dir.path());
    let modes: &[bool] = if memcheck() { &[false, true] } else { &[false] };
    for &checked in modes {
        let uri = uri.replace("DIR", &dir.path().display().to_string());
        let echo_uri = uri.replace(".sock", &format!("-{checked}.sock"));
        let (child, bound) = start_server(&[server.to_str().unwrap(), &echo_uri]);
        let out = run(&[client.to_str().unwrap(), &bound], checked, "echo_client");
        assert!(out.ends_with("ok\n"), "{out}");
        let served = finish(child, "echo_server");
        assert!(served.status.success(), "echo_server: {}", served.status);
        let rpc_uri = uri.replace(".sock", &format!("-rpc-{checked}.sock"));
        let out = run(&[rpc.to_str().unwrap(), &rpc_uri, "300"], checked, "rpc");
        assert!(
            out.contains("ping: 300 calls") && out.ends_with("ok\n"),
            "{out}"
        );

        // The ping tool: its server until its standard input ends, its client against it.
        let ping_uri = uri.replace(".sock", &format!("-ping-{checked}.sock"));
        let (mut child, bound) = start_server(&[ping.to_str().unwrap(), "serve", &ping_uri]);
        let out = run(
            &[ping.to_str().unwrap(), "call", &bound, "200", "1000"],
            checked,
            "ping call",
        );
        assert!(out.starts_with("200 calls of 1000 bytes: "), "{out}");
        drop(child.stdin.take());
        let served = finish(child, "ping serve");
        assert!(served.status.success(), "ping serve: {}", served.status);

        // The event-loop server: two clients at once, each served as its messages come.
        let poll_uri = uri.replace(".sock", &format!("-poll-{checked}.sock"));
        let (child, bound) = start_server(&[poll_server.to_str().unwrap(), &poll_uri, "2"]);
        let clients: Vec<_> = (0..2)
            .map(|i| {
                let (client, bound) = (client.clone(), bound.clone());
                std::thread::spawn(move || {
                    // The second connects and receives without blocking.
                    let mut cmd = vec![client.to_str().unwrap(), bound.as_str()];
                    if i == 1 {
                        cmd.push("nb");
                    }
                    run(&cmd, checked, &format!("client {i}"))
                })
            })
            .collect();
        for c in clients {
            let out = c.join().expect("client thread");
            assert!(out.ends_with("ok\n"), "{out}");
        }
        let served = finish(child, "poll_server");
        assert!(served.status.success(), "poll_server: {}", served.status);
    }
}

#[test]
fn c_examples_run_over_unix_sockets() {
    examples_over("unix:DIR/echo.sock");
}

#[test]
fn c_examples_run_over_tcp() {
    examples_over("tcp://127.0.0.1:0");
}
