//! The terminal tables of `bench scenario`.

use super::*;

/// Tables, one per scenario.
pub fn render(r: &ScenarioReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "placement: {}", r.placement.summary);
    for u in &r.unavailable {
        let _ = writeln!(out, "{}: not available: {}", u.transport, u.reason);
    }
    for &s in &r.scenarios {
        if s == ScenarioName::Framework && !r.framework.is_empty() {
            let _ = writeln!(
                out,
                "\nwhat a framework costs: gRPC (tonic over transport-stream) vs native RPC, one call in flight"
            );
            table(
                &mut out,
                &[
                    "transport",
                    "64 B calls/s gRPC",
                    "native",
                    "1 MiB echo MB/s gRPC",
                    "native",
                    "gRPC/native small",
                    "large",
                ],
                1,
                r.framework
                    .iter()
                    .map(|f| {
                        vec![
                            f.transport.to_string(),
                            format!("{:.0}", f.small_calls_per_s.0),
                            format!("{:.0}", f.small_calls_per_s.1),
                            format!("{:.1}", f.large_mb_per_s.0),
                            format!("{:.1}", f.large_mb_per_s.1),
                            format!("{:.2}x", f.ratio.0),
                            format!("{:.2}x", f.ratio.1),
                        ]
                    })
                    .collect(),
            );
            let _ = writeln!(
                out,
                "\ntarpc on messages (transport-tarpc) vs native RPC, and tarpc's own serde_transport over tcp"
            );
            table(
                &mut out,
                &[
                    "transport",
                    "64 B calls/s tarpc",
                    "1 MiB echo MB/s tarpc",
                    "tarpc/native small",
                    "large",
                    "serde_transport calls/s",
                    "MB/s",
                ],
                1,
                r.framework
                    .iter()
                    .map(|f| {
                        let serde = |x: fn(&(f64, f64)) -> f64, digits: usize| {
                            f.tarpc_serde_tcp
                                .as_ref()
                                .map_or("-".to_string(), |s| format!("{:.*}", digits, x(s)))
                        };
                        vec![
                            f.transport.to_string(),
                            format!("{:.0}", f.tarpc.0),
                            format!("{:.1}", f.tarpc.1),
                            format!("{:.2}x", f.tarpc_ratio.0),
                            format!("{:.2}x", f.tarpc_ratio.1),
                            serde(|s| s.0, 0),
                            serde(|s| s.1, 1),
                        ]
                    })
                    .collect(),
            );
            continue;
        }
        if s == ScenarioName::CAbi && !r.c_abi.is_empty() {
            c_abi_table(&mut out, &r.c_abi);
            continue;
        }
        let rows: Vec<&Row> = r.rows.iter().filter(|x| x.scenario == s.label()).collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(out);
        match s {
            ScenarioName::Typed => typed_table(&mut out, &rows),
            ScenarioName::Structured => {
                let _ = writeln!(
                    out,
                    "structured request ({} B encoded), one call at a time",
                    rows[0].payload_bytes
                );
                table(
                    &mut out,
                    &["transport", "mode", "calls/s", "mean µs", "p99 µs"],
                    2,
                    rows.iter()
                        .map(|x| {
                            vec![
                                x.transport.to_string(),
                                mode_name(x.mode),
                                format!("{:.0}", x.stats.calls_per_s),
                                format!("{:.1}", x.stats.mean_us),
                                format!("{:.1}", x.stats.p99_us),
                            ]
                        })
                        .collect(),
                );
            }
            ScenarioName::Clients | ScenarioName::SlowClients => {
                let _ = writeln!(
                    out,
                    "{} concurrent clients, one connection each, {:.1} s per row ({})",
                    if s == ScenarioName::Clients {
                        "trivial handler:"
                    } else {
                        "slow handler:"
                    },
                    rows[0].load.duration.as_secs_f64(),
                    rows[0].what
                );
                table(
                    &mut out,
                    &[
                        "transport",
                        "clients",
                        "completed",
                        "calls/s",
                        "mean ms",
                        "p99 ms",
                        "calls per client min-max",
                        "fairness",
                    ],
                    1,
                    rows.iter()
                        .map(|x| {
                            vec![
                                x.transport.to_string(),
                                x.load.clients.to_string(),
                                x.stats.completed.to_string(),
                                format!("{:.0}", x.stats.calls_per_s),
                                format!("{:.3}", x.stats.mean_us / 1e3),
                                format!("{:.3}", x.stats.p99_us / 1e3),
                                format!(
                                    "{}-{}",
                                    x.stats.caller_calls_min, x.stats.caller_calls_max
                                ),
                                format!("{:.2}", x.stats.fairness),
                            ]
                        })
                        .collect(),
                );
            }
            ScenarioName::Orb => {
                let _ = writeln!(
                    out,
                    "client shape: {} caller threads over a pool of connections",
                    rows[0].load.clients
                );
                table(
                    &mut out,
                    &[
                        "transport",
                        "shape",
                        "calls/s",
                        "Mbit/s",
                        "mean µs",
                        "p99 µs",
                    ],
                    2,
                    rows.iter()
                        .map(|x| {
                            vec![
                                x.transport.to_string(),
                                x.what.clone(),
                                format!("{:.0}", x.stats.calls_per_s),
                                format!("{:.1}", x.stats.mbit_s),
                                format!("{:.1}", x.stats.mean_us),
                                format!("{:.1}", x.stats.p99_us),
                            ]
                        })
                        .collect(),
                );
            }
            ScenarioName::Framework | ScenarioName::CAbi | ScenarioName::All => {}
        }
    }
    for x in &r.rows {
        if let Some(n) = x.rnr_naks.filter(|&n| n > 0) {
            let _ = writeln!(
                out,
                "{} {} {} ({} clients): the RDMA device counted {n} RNR NAKs ({:.1} per call): \
                 senders found no receive buffer posted and retried; the shared receive queue \
                 ran dry (--verbs-srq-depth; docs/scenarios.md)",
                x.transport,
                x.scenario,
                x.what,
                x.load.clients,
                n as f64 / x.stats.completed.max(1) as f64,
            );
        }
    }
    let _ = writeln!(out, "\nwall time {:.1} s", r.wall_seconds);
    out
}

pub(super) fn mode_name(m: Option<Mode>) -> String {
    match m {
        Some(Mode::Send) => "send",
        Some(Mode::Oneway) => "oneway",
        Some(Mode::Recv) => "recv",
        Some(Mode::Echo) => "echo",
        None => "-",
    }
    .into()
}

/// The c-abi scenario's table.
pub(super) fn c_abi_table(out: &mut String, rows: &[CAbiRow]) {
    let range = |(lo, hi): (f64, f64)| format!("{lo:.2}-{hi:.2}");
    let _ = writeln!(
        out,
        "\nwhat the C ABI costs: transport-ffi's C client vs the same client in Rust, one call in flight, median of {} rounds",
        rows[0].rounds
    );
    table(
        out,
        &[
            "transport",
            "0 B call µs C",
            "Rust",
            "C/Rust",
            "rounds",
            "1 MiB echo MB/s C",
            "Rust",
            "C/Rust time",
            "rounds",
        ],
        1,
        rows.iter()
            .map(|f| {
                vec![
                    f.transport.to_string(),
                    format!("{:.2}", f.small_us.0),
                    format!("{:.2}", f.small_us.1),
                    format!("{:.3}x", f.c_over_rust.0),
                    range(f.c_over_rust_range.0),
                    format!("{:.1}", f.large_mb_per_s.0),
                    format!("{:.1}", f.large_mb_per_s.1),
                    format!("{:.3}x", f.c_over_rust.1),
                    range(f.c_over_rust_range.1),
                ]
            })
            .collect(),
    );
}

/// Typed throughput: one line per (transport, payload kind, size), modes as columns.
pub(super) fn typed_table(out: &mut String, rows: &[&Row]) {
    let _ = writeln!(
        out,
        "typed sequences (postcard), one call at a time, Mbit/s of encoded payload"
    );
    let mut lines: Vec<Vec<String>> = Vec::new();
    let mut keys: Vec<(&str, &str, usize)> = Vec::new();
    for x in rows {
        let k = (x.transport, x.what.as_str(), x.payload_bytes);
        if !keys
            .iter()
            .any(|&(t, w, b)| t == k.0 && w == k.1 && bucket(b) == bucket(k.2))
        {
            keys.push(k);
        }
    }
    for (t, w, b) in keys {
        let mut line = vec![t.to_string(), w.to_string(), size_label(b)];
        for mode in Mode::ALL {
            let cell = rows
                .iter()
                .find(|x| {
                    x.transport == t
                        && x.what == w
                        && bucket(x.payload_bytes) == bucket(b)
                        && x.mode == Some(mode)
                })
                .map_or("-".to_string(), |x| format!("{:.1}", x.stats.mbit_s));
            line.push(cell);
        }
        lines.push(line);
    }
    table(
        out,
        &[
            "transport",
            "payload",
            "encoded",
            "send",
            "oneway",
            "recv",
            "echo",
        ],
        2,
        lines,
    );
}

/// Rows of one size request share a bucket even if their encodings differ by a few bytes.
pub(super) fn bucket(bytes: usize) -> u32 {
    (bytes.max(1) as f64).log2().round() as u32
}

/// Appends a scenario table through the report's [`Table`]: the first `left` columns name the
/// row (aligned left), the others are figures (aligned right); not indented, under its title
/// line.
pub(super) fn table(out: &mut String, head: &[&str], left: usize, rows: Vec<Vec<String>>) {
    let mut t = Table::new(head, left).indent("");
    t.rows(rows);
    t.render(out);
}
