//! The `bench` command line as a user runs it: argument errors, JSON output, the SVG plot,
//! the doctor. No timing is asserted: only shape and consistency.

mod common;

use common::{bench, stderr};
use std::process::Command;

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
    for t in transports {
        assert_eq!(t["ping"]["raw"]["calls"], 40);
        assert_eq!(t["ping"]["rpc"]["calls"], 40);
        // The OS baseline of uds and tcp, in the same run: as many round trips.
        assert_eq!(t["ping"]["os"]["calls"], 40, "{t}");
        assert!(t["ping"]["os"]["p50_us"].as_f64().unwrap() > 0.0);
        assert!(t["ping"]["rpc_os_latency_ratio"].as_f64().unwrap() > 0.0);
        assert!(t["os_baseline"].as_str().unwrap().contains("blocking"));
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

/// A loopback address with a port that was free a moment ago.
fn free_loopback_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// Starts `bench server ARGS` and waits (at most 4 s) until `up` says it accepts; returns
/// the child and whether it came up.
fn start_server(args: &[&str], up: impl Fn() -> bool) -> (std::process::Child, bool) {
    let server = Command::new(env!("CARGO_BIN_EXE_bench"))
        .arg("server")
        .args(args)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    for _ in 0..200 {
        if up() {
            return (server, true);
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    (server, false)
}

#[test]
fn server_and_client_across_a_socket() {
    // Two-host mode, on loopback: `bench server` in one process, `bench client` in another.
    let listen = free_loopback_addr();
    let (mut server, up) = start_server(&["--listen", &listen], || {
        std::net::TcpStream::connect(&listen).is_ok()
    });
    let result = up.then(|| {
        let mut args = vec!["client", listen.as_str(), "--json"];
        args.extend_from_slice(TINY);
        bench(&args)
    });
    let _ = server.kill();
    let _ = server.wait();
    let o = result.expect("bench server did not start listening");
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["placement"]["mode"], "remote");
    assert_eq!(v["transports"][0]["transport"], "tcp");
    assert_eq!(v["transports"][0]["cells"].as_array().unwrap().len(), 4);
    // No OS baseline against a remote server, and the report says why.
    assert!(v["transports"][0]["ping"]["os"].is_null());
    let why = v["transports"][0]["os_baseline"].as_str().unwrap();
    assert!(why.contains("remote mode"), "{why}");
}

/// `bench client unix:PATH` runs the comparison against `bench server --uds PATH`, and
/// `--transports` (which the client would ignore) is refused.
#[test]
fn client_reaches_the_servers_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("b.sock");
    let listen = free_loopback_addr();
    let sock_arg = sock.to_str().expect("utf-8 path");
    let (mut server, up) = start_server(&["--listen", &listen, "--uds", sock_arg], || {
        std::os::unix::net::UnixStream::connect(&sock).is_ok()
    });
    let target = format!("unix:{}", sock.display());
    let result = up.then(|| {
        let mut args = vec!["client", target.as_str(), "--json"];
        args.extend_from_slice(TINY);
        let ok = bench(&args);
        let refused = bench(&["client", target.as_str(), "--transports", "tcp"]);
        (ok, refused)
    });
    let _ = server.kill();
    let _ = server.wait();
    let (o, refused) = result.expect("bench server did not start listening on its socket");
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
