use super::*;

#[test]
fn sizes_print_in_binary_units() {
    assert_eq!(size_label(64 << 10), "64 KiB");
    assert_eq!(size_label(2 << 20), "2 MiB");
    assert_eq!(size_label(1536 << 10), "1536 KiB");
    assert_eq!(size_label(500_000), "500000 B");
}
use crate::measure::{CostFigures, Op};
use crate::suite::{Baseline, Figures, Latency, PingRow};

fn flat(v: f64) -> Stat {
    Stat {
        min: v,
        median: v,
        max: v,
    }
}

fn lat(p50: f64) -> Latency {
    Latency {
        us_per_call: flat(p50),
        calls_s: flat(1e6 / p50),
        p50_us: p50,
        p99_us: 2.0 * p50,
        calls: 1000,
        costs: CostFigures::default(),
    }
}

/// Throughput figures of `mbit` Mbit/s (min = median = max), no costs.
pub(crate) fn fig(mbit: f64) -> Figures {
    Figures {
        mbit_s: flat(mbit),
        calls_s: flat(mbit),
        calls: 100,
        costs: CostFigures::default(),
    }
}

/// A transport with (or without) OS figures: os 10 µs / 40 000 Mbit/s, raw 12 µs /
/// 30 000, rpc 15 µs / 20 000; one send and one echo cell.
pub(crate) fn transport(name: &str, with_os: bool) -> TransportReport {
    let os = with_os.then(|| lat(10.0));
    let cell = |op, os: bool| Cell {
        op,
        raw_op: crate::suite::raw_twin(op),
        size: 256 << 10,
        threads: 1,
        window: 16,
        raw: Some(fig(30_000.0)),
        rpc: fig(20_000.0),
        utilization: Some(20.0 / 30.0),
        os: os.then(|| fig(40_000.0)),
        raw_os_utilization: os.then_some(0.75),
        rpc_os_utilization: os.then_some(0.5),
    };
    TransportReport {
        transport: name.into(),
        os_baseline: if with_os {
            Baseline::sockets("blocking std UnixStream")
        } else {
            Baseline::not_measured("remote mode")
        },
        notes: Vec::new(),
        emulated: None,
        ping: Some(PingRow {
            raw_os_latency_ratio: os.as_ref().map(|_| 1.2),
            rpc_os_latency_ratio: os.as_ref().map(|_| 1.5),
            os,
            raw: Some(lat(12.0)),
            rpc: lat(15.0),
            latency_ratio: Some(1.25),
            mean_latency_ratio: Some(1.25),
        }),
        cells: vec![cell(Op::Send, with_os), cell(Op::Echo, false)],
    }
}

/// A report survives JSON both ways (what `bench merge` reads is what `--json-out`
/// wrote), and merging an emulated run puts its rows in the same tables, marked, with a
/// note naming the machine and its placement, and drops this run's "unavailable" line.
#[test]
fn merged_emulated_rows_share_the_tables_and_say_where_they_were_measured() {
    let mut host = report(vec![transport("uds", true)]);
    host.unavailable.push(Unavailable {
        transport: "verbs".into(),
        reason: "no RDMA device".into(),
    });
    let mut verbs = transport("verbs", true);
    verbs.os_baseline = Baseline::link();
    let mut guest = report(vec![verbs]);
    guest.placement.summary = "no pinning (2 CPUs allowed)".into();
    guest
        .diagnosis
        .push(diagnose(&guest.transports[0], Default::default()).expect("a diagnosis"));
    let json = serde_json::to_string(&guest).expect("serialize");
    let guest: Report = serde_json::from_str(&json).expect("deserialize");
    host.merge_emulated(guest, "in the test guest");

    assert!(host.unavailable.is_empty(), "{:?}", host.unavailable);
    assert_eq!(host.transports[1].transport, "verbs*");
    assert_eq!(
        host.transports[1].emulated.as_deref(),
        Some("in the test guest; placement: no pinning (2 CPUs allowed)")
    );
    let text = host.render();
    let uds = row(&text, "Latency", &["uds"]);
    let verbs = row(&text, "Latency", &["verbs*"]);
    assert_eq!(uds.len(), verbs.len(), "{text}");
    assert!(
        row(&text, "Throughput", &["verbs*", "send"]).len() > 5,
        "{text}"
    );
    assert!(
        text.contains(
            "verbs*     * measured in the test guest; placement: no pinning (2 CPUs allowed); \
             compare its ratios (against its own link), not its figures, with the rows of \
             this machine"
        ),
        "{text}"
    );
    assert!(text.contains("the link (verbs*)"), "{text}");
    assert_eq!(host.diagnosis[0].transport, "verbs*");
    assert!(
        host.diagnosis[0].verdict.starts_with("verbs*:"),
        "{:?}",
        host.diagnosis[0]
    );
    let latency = host.diagnosis[0]
        .latency_verdict
        .as_deref()
        .expect("a latency line");
    assert!(latency.starts_with("verbs* latency:"), "{latency}");
    // The marker stays out of this machine's own rows in JSON.
    let v: serde_json::Value = serde_json::to_value(&host).expect("json");
    assert!(v["transports"][0].get("emulated").is_none());
    assert_eq!(
        v["transports"][1]["emulated"],
        "in the test guest; placement: no pinning (2 CPUs allowed)"
    );
}

/// The latency line names wake-ups when RPC's round trip has more context switches than
/// the OS's, system calls when it has more reads and writes, and CPU otherwise; nothing
/// without an os baseline.
#[test]
fn verbs_latency_verdict_reads_against_the_link_and_names_channel_syscalls() {
    let mut t = transport("verbs", true);
    t.os_baseline = Baseline::link();
    t.ping.as_mut().unwrap().rpc.costs.syscalls_per_call = 0.0;
    t.ping
        .as_mut()
        .unwrap()
        .raw
        .as_mut()
        .unwrap()
        .costs
        .syscalls_per_call = 4.0;
    let v = latency_verdict(&t).expect("link measured");
    assert!(
        v.starts_with("verbs latency: RPC p50 15.0 µs = 1.50x the link's busy-polled SEND ping-pong (10.0 µs)"),
        "{v}"
    );
    assert!(v.contains("per round trip 0.0 for RPC, 4.0 raw"), "{v}");
    assert!(!v.contains("the OS"), "{v}");
}

#[test]
fn latency_verdict_names_wake_ups_or_syscalls_against_the_os() {
    let mut t = transport("uds", true);
    let set = |l: &mut Latency, switches: f64, calls: f64| {
        l.costs.context_switches_per_call = switches;
        l.costs.syscalls_per_call = calls;
    };
    set(t.ping.as_mut().unwrap().os.as_mut().unwrap(), 2.0, 2.0);
    set(t.ping.as_mut().unwrap().raw.as_mut().unwrap(), 4.0, 2.0);
    set(&mut t.ping.as_mut().unwrap().rpc, 4.1, 2.0);
    let v = latency_verdict(&t).expect("os measured");
    assert!(v.starts_with("uds latency: RPC p50 15.0 µs = 1.50x"), "{v}");
    assert!(v.contains("the gap is wake-ups: 4.1 context switches per round trip for RPC and 4.0 raw against 2.0"), "{v}");
    set(&mut t.ping.as_mut().unwrap().rpc, 2.0, 3.0);
    let v = latency_verdict(&t).unwrap();
    assert!(
        v.contains("the gap is system calls: 3.0 reads and writes"),
        "{v}"
    );
    set(&mut t.ping.as_mut().unwrap().rpc, 2.0, 2.0);
    let v = latency_verdict(&t).unwrap();
    assert!(v.contains("match the OS: the rest is CPU"), "{v}");
    let mut close = transport("uds", true);
    close.ping.as_mut().unwrap().rpc.p50_us = 10.5;
    let v = latency_verdict(&close).unwrap();
    assert!(v.contains("at the OS's limit"), "{v}");
    assert!(latency_verdict(&transport("tcp", false)).is_none());
    let v = latency_verdict(&t).unwrap();
    let d = diagnose(&t, Default::default()).expect("a diagnosis");
    assert_eq!(d.latency_verdict.as_deref(), Some(&v[..]));
    let mut r = report(vec![t]);
    r.diagnosis.push(d);
    let rendered = r.render();
    assert!(rendered.contains(&format!("  {v}\n")), "{rendered}");
}

/// Local mode, client and server on CPU 0.
pub(crate) fn placement() -> Placement {
    Placement {
        mode: "local".into(),
        client_core: Some(0),
        server_core: Some(0),
        allowed_cpus: vec![0],
        summary: "same CPU 0".into(),
    }
}

/// A local run of `transports`: one 256 KB size, one thread, send and echo.
pub(crate) fn report(transports: Vec<TransportReport>) -> Report {
    let settings = crate::suite::Settings {
        sizes: vec![256 << 10],
        threads: vec![1],
        ops: vec![Op::Send, Op::Echo],
        layers: vec![crate::measure::Layer::Raw, crate::measure::Layer::Rpc],
        ping: true,
        pings: 1000,
        repeat: 1,
        bytes_per_run: 1 << 20,
        min_calls: 1,
        max_calls: 10,
        window: 16,
        window_bytes: 2 << 20,
        verbs_window_bytes: 8 << 20,
        echo_both_ways: true,
        client_core: Some(0),
        rpc_io: Default::default(),
        heap_payload: false,
        raw_twoway: Default::default(),
    };
    Report {
        version: "test".into(),
        machine: None,
        placement: placement(),
        settings,
        transports,
        unavailable: Vec::new(),
        diagnosis: Vec::new(),
        wall_seconds: 1.0,
    }
}

/// The line of `table` (rendered text) whose first cells are `first`, split in cells.
fn row<'a>(text: &'a str, header: &str, first: &[&str]) -> Vec<&'a str> {
    let table = &text[text.find(header).unwrap_or_else(|| panic!("{text}"))..];
    table
        .lines()
        .map(|l| {
            l.split("  ")
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .collect::<Vec<_>>()
        })
        .find(|cells| cells.starts_with(first))
        .unwrap_or_else(|| panic!("no row {first:?} in {table}"))
}

/// The tables show os beside raw and rpc, and raw and rpc against os; raw and rpc keep
/// their order and their meaning beside it.
#[test]
fn tables_show_the_os_column_and_the_utilization_against_it() {
    let text = report(vec![transport("uds", true), transport("tcp", false)]).render();
    assert!(
        text.contains(", against the OS's own sockets (uds) (local mode)"),
        "the title names the transports measured against the OS: {text}"
    );

    let h = row(&text, "transport", &["transport", "os µs/rt"]);
    assert_eq!(
        h,
        [
            "transport",
            "os µs/rt",
            "os p50/p99 µs",
            "raw µs/rt",
            "raw p50/p99 µs",
            "rpc µs/call",
            "rpc p50/p99 µs",
            "rpc calls/s",
            "rpc/raw p50",
            "rpc/raw mean",
            "raw/os p50",
            "rpc/os p50"
        ]
    );
    let uds = row(&text, "os µs/rt", &["uds"]);
    assert_eq!(uds[1..3], ["10.0 (10.0-10.0)", "10.0 / 20.0"]);
    assert_eq!(uds[8..], ["1.25x", "1.25x", "1.20x", "1.50x"]);
    let tcp = row(&text, "os µs/rt", &["tcp"]);
    assert_eq!(tcp[1..3], ["n/a", "n/a"]);
    assert_eq!(tcp[10..], ["n/a", "n/a"]);
    assert!(
        text.contains("tcp        os: not measured: remote mode"),
        "{text}"
    );

    let h = row(&text, "Throughput", &["transport", "op"]);
    assert_eq!(
        h,
        [
            "transport",
            "op",
            "size",
            "threads",
            "window",
            "os Mbit/s",
            "raw Mbit/s",
            "rpc Mbit/s",
            "rpc calls/s",
            "util",
            "raw/os",
            "rpc/os"
        ]
    );
    let send = row(&text, "Throughput", &["uds", "send"]);
    assert_eq!(send[4], "16", "the window of the cell");
    assert_eq!(send[5], "40000 (40000-40000)");
    assert_eq!(send[9..], ["67%", "75%", "50%"]);
    // Echo has no OS twin; a transport without the baseline says n/a.
    let echo = row(&text, "Throughput", &["uds", "echo"]);
    assert_eq!((echo[5], &echo[10..]), ("-", &["-", "-"][..]));
    let tcp = row(&text, "Throughput", &["tcp", "send"]);
    assert_eq!((tcp[5], &tcp[10..]), ("n/a", &["n/a", "n/a"][..]));
}

/// Without any OS figures (remote mode) the tables are the ones without os columns.
#[test]
fn without_os_figures_the_os_columns_are_left_out() {
    let text = report(vec![transport("tcp", false)]).render();
    assert!(
        !text.contains("os Mbit/s") && !text.contains("rpc/os"),
        "{text}"
    );
    assert!(!text.contains("against the OS"), "{text}");
    let h = row(&text, "transport", &["transport"]);
    assert_eq!(h[1], "raw µs/rt");
    assert!(text.contains("os: not measured: remote mode"), "{text}");
}

/// The JSON report has the OS figures and ratios, null where not measured.
#[test]
fn json_has_the_os_figures() {
    let v = serde_json::to_value(report(vec![
        transport("uds", true),
        transport("tcp", false),
    ]))
    .unwrap();
    let uds = &v["transports"][0];
    assert_eq!(uds["ping"]["os"]["p50_us"], 10.0);
    assert_eq!(uds["ping"]["rpc_os_latency_ratio"], 1.5);
    assert_eq!(uds["ping"]["raw_os_latency_ratio"], 1.2);
    assert_eq!(uds["cells"][0]["os"]["mbit_s"]["median"], 40_000.0);
    assert_eq!(uds["cells"][0]["window"], 16, "the window each cell used");
    assert_eq!(uds["cells"][0]["rpc_os_utilization"], 0.5);
    assert_eq!(uds["cells"][0]["raw_os_utilization"], 0.75);
    assert!(uds["cells"][1]["os"].is_null());
    let tcp = &v["transports"][1];
    assert!(tcp["ping"]["os"].is_null());
    assert!(tcp["ping"]["rpc_os_latency_ratio"].is_null());
    assert!(tcp["os_baseline"]
        .as_str()
        .unwrap()
        .starts_with("not measured"));
}

/// The kind of limit is typed in the report and named in the JSON beside the text.
#[test]
fn json_names_the_kind_of_os_baseline() {
    let mut verbs = transport("verbs", true);
    verbs.os_baseline = Baseline::link();
    let v = serde_json::to_value(report(vec![
        transport("uds", true),
        transport("tcp", false),
        verbs,
    ]))
    .unwrap();
    let kinds: Vec<(&str, &str)> = v["transports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["os_baseline_kind"].as_str().unwrap(),
                t["os_baseline"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(kinds[0], ("sockets", "blocking std UnixStream"));
    assert_eq!(kinds[1], ("not_measured", "not measured: remote mode"));
    assert_eq!(kinds[2].0, "link");
    assert!(kinds[2].1.starts_with("link: "), "{kinds:?}");
}

/// The title names what each transport was measured against: the OS's sockets, the link
/// (verbs), both, or nothing; a verbs run never claims the OS's sockets.
#[test]
fn title_names_the_limit_each_transport_was_measured_against() {
    let title = |r: Report| r.render().lines().next().unwrap().to_string();
    let link = || {
        let mut t = transport("verbs", true);
        t.os_baseline = Baseline::link();
        t
    };
    let mut remote = report(vec![link()]);
    remote.placement.mode = "remote".into();
    assert_eq!(
        title(remote),
        "bench test: raw backend connection vs RPC over it, against the link (verbs) (remote mode)"
    );
    assert_eq!(
        title(report(vec![
            transport("uds", true),
            transport("tcp", true),
            link()
        ])),
        "bench test: raw backend connection vs RPC over it, against the OS's own sockets (uds, tcp) and the link (verbs) (local mode)"
    );
    assert_eq!(
        title(report(vec![transport("tcp", false)])),
        "bench test: raw backend connection vs RPC over it (local mode)"
    );
}

/// `t` as `--only rpc` measures it: RPC figures only.
fn rpc_only(mut t: TransportReport) -> TransportReport {
    t.os_baseline = Baseline::not_measured(crate::suite::ONLY_RPC);
    if let Some(p) = &mut t.ping {
        p.os = None;
        p.raw = None;
        p.latency_ratio = None;
        p.mean_latency_ratio = None;
        p.raw_os_latency_ratio = None;
        p.rpc_os_latency_ratio = None;
    }
    for c in &mut t.cells {
        c.raw = None;
        c.utilization = None;
        c.os = None;
        c.raw_os_utilization = None;
        c.rpc_os_utilization = None;
    }
    t
}

/// An `--only rpc` report: the tables have the rpc columns and no raw, util or os columns,
/// and say that raw and os were not measured; no diagnosis is made (it needs raw).
#[test]
fn rpc_only_tables_leave_out_raw_and_os_and_say_so() {
    let mut r = report(vec![rpc_only(transport("uds", true))]);
    r.settings.layers = vec![crate::measure::Layer::Rpc];
    assert!(
        diagnose(&r.transports[0], Default::default()).is_none(),
        "no raw, no diagnosis"
    );
    let text = r.render();
    assert!(
        text.lines()
            .next()
            .unwrap()
            .contains("RPC alone (--only rpc"),
        "{text}"
    );
    let h = row(&text, "Latency", &["transport"]);
    assert_eq!(
        h,
        ["transport", "rpc µs/call", "rpc p50/p99 µs", "rpc calls/s"]
    );
    let uds = row(&text, "Latency", &["uds"]);
    assert_eq!(uds[1..], ["15.0 (15.0-15.0)", "15.0 / 30.0", "66667"]);
    let h = row(&text, "Throughput", &["transport", "op"]);
    assert_eq!(
        h,
        [
            "transport",
            "op",
            "size",
            "threads",
            "window",
            "rpc Mbit/s",
            "rpc calls/s"
        ]
    );
    let send = row(&text, "Throughput", &["uds", "send"]);
    assert_eq!(send[5], "20000 (20000-20000)");
    // The headers above have no util column; no table anywhere has a raw or os one.
    for absent in ["raw µs/rt", "raw Mbit/s", "os µs/rt", "os Mbit/s", "rpc/os"] {
        assert!(!text.contains(absent), "`{absent}` in:\n{text}");
    }
    assert!(
        text.contains("raw and os: not measured (--only rpc)"),
        "the latency section says so: {text}"
    );
    assert!(
        text.contains("raw, util and os: not measured (--only rpc)"),
        "the throughput section says so: {text}"
    );
    assert!(text.contains("Diagnosis: none"), "{text}");
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("  uds") && l.contains("os: not measured")),
        "no per-transport line repeats it: {text}"
    );
}

/// The JSON of an `--only rpc` report: null where raw and os were not measured, never a
/// zero, and the settings name the one layer measured.
#[test]
fn rpc_only_json_has_nulls_not_zeros() {
    let mut r = report(vec![rpc_only(transport("uds", true))]);
    r.settings.layers = vec![crate::measure::Layer::Rpc];
    let v = serde_json::to_value(r).unwrap();
    assert_eq!(v["settings"]["layers"], serde_json::json!(["rpc"]));
    let uds = &v["transports"][0];
    assert_eq!(uds["os_baseline_kind"], "not_measured");
    for k in ["raw", "os", "latency_ratio", "mean_latency_ratio"] {
        assert!(uds["ping"][k].is_null(), "ping.{k}: {uds}");
    }
    assert_eq!(uds["ping"]["rpc"]["p50_us"], 15.0);
    for c in uds["cells"].as_array().unwrap() {
        for k in ["raw", "utilization", "os", "raw_os_utilization"] {
            assert!(c[k].is_null(), "cells[].{k}: {c}");
        }
        assert_eq!(c["rpc"]["mbit_s"]["median"], 20_000.0);
    }
}

/// The one table renderer: each column as wide as its widest cell, the first `left`
/// columns aligned left and the rest right, two spaces between, the indent before each
/// line and no trailing spaces.
#[test]
fn table_aligns_columns_and_indents() {
    let mut t = Table::new(&["name", "kind", "n"], 2);
    t.row(vec!["a".into(), "long kind".into(), "1".into()]);
    t.rows([vec!["bbb".into(), "k".into(), "1000".into()]]);
    let mut out = String::new();
    t.render(&mut out);
    assert_eq!(
        out,
        "  name  kind          n\n  a     long kind     1\n  bbb   k          1000\n"
    );
    let mut out = String::new();
    let mut t = Table::new(&["name", "n"], 1).indent("");
    t.row(vec!["x".into(), "22".into()]);
    t.render(&mut out);
    assert_eq!(out, "name   n\nx     22\n");
}

/// A diagnosis where RPC costs exactly what raw does.
fn even() -> Diagnosis {
    Diagnosis {
        transport: "uds".into(),
        basis: "send 256 KiB x 1 thread(s)".into(),
        utilization: 0.9,
        copies_per_byte: 0.0,
        raw_copies_per_byte: 0.0,
        page_faults_per_call: 0.0,
        raw_page_faults_per_call: 0.0,
        context_switches_per_call: 2.6,
        raw_context_switches_per_call: 2.6,
        syscalls_per_call: 2.0,
        raw_syscalls_per_call: 2.0,
        registrations_per_call: 0.0,
        mean_in_flight: 8.0,
        cpu_ms_per_gb: 150.0,
        raw_cpu_ms_per_gb: 150.0,
        ping_cpu_us: (9.0, 9.0),
        verdict: String::new(),
        latency_verdict: None,
    }
}

#[test]
fn names_the_reply_syscalls_of_twoway_calls() {
    let d = Diagnosis {
        syscalls_per_call: 2.6,
        ..even()
    };
    let v = verdict(&d, 0.89, Some(1.05), true, false);
    assert!(
        v.starts_with("uds: the largest cost is system calls: 2.60"),
        "{v}"
    );
    assert!(v.contains("a twoway call is two messages"), "{v}");
    assert!(!verdict(&d, 0.89, Some(1.05), false, false).contains("twoway"));
    // Raw made the same exchange (`--raw-twoway exchange`): no second message to blame.
    let v = verdict(&d, 0.89, Some(1.05), true, true);
    assert!(
        v.contains("system calls: 2.60") && !v.contains("twoway"),
        "{v}"
    );
}

#[test]
fn names_wake_ups_copies_and_the_window() {
    let switches = Diagnosis {
        context_switches_per_call: 1.93,
        raw_context_switches_per_call: 0.31,
        ..even()
    };
    assert!(verdict(&switches, 0.74, Some(1.1), true, false).contains("wake-ups: 1.93"));
    let copies = Diagnosis {
        copies_per_byte: 1.0,
        ..even()
    };
    assert!(verdict(&copies, 0.6, Some(1.1), true, false).contains("payload copies: 1.00"));
    let sync = Diagnosis {
        mean_in_flight: 1.0,
        ..even()
    };
    assert!(verdict(&sync, 0.5, Some(1.1), true, false).contains("too few calls in flight"));
}

#[test]
fn the_header_says_an_echo_counts_both_ways_where_it_does() {
    let mut r = report(vec![transport("uds", true)]);
    assert!(r
        .render()
        .contains("2 MiB in flight per client thread (an echo's payload counted out and back)"));
    r.settings.echo_both_ways = false;
    assert!(!r.render().contains("counted out and back"));
}

#[test]
fn says_so_when_nothing_costs_more() {
    let v = verdict(&even(), 0.99, Some(1.02), true, false);
    assert!(v.contains("no measurable cost above raw"), "{v}");
}
