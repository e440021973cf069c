//! The `bench` command line as a user runs it: argument errors, JSON output, the SVG plot,
//! the doctor. No timing is asserted: only shape and consistency.

mod common;

use common::{bench, stderr};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Tiny settings: a run takes well under a second even in a debug build.
const TINY: &[&str] = &[
    "--pings",
    "40",
    "--repeat",
    "2",
    "--sizes",
    "1K,64K",
    "--ops",
    "ping,send,echo",
    "--bytes",
    "256K",
    "--no-progress",
];

#[test]
fn bad_arguments_are_named() {
    let o = bench(&["--sizes", "12x"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("`12x` is not a size"), "{}", stderr(&o));

    let o = bench(&["--sizes", "32M"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("largest supported size"),
        "{}",
        stderr(&o)
    );

    let o = bench(&["--pin", "sideways"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("possible values: same, split, none"),
        "{}",
        stderr(&o)
    );

    let o = bench(&["client"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("<HOST>"), "{}", stderr(&o));

    let o = bench(&["--repeat", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--repeat"), "{}", stderr(&o));
}

#[test]
fn unreachable_server_is_a_clear_error() {
    // Port 1 on loopback: nobody listens, the connection is refused at once.
    let mut args = vec!["client", "127.0.0.1:1"];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("is `bench server` running on 127.0.0.1:1?"),
        "{e}"
    );
}

#[test]
fn json_report_and_svg_plot() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("plot.svg");
    let mut args = vec![
        "--json",
        "--plot",
        svg.to_str().unwrap(),
        "--transports",
        "uds,tcp,verbs",
    ];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");

    let transports = v["transports"].as_array().unwrap();
    let names: Vec<_> = transports
        .iter()
        .map(|t| t["transport"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["uds", "tcp"]);
    assert_eq!(v["settings"]["layers"], serde_json::json!(["raw", "rpc"]));
    for t in transports {
        assert_eq!(t["ping"]["raw"]["calls"], 40);
        assert_eq!(t["ping"]["rpc"]["calls"], 40);
        // The OS baseline of uds and tcp, in the same run: as many round trips.
        assert_eq!(t["ping"]["os"]["calls"], 40, "{t}");
        assert!(t["ping"]["os"]["p50_us"].as_f64().unwrap() > 0.0);
        assert!(t["ping"]["rpc_os_latency_ratio"].as_f64().unwrap() > 0.0);
        assert!(t["os_baseline"].as_str().unwrap().contains("blocking"));
        assert_eq!(t["os_baseline_kind"], "sockets", "{t}");
        let cells = t["cells"].as_array().unwrap();
        // 2 ops x 2 sizes x 1 thread count.
        assert_eq!(cells.len(), 4);
        for c in cells {
            // An OS stream beside send, none beside echo.
            if c["op"] == "send" {
                assert!(c["os"]["mbit_s"]["min"].as_f64().unwrap() > 0.0, "{c}");
                assert!(c["rpc_os_utilization"].as_f64().unwrap() > 0.0, "{c}");
                assert!(c["raw_os_utilization"].as_f64().unwrap() > 0.0, "{c}");
            } else {
                assert!(
                    c["os"].is_null() && c["rpc_os_utilization"].is_null(),
                    "{c}"
                );
            }
            for side in ["raw", "rpc"] {
                let m = &c[side]["mbit_s"];
                let (min, med, max) = (
                    m["min"].as_f64().unwrap(),
                    m["median"].as_f64().unwrap(),
                    m["max"].as_f64().unwrap(),
                );
                assert!(min > 0.0 && min <= med && med <= max, "{c}");
            }
            // The median of per-repetition ratios lies within what the extremes allow.
            let u = c["utilization"].as_f64().unwrap();
            let f = |side: &str, k: &str| c[side]["mbit_s"][k].as_f64().unwrap();
            let (lo, hi) = (
                f("rpc", "min") / f("raw", "max"),
                f("rpc", "max") / f("raw", "min"),
            );
            assert!(
                lo - 1e-9 <= u && u <= hi + 1e-9,
                "{u} not in [{lo}, {hi}]: {c}"
            );
            // Socket backends never register memory; both send payloads without a copy.
            assert_eq!(c["rpc"]["costs"]["registrations_per_call"], 0.0);
        }
    }
    // verbs: on a machine without RDMA it is listed with the reason.
    let unavailable = v["unavailable"].as_array().unwrap();
    if let Some(u) = unavailable.first() {
        assert_eq!(u["transport"], "verbs");
        assert!(!u["reason"].as_str().unwrap().is_empty());
    }
    let diag = v["diagnosis"].as_array().unwrap();
    assert_eq!(diag.len(), 2);
    for d in diag {
        assert!(d["verdict"]
            .as_str()
            .unwrap()
            .starts_with(d["transport"].as_str().unwrap()));
    }
    assert!(v["placement"]["summary"].as_str().unwrap().contains("CPU"));

    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    // One line per transport and layer, and the legend names them.
    assert!(
        text.contains("uds raw") && text.contains("tcp rpc send"),
        "legend missing"
    );
    assert!(
        doc.descendants()
            .filter(|n| n.tag_name().name() == "polyline" || n.tag_name().name() == "path")
            .count()
            >= 4
    );
}

#[test]
fn table_output_names_units_and_sections() {
    let mut args = vec!["--transports", "uds"];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    for want in [
        "os µs/rt",
        "raw µs/rt",
        "rpc µs/call",
        "rpc/os p50",
        "os Mbit/s",
        "raw Mbit/s",
        "rpc Mbit/s",
        "util",
        "rpc/os",
        "Diagnosis",
        "placement:",
        "64 KiB",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
    assert!(out.contains("uds: "), "a verdict line for uds:\n{out}");
}

/// Both latency placements run with the OS rows: client and server on one CPU, or on two.
#[test]
fn os_rows_at_both_pin_placements() {
    for pin in ["same", "split"] {
        let mut args = vec!["--json", "--transports", "uds,tcp", "--pin", pin];
        args.extend_from_slice(TINY);
        let o = bench(&args);
        assert!(o.status.success(), "--pin {pin}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let place = &v["placement"];
        if pin == "same" || place["allowed_cpus"].as_array().unwrap().len() < 2 {
            assert_eq!(place["client_core"], place["server_core"], "{place}");
        } else {
            assert_ne!(place["client_core"], place["server_core"], "{place}");
        }
        for t in v["transports"].as_array().unwrap() {
            assert_eq!(t["ping"]["os"]["calls"], 40, "--pin {pin}: {t}");
        }
    }
}

#[test]
fn doctor_reports_and_json_parses() {
    let o = bench(&["doctor"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(
        out.contains("memlock") && out.contains("net.core.rmem_max"),
        "{out}"
    );
    let o = bench(&["doctor", "--json"]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let checks: Vec<_> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["check"].as_str().unwrap().to_string())
        .collect();
    assert!(checks.iter().any(|c| c == "memlock"), "{checks:?}");
    assert!(
        checks.iter().any(|c| c == "net.ipv4.tcp_window_scaling"),
        "{checks:?}"
    );
}

/// A `bench server` child on an ephemeral loopback port, killed and reaped on drop.
struct Server {
    child: std::process::Child,
    /// The TCP address it listens on, as it printed it.
    tcp: String,
}

impl Server {
    /// Starts `bench server --listen 127.0.0.1:0 ARGS` and waits (at most 20 s) until it has
    /// printed a line starting with `ready`: the server prints `bench server: tcp ADDR` once
    /// it listens on TCP and `bench server: uds PATH` once it listens on `--uds PATH`.
    fn start(args: &[&str], ready: &str) -> Server {
        let child = Command::new(env!("CARGO_BIN_EXE_bench"))
            .args(["server", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut server = Server {
            child,
            tcp: String::new(),
        };
        let stderr = server.child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        // Reads every line, so that the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("bench server never printed `{ready}`: {e}"));
            if let Some(rest) = line.strip_prefix("bench server: tcp ") {
                server.tcp = rest.split_whitespace().next().unwrap_or("").to_string();
            }
            if line.starts_with(ready) {
                return server;
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn server_and_client_across_a_socket() {
    // Two-host mode, on loopback: `bench server` in one process, `bench client` in another.
    let server = Server::start(&[], "bench server: tcp");
    let mut args = vec!["client", server.tcp.as_str(), "--json"];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    drop(server);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["placement"]["mode"], "remote");
    assert_eq!(v["transports"][0]["transport"], "tcp");
    assert_eq!(v["transports"][0]["cells"].as_array().unwrap().len(), 4);
    // No OS baseline against a remote server, and the report says why.
    assert!(v["transports"][0]["ping"]["os"].is_null());
    assert_eq!(v["transports"][0]["os_baseline_kind"], "not_measured");
    let why = v["transports"][0]["os_baseline"].as_str().unwrap();
    assert!(why.contains("remote mode"), "{why}");
}

/// `bench client unix:PATH` runs the comparison against `bench server --uds PATH`, and
/// `--transports` (which the client would ignore) is refused.
#[test]
fn client_reaches_the_servers_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("b.sock");
    let sock_arg = sock.to_str().expect("utf-8 path");
    let server = Server::start(&["--uds", sock_arg], "bench server: uds");
    let target = format!("unix:{}", sock.display());
    let mut args = vec!["client", target.as_str(), "--json"];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    let refused = bench(&["client", target.as_str(), "--transports", "tcp"]);
    drop(server);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["placement"]["mode"], "remote");
    assert_eq!(v["transports"][0]["transport"], "uds");
    assert_eq!(v["transports"][0]["cells"].as_array().unwrap().len(), 4);
    let summary = v["placement"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("another process on this host"),
        "{summary}"
    );
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("--transport"),
        "{}",
        stderr(&refused)
    );
}

/// Asserts that `t` (one transport of a JSON report) has RPC figures and no raw or os ones:
/// null, not zero, where they would be.
fn assert_rpc_only(t: &serde_json::Value) {
    let p = &t["ping"];
    assert_eq!(p["rpc"]["calls"], 40, "{t}");
    assert!(p["rpc"]["p50_us"].as_f64().unwrap() > 0.0, "{t}");
    for k in ["raw", "os", "latency_ratio", "raw_os_latency_ratio"] {
        assert!(p[k].is_null(), "ping.{k} is not null: {t}");
    }
    assert_eq!(t["os_baseline_kind"], "not_measured", "{t}");
    let why = t["os_baseline"].as_str().unwrap();
    assert!(why.contains("--only rpc"), "{why}");
    let cells = t["cells"].as_array().unwrap();
    // 2 ops x 2 sizes x 1 thread count.
    assert_eq!(cells.len(), 4, "{t}");
    for c in cells {
        assert!(c["rpc"]["mbit_s"]["min"].as_f64().unwrap() > 0.0, "{c}");
        for k in ["raw", "utilization", "os", "raw_os_utilization"] {
            assert!(c[k].is_null(), "cells[].{k} is not null: {c}");
        }
    }
}

/// `--only rpc` in local mode measures the RPC path alone: the JSON has RPC figures and null
/// raw and os figures, no diagnosis (RPC against raw), and the tables leave the raw and os
/// columns out and say that they were not measured.
#[test]
fn only_rpc_measures_rpc_without_raw_or_os() {
    let mut args = vec!["--only", "rpc", "--json", "--transports", "uds,tcp"];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    assert_eq!(v["settings"]["layers"], serde_json::json!(["rpc"]));
    let transports = v["transports"].as_array().unwrap();
    assert_eq!(transports.len(), 2, "{v}");
    for t in transports {
        assert_rpc_only(t);
    }
    assert_eq!(v["diagnosis"].as_array().map(Vec::len), Some(0), "{v}");

    let mut args = vec!["--only", "rpc", "--transports", "uds"];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    for present in ["rpc µs/call", "rpc Mbit/s", "not measured (--only rpc)"] {
        assert!(out.contains(present), "missing `{present}` in:\n{out}");
    }
    for absent in ["raw µs/rt", "raw Mbit/s", "os µs/rt", "os Mbit/s", "rpc/os"] {
        assert!(!out.contains(absent), "`{absent}` in:\n{out}");
    }
}

/// `bench client --only rpc` measures the RPC path alone against a server.
#[test]
fn client_only_rpc_measures_rpc_without_raw() {
    let server = Server::start(&[], "bench server: tcp");
    let mut args = vec!["client", server.tcp.as_str(), "--only", "rpc", "--json"];
    args.extend_from_slice(TINY);
    let o = bench(&args);
    drop(server);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["placement"]["mode"], "remote");
    assert_eq!(v["settings"]["layers"], serde_json::json!(["rpc"]));
    assert_eq!(v["transports"][0]["transport"], "tcp");
    assert_rpc_only(&v["transports"][0]);
}

/// `--ops` is honoured exactly: without `ping` there is no latency row, and `--ops ping` alone
/// prints no empty throughput table.
#[test]
fn ops_are_honoured_exactly() {
    let o = bench(&[
        "--transports",
        "uds",
        "--pings",
        "40",
        "--repeat",
        "1",
        "--sizes",
        "1K",
        "--ops",
        "send",
        "--bytes",
        "64K",
        "--no-progress",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let uds = &v["transports"][0];
    assert!(uds["ping"].is_null(), "no latency row without ping: {uds}");
    assert_eq!(uds["cells"].as_array().map(Vec::len), Some(1), "{uds}");

    let o = bench(&[
        "--transports",
        "uds",
        "--pings",
        "40",
        "--repeat",
        "1",
        "--ops",
        "ping",
        "--no-progress",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("rpc µs/call"), "the latency row: {out}");
    assert!(
        out.contains("Throughput: not measured (--ops ping only)"),
        "{out}"
    );
    assert!(
        !out.contains("raw Mbit/s"),
        "no empty throughput table: {out}"
    );
}

/// `--json-out` writes the report beside the tables, and `bench merge` prints two runs as one
/// report: the second run's rows marked as emulated, in the same tables (what `cargo xtask
/// bench` does with the verbs rows it measures in the soft-RoCE guest; tcp stands in here).
#[test]
fn json_out_and_merge_print_two_runs_in_one_table() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (host, guest) = (dir.path().join("host.json"), dir.path().join("guest.json"));
    for (transport, file) in [("uds", &host), ("tcp", &guest)] {
        let mut args = vec![
            "--transports",
            transport,
            "--json-out",
            file.to_str().unwrap(),
        ];
        args.extend_from_slice(TINY);
        let o = bench(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("Latency:"), "the tables still print: {text}");
    }
    let o = bench(&[
        "merge",
        host.to_str().unwrap(),
        guest.to_str().unwrap(),
        "--machine",
        "in a stand-in guest",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    let latency = &text[text.find("Latency:").expect("latency table")..];
    let rows: Vec<&str> = latency
        .lines()
        .take_while(|l| !l.is_empty())
        .filter(|l| {
            let mut cells = l.split_whitespace();
            matches!(cells.next(), Some("uds" | "tcp*"))
                && cells.next().is_some_and(|c| c.parse::<f64>().is_ok())
        })
        .collect();
    assert_eq!(rows.len(), 2, "one latency table holds both rows: {text}");
    assert!(text.contains("* measured in a stand-in guest"), "{text}");

    let o = bench(&[
        "merge",
        host.to_str().unwrap(),
        guest.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = v["transports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["transport"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["uds", "tcp*"]);
    assert!(v["transports"][1]["emulated"].is_string());

    let o = bench(&[
        "merge",
        host.to_str().unwrap(),
        dir.path().join("none.json").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("none.json"), "{}", stderr(&o));
}

/// Runs `args` (which hold `--json`) on uds and tcp and returns the report's two transports,
/// once the run succeeded and its `settings[setting]` is `value`; then runs the same without
/// `--json` and returns the table it prints.
fn json_then_table(args: &[&str], setting: &str, value: &str) -> (Vec<serde_json::Value>, String) {
    let o = bench(args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON");
    assert_eq!(v["settings"][setting], value, "{v}");
    let transports = v["transports"].as_array().unwrap().clone();
    assert_eq!(transports.len(), 2, "{v}");
    let table: Vec<&str> = args.iter().copied().filter(|a| *a != "--json").collect();
    let o = bench(&table);
    assert!(o.status.success(), "{}", stderr(&o));
    (transports, String::from_utf8(o.stdout).unwrap())
}

/// `--rpc-io blocking` measures the RPC rows with the blocking client and server: every op
/// answers, the JSON and the tables say which RPC was measured, the client's system calls
/// are counted, and `bench client` refuses it.
#[test]
fn rpc_io_blocking_measures_the_blocking_client_and_server() {
    let args = [
        "--rpc-io",
        "blocking",
        "--json",
        "--transports",
        "uds,tcp",
        "--pings",
        "40",
        "--repeat",
        "1",
        "--sizes",
        "1K,64K",
        "--ops",
        "ping,send,oneway,recv,echo",
        "--bytes",
        "256K",
        "--no-progress",
    ];
    let (transports, out) = json_then_table(&args, "rpc_io", "blocking");
    for t in &transports {
        assert_eq!(t["ping"]["rpc"]["calls"], 40, "{t}");
        assert!(t["ping"]["rpc"]["p50_us"].as_f64().unwrap() > 0.0, "{t}");
        let cells = t["cells"].as_array().unwrap();
        // 4 ops x 2 sizes.
        assert_eq!(cells.len(), 8, "{t}");
        for c in cells {
            assert!(c["rpc"]["mbit_s"]["min"].as_f64().unwrap() > 0.0, "{c}");
            if c["op"] == "send" || c["op"] == "echo" {
                // A call writes its request and reads its answer: both counted.
                let syscalls = c["rpc"]["costs"]["syscalls_per_call"].as_f64().unwrap();
                assert!(syscalls >= 2.0, "{c}");
            }
        }
    }
    assert!(out.contains("RPC: blocking"), "{out}");

    let o = bench(&["client", "127.0.0.1:1", "--rpc-io", "blocking"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("local mode only"), "{}", stderr(&o));
}

/// `--raw-twoway exchange` measures the raw rows of send, recv and echo as the exchanges RPC
/// calls make on the raw connection: every op moves its bytes, a recv message is asked for by
/// a request the client writes (at least one system call per message, where the source's one
/// request serves the whole run), and the JSON and the table say which raw rows were
/// measured.
#[test]
fn raw_twoway_exchange_answers_every_message() {
    let args = [
        "--raw-twoway",
        "exchange",
        "--json",
        "--transports",
        "uds,tcp",
        "--repeat",
        "1",
        "--sizes",
        "1K,64K",
        "--ops",
        "send,recv,echo",
        "--bytes",
        "256K",
        "--no-progress",
    ];
    let (transports, out) = json_then_table(&args, "raw_twoway", "exchange");
    for t in &transports {
        let cells = t["cells"].as_array().unwrap();
        // 3 ops x 2 sizes.
        assert_eq!(cells.len(), 6, "{t}");
        for c in cells {
            let raw = &c["raw"];
            assert!(raw["mbit_s"]["min"].as_f64().unwrap() > 0.0, "{c}");
            if c["op"] == "recv" {
                let syscalls = raw["costs"]["syscalls_per_call"].as_f64().unwrap();
                assert!(syscalls >= 1.0, "a request written per message: {c}");
            }
        }
    }
    assert!(
        out.contains("--raw-twoway exchange: send answered"),
        "{out}"
    );

    let o = bench(&["--raw-twoway", "sideways"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("possible values: stream, exchange"),
        "{}",
        stderr(&o)
    );
}
