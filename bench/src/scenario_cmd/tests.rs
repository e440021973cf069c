use super::*;
use crate::plot::tests::{has_raw_byte_count, labels};

fn row(scenario: ScenarioName, transport: &'static str, what: &str, x: usize, y: f64) -> Row {
    let clients = if scenario == ScenarioName::Typed {
        1
    } else {
        x
    };
    Row {
        scenario: scenario.label(),
        transport,
        what: what.into(),
        mode: (scenario == ScenarioName::Typed).then_some(Mode::Echo),
        payload_bytes: if scenario == ScenarioName::Typed {
            x
        } else {
            0
        },
        load: shape(clients, clients, 1, 0.5),
        stats: Stats {
            completed: y as u64,
            seconds: 0.5,
            calls_per_s: 2.0 * y,
            mbit_s: y,
            mean_us: 10.0,
            p50_us: 9.0,
            p99_us: 20.0,
            caller_calls_min: (y as u64 / clients as u64).saturating_sub(1),
            caller_calls_max: y as u64 / clients as u64 + 1,
            fairness: 0.99,
        },
        rnr_naks: None,
    }
}

/// The scenario tables are drawn by the report's one table renderer, under their title
/// and without indent: names aligned left, figures (client counts too) aligned right.
#[test]
fn scenario_tables_render_through_the_report_table() {
    let report = ScenarioReport {
        version: "test",
        scenarios: vec![
            ScenarioName::Clients,
            ScenarioName::Framework,
            ScenarioName::CAbi,
        ],
        placement: crate::report::tests::placement(),
        rows: vec![
            row(ScenarioName::Clients, "uds", "ping", 10, 1000.0),
            row(ScenarioName::Clients, "uds", "ping", 100, 100_000.0),
        ],
        framework: vec![FrameworkRow {
            transport: "uds",
            small_calls_per_s: (1000.0, 40_000.0),
            large_mb_per_s: (150.0, 750.0),
            ratio: (0.03, 0.2),
            tarpc: (12_000.0, 500.0),
            tarpc_ratio: (0.3, 0.67),
            tarpc_serde_tcp: None,
        }],
        c_abi: vec![CAbiRow {
            transport: "tcp",
            rounds: 3,
            small_bytes: 0,
            small_us: (22.0, 21.75),
            large_bytes: 1 << 20,
            large_mb_per_s: (2213.7, 2212.9),
            c_over_rust: (1.0115, 0.9661),
            c_over_rust_range: ((1.004, 1.05), (0.81, 1.32)),
        }],
        unavailable: vec![Unavailable {
            transport: "verbs".into(),
            reason: "no RDMA device found".into(),
        }],
        wall_seconds: 1.0,
    };
    let text = render(&report);
    let want = "\
placement: same CPU 0
verbs: not available: no RDMA device found

trivial handler: concurrent clients, one connection each, 0.5 s per row (ping)
transport  clients  completed  calls/s  mean ms  p99 ms  calls per client min-max  fairness
uds             10       1000     2000    0.010   0.020                    99-101      0.99
uds            100     100000   200000    0.010   0.020                  999-1001      0.99

what a framework costs: gRPC (tonic over transport-stream) vs native RPC, one call in flight
transport  64 B calls/s gRPC  native  1 MiB echo MB/s gRPC  native  gRPC/native small  large
uds                     1000   40000                 150.0   750.0              0.03x  0.20x

tarpc on messages (transport-tarpc) vs native RPC, and tarpc's own serde_transport over tcp
transport  64 B calls/s tarpc  1 MiB echo MB/s tarpc  tarpc/native small  large  serde_transport calls/s  MB/s
uds                     12000                  500.0               0.30x  0.67x                        -     -

what the C ABI costs: transport-ffi's C client vs the same client in Rust, one call in flight, median of 3 rounds
transport  0 B call µs C   Rust  C/Rust     rounds  1 MiB echo MB/s C    Rust  C/Rust time     rounds
tcp                22.00  21.75  1.012x  1.00-1.05             2213.7  2212.9       0.966x  0.81-1.32

wall time 1.0 s
";
    assert_eq!(text, want, "{text}");
}

/// A verbs row during which the device counted RNR NAKs says so under the table, with
/// the count per call and what to raise; rows without any (or without the counter) do not.
#[test]
fn rnr_naks_of_a_row_are_named_under_the_table() {
    let mut storm = row(ScenarioName::Clients, "verbs", "ping", 1000, 200.0);
    storm.rnr_naks = Some(900);
    let mut calm = row(ScenarioName::Clients, "verbs", "ping", 10, 1000.0);
    calm.rnr_naks = Some(0);
    let report = ScenarioReport {
        version: "test",
        scenarios: vec![ScenarioName::Clients],
        placement: crate::report::tests::placement(),
        rows: vec![
            calm,
            storm,
            row(ScenarioName::Clients, "uds", "ping", 10, 1.0),
        ],
        framework: Vec::new(),
        c_abi: Vec::new(),
        unavailable: Vec::new(),
        wall_seconds: 1.0,
    };
    let text = render(&report);
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("RNR NAKs")).collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert!(
        lines[0].starts_with("verbs clients ping (1000 clients): the RDMA device counted 900 RNR NAKs (4.5 per call)"),
        "{}",
        lines[0]
    );
    assert!(lines[0].contains("--verbs-srq-depth"), "{}", lines[0]);
}

/// Typed echo at encoded sizes that are not powers of two, and the clients scenario: the
/// size axis reads 1K .. 512K, the legend names every line.
#[test]
fn scenario_plot_has_size_ticks_and_a_legend_per_line() {
    let mut rows = Vec::new();
    for t in ["uds", "tcp"] {
        for (what, sizes) in [
            ("string", [1024, 65441, 499_293]),
            ("i64+i64+f64", [1029, 74476, 602_916]),
        ] {
            for s in sizes {
                rows.push(row(ScenarioName::Typed, t, what, s, s as f64 / 100.0));
            }
        }
        for c in [10, 20, 50, 100] {
            rows.push(row(ScenarioName::Clients, t, "ping", c, 1000.0 * c as f64));
        }
    }
    let report = ScenarioReport {
        version: "test",
        scenarios: vec![
            ScenarioName::Typed,
            ScenarioName::Clients,
            ScenarioName::Framework,
            ScenarioName::CAbi,
        ],
        placement: crate::report::tests::placement(),
        rows,
        framework: vec![FrameworkRow {
            transport: "uds",
            small_calls_per_s: (1000.0, 40_000.0),
            large_mb_per_s: (150.0, 750.0),
            ratio: (0.025, 0.2),
            tarpc: (12_000.0, 500.0),
            tarpc_ratio: (0.3, 0.67),
            tarpc_serde_tcp: Some((11_000.0, 450.0)),
        }],
        c_abi: vec![CAbiRow {
            transport: "uds",
            rounds: 3,
            small_bytes: 0,
            small_us: (14.7, 14.6),
            large_bytes: 1 << 20,
            large_mb_per_s: (2949.4, 2976.5),
            c_over_rust: (1.01, 1.015),
            c_over_rust_range: ((1.0, 1.02), (0.99, 1.03)),
        }],
        unavailable: Vec::new(),
        wall_seconds: 1.0,
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("scenario.svg");
    write_svg(&report, &path).unwrap();
    let labels = labels(&std::fs::read_to_string(&path).unwrap());
    let has = |l: &str| labels.iter().any(|x| x == l);
    for l in [
        "uds string",
        "uds i64+i64+f64",
        "tcp string",
        "tcp i64+i64+f64",
        "uds clients",
        "tcp clients",
        "gRPC",
        "tarpc",
        "native",
        "C",
        "Rust",
    ] {
        assert!(has(l), "no legend {l:?} in {labels:?}");
    }
    for tick in ["1K", "64K", "512K", "10", "100"] {
        assert!(has(tick), "no tick {tick:?} in {labels:?}");
    }
    assert!(!has_raw_byte_count(&labels), "{labels:?}");
    assert!(!labels.iter().any(|l| l.contains("499293")), "{labels:?}");
    assert!(has("framework: 64 B unary calls/s"), "{labels:?}");
    assert!(has("c-abi: 1 MiB echo, MB/s"), "{labels:?}");
}
