//! `bench scenario NAME`: the classic middleware scenarios on every transport.
//!
//! ```text
//! bench scenario typed         sequences of strings / {string,f64} / {i64,i64,f64}: send, oneway, recv, echo in Mbit/s
//! bench scenario structured    a ~2.2 KB structured request (records + string array): calls/s
//! bench scenario clients       10, 20, 30, 50, 100 concurrent clients, trivial handler
//! bench scenario slow-clients  the same with a handler that takes 500 ms (a timer, no CPU)
//! bench scenario orb           "one call per connection, five connections" vs the pipelined default
//! bench scenario framework     gRPC (tonic over the byte-stream adapter) vs native RPC, same transport
//! bench scenario all           every scenario above
//! ```
//!
//! Each prints one table per scenario, or JSON with `--json`, and `--plot FILE.svg` draws it.

use crate::report::{size_label, Placement, Unavailable};
use crate::{placement, Pin, TransportName};
use bench::scenarios::load::{
    run_load, LoadConfig, Mode, Ping, ScenarioHandler, SendBytes, Slow, Stats, Typed, TypedKind,
    Workload,
};
use bench::scenarios::typed::{elements_for, Fixed, StringDouble, Structured};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use plotters::prelude::*;
use serde::Serialize;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_core::rpc::{RpcServer, ServerConfig};
use transport_core::Transport;
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};

/// The scenarios.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScenarioName {
    /// Typed sequences through serde (postcard): send / oneway / recv / echo in Mbit/s.
    Typed,
    /// A ~2.2 KB structured request, in calls/s.
    Structured,
    /// Many concurrent clients (one connection each), trivial handler.
    Clients,
    /// Many concurrent clients with a slow handler (`--handler-ms`, default 500).
    SlowClients,
    /// The client's connection / in-flight shape: classic ORB pool vs pipelined.
    Orb,
    /// What a framework costs: gRPC (tonic over `transport-stream`) vs native RPC.
    Framework,
    /// Every scenario.
    All,
}

impl ScenarioName {
    fn expand(self) -> Vec<ScenarioName> {
        match self {
            ScenarioName::All => vec![
                ScenarioName::Typed,
                ScenarioName::Structured,
                ScenarioName::Clients,
                ScenarioName::SlowClients,
                ScenarioName::Orb,
                ScenarioName::Framework,
            ],
            s => vec![s],
        }
    }

    fn label(self) -> &'static str {
        match self {
            ScenarioName::Typed => "typed",
            ScenarioName::Structured => "structured",
            ScenarioName::Clients => "clients",
            ScenarioName::SlowClients => "slow-clients",
            ScenarioName::Orb => "orb",
            ScenarioName::Framework => "framework",
            ScenarioName::All => "all",
        }
    }

    /// Seconds per measurement unless `--seconds` says otherwise.
    fn default_seconds(self) -> f64 {
        match self {
            ScenarioName::Typed => 0.3,
            ScenarioName::Structured | ScenarioName::Orb => 1.0,
            ScenarioName::Clients => 2.0,
            ScenarioName::SlowClients => 3.0,
            ScenarioName::Framework | ScenarioName::All => 1.0,
        }
    }
}

/// Arguments of `bench scenario`.
#[derive(Args, Debug, Clone)]
pub struct ScenarioArgs {
    /// Which scenario to run.
    #[arg(value_enum)]
    pub name: ScenarioName,
    /// Transports to measure.
    #[arg(long, value_delimiter = ',', value_enum, default_values_t = [TransportName::Uds, TransportName::Tcp, TransportName::Verbs])]
    pub transports: Vec<TransportName>,
    /// Seconds per measurement (default: typed 0.3, structured/orb 1, clients 2, slow-clients 3).
    #[arg(long, value_parser = parse_seconds)]
    pub seconds: Option<f64>,
    /// Sequence sizes of the typed scenario, encoded bytes (K = 1024, M = 1048576).
    #[arg(long, value_delimiter = ',', value_parser = crate::parse_size, default_value = "1K,64K,500000")]
    pub sizes: Vec<usize>,
    /// Concurrent clients of the clients scenarios (each has its own connection).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=1000), default_value = "10,20,30,50,100")]
    pub clients: Vec<u16>,
    /// Handler time of the slow-clients scenario, in ms.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub handler_ms: u64,
    /// Orb scenario: client threads (callers) sharing the connections.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub threads: u16,
    /// Orb scenario: connections of the classic row.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub connections: u16,
    /// Orb scenario: calls in flight per connection of the classic row.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub in_flight: u16,
    /// Orb scenario: payload of each call (K/M suffixes).
    #[arg(long, default_value = "64K", value_parser = crate::parse_size)]
    pub payload: usize,
    /// Framework scenario: number of small (64 B) unary calls per framework.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub small_calls: u64,
    /// Framework scenario: number of 1 MiB unary echoes per framework.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub large_calls: u64,
    /// CPU placement of client and server.
    #[arg(long, value_enum, default_value_t = Pin::Same)]
    pub pin: Pin,
    /// Print the report as JSON on stdout instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot of the results to this file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('s').parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 3600.0 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a duration in seconds between 0 and 3600 (e.g. 0.5)"
        )),
    }
}

/// One measured row.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Scenario name.
    pub scenario: &'static str,
    /// Transport name.
    pub transport: &'static str,
    /// Payload kind (typed, structured), or the client shape (orb), or "ping" / "sleep".
    pub what: String,
    /// Mode (send / oneway / recv / echo), where it applies.
    pub mode: Option<Mode>,
    /// Encoded payload bytes per call (typed, structured, orb).
    pub payload_bytes: usize,
    /// The client shape.
    pub load: LoadConfig,
    /// The figures.
    pub stats: Stats,
}

/// gRPC vs native RPC on one transport (the framework scenario).
#[derive(Debug, Clone, Serialize)]
pub struct FrameworkRow {
    /// Transport name.
    pub transport: &'static str,
    /// Small (64 B) unary calls per second: gRPC, native.
    pub small_calls_per_s: (f64, f64),
    /// 1 MiB unary echo, MB/s of payload: gRPC, native.
    pub large_mb_per_s: (f64, f64),
    /// gRPC / native, small and large.
    pub ratio: (f64, f64),
}

/// The whole scenario run.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// Tool version.
    pub version: &'static str,
    /// Scenarios run.
    pub scenarios: Vec<ScenarioName>,
    /// Placement of client and server.
    pub placement: Placement,
    /// The rows, in run order.
    pub rows: Vec<Row>,
    /// The framework scenario's rows.
    pub framework: Vec<FrameworkRow>,
    /// Transports not measured, and why.
    pub unavailable: Vec<Unavailable>,
    /// Wall time of the run, seconds.
    pub wall_seconds: f64,
}

/// Runs `bench scenario`.
pub fn run(args: &ScenarioArgs) -> Result<(), String> {
    let started = Instant::now();
    let place = placement(args.pin, "local");
    let scenarios = args.name.expand();
    let mut wanted = args.transports.clone();
    wanted.dedup();
    if let Some(c) = place.client_core {
        crate::sys::pin_current_thread(c)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let cells: u64 = scenarios.iter().map(|&s| cells(s, args)).sum::<u64>() * wanted.len() as u64;
    let progress = if args.no_progress || args.json {
        ProgressBar::hidden()
    } else {
        let pb = ProgressBar::with_draw_target(Some(cells), ProgressDrawTarget::stderr());
        pb.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
                .expect("valid template"),
        );
        pb
    };
    let mut rows = Vec::new();
    let mut framework = Vec::new();
    let mut unavailable = Vec::new();
    let fw = scenarios.contains(&ScenarioName::Framework);
    for t in wanted {
        match t {
            TransportName::Uds => {
                // Every socket of the uds runs in one private directory, removed (with them)
                // when they end, error or not.
                let (dir, path) = crate::local_socket()?;
                let uds = UdsTransport::default();
                let addr = spawn_server(uds.clone(), UdsAddr(path), place.server_core)?;
                rows.extend(rt.block_on(run_on(&uds, &addr, "uds", &scenarios, args, &progress))?);
                if fw {
                    let n = std::sync::atomic::AtomicU32::new(0);
                    let addr = || {
                        let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        UdsAddr(dir.path().join(format!("fw-{i}.sock")))
                    };
                    framework
                        .push(rt.block_on(compare_frameworks("uds", uds, addr, args, &progress))?);
                }
                drop(dir);
            }
            TransportName::Tcp => {
                let tcp = TcpTransport::default();
                let any: SocketAddr = "127.0.0.1:0".parse().expect("valid");
                let addr = spawn_server(tcp.clone(), any, place.server_core)?;
                rows.extend(rt.block_on(run_on(&tcp, &addr, "tcp", &scenarios, args, &progress))?);
                if fw {
                    framework.push(rt.block_on(compare_frameworks(
                        "tcp",
                        tcp,
                        || any,
                        args,
                        &progress,
                    ))?);
                }
            }
            TransportName::Verbs => match crate::verbs_here() {
                Ok((verbs, any)) => {
                    let addr = spawn_server(verbs.clone(), any, place.server_core)?;
                    rows.extend(
                        rt.block_on(run_on(&verbs, &addr, "verbs", &scenarios, args, &progress))?,
                    );
                    if fw {
                        framework.push(rt.block_on(compare_frameworks(
                            "verbs",
                            verbs,
                            || any,
                            args,
                            &progress,
                        ))?);
                    }
                }
                Err(reason) => unavailable.push(Unavailable {
                    transport: "verbs".into(),
                    reason,
                }),
            },
        }
    }
    progress.finish_and_clear();
    let report = ScenarioReport {
        version: env!("CARGO_PKG_VERSION"),
        scenarios,
        placement: place,
        rows,
        framework,
        unavailable,
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    if let Some(path) = &args.plot {
        write_svg(&report, path)?;
    }
    if args.json {
        let s = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        println!("{s}");
    } else {
        print!("{}", render(&report));
        if let Some(path) = &args.plot {
            println!("plot written to {}", path.display());
        }
    }
    Ok(())
}

/// Measurements a scenario makes on one transport (for the progress bar).
fn cells(s: ScenarioName, args: &ScenarioArgs) -> u64 {
    match s {
        ScenarioName::Typed => (3 * Mode::ALL.len() * args.sizes.len()) as u64,
        ScenarioName::Structured => Mode::ALL.len() as u64,
        ScenarioName::Clients | ScenarioName::SlowClients => args.clients.len() as u64,
        ScenarioName::Orb => 4,
        ScenarioName::Framework => 1,
        ScenarioName::All => 0,
    }
}

/// Starts the scenario server for `transport` on its own (pinned) thread.
fn spawn_server<T: Transport + Clone>(
    transport: T,
    addr: T::Addr,
    core: Option<usize>,
) -> Result<T::Addr, String> {
    crate::spawn_server_with(transport, addr, core, |listener| async move {
        let server = RpcServer::new(ScenarioHandler::default(), ServerConfig::default());
        let _ = server.serve(listener).await;
    })
}

struct Ctx<'a, T: Transport> {
    transport: &'a T,
    addr: &'a T::Addr,
    name: &'static str,
    progress: &'a ProgressBar,
    rows: Vec<Row>,
}

impl<T: Transport> Ctx<'_, T> {
    async fn measure<W: Workload>(
        &mut self,
        scenario: ScenarioName,
        what: String,
        mode: Option<Mode>,
        payload_bytes: usize,
        load: LoadConfig,
        workload: W,
    ) -> Result<(), String> {
        self.progress
            .set_message(format!("{} {} {what}", self.name, scenario.label()));
        let stats = run_load(self.transport, self.addr, &load, Arc::new(workload))
            .await
            .map_err(|e| format!("{} {} {what}: {e}", self.name, scenario.label()))?;
        self.progress.inc(1);
        self.rows.push(Row {
            scenario: scenario.label(),
            transport: self.name,
            what,
            mode,
            payload_bytes,
            load,
            stats,
        });
        Ok(())
    }

    async fn typed<E: bench::scenarios::typed::Element>(
        &mut self,
        scenario: ScenarioName,
        kind: TypedKind,
        mode: Mode,
        n: usize,
        load: LoadConfig,
    ) -> Result<(), String> {
        let w = Typed::<E>::new(kind, mode, n);
        let len = w.encoded_len();
        self.measure(scenario, kind.name().into(), Some(mode), len, load, w)
            .await
    }
}

fn shape(clients: usize, connections: usize, in_flight: usize, seconds: f64) -> LoadConfig {
    LoadConfig {
        clients,
        connections,
        max_in_flight_per_connection: in_flight,
        duration: Duration::from_secs_f64(seconds),
    }
}

async fn run_on<T: Transport>(
    transport: &T,
    addr: &T::Addr,
    name: &'static str,
    scenarios: &[ScenarioName],
    args: &ScenarioArgs,
    progress: &ProgressBar,
) -> Result<Vec<Row>, String> {
    let mut cx = Ctx {
        transport,
        addr,
        name,
        progress,
        rows: Vec::new(),
    };
    for &s in scenarios {
        let secs = args.seconds.unwrap_or(s.default_seconds());
        // Sequential calls, as in the classic comparisons: one caller, one call at a time.
        let one = shape(1, 1, 1, secs);
        match s {
            ScenarioName::Typed => {
                for &size in &args.sizes {
                    for mode in Mode::ALL {
                        let k = TypedKind::Strings;
                        cx.typed::<String>(s, k, mode, elements_for::<String>(size), one.clone())
                            .await?;
                        let k = TypedKind::StringDoubles;
                        let n = elements_for::<StringDouble>(size);
                        cx.typed::<StringDouble>(s, k, mode, n, one.clone()).await?;
                        let k = TypedKind::Fixed;
                        let n = elements_for::<Fixed>(size);
                        cx.typed::<Fixed>(s, k, mode, n, one.clone()).await?;
                    }
                }
            }
            ScenarioName::Structured => {
                for mode in Mode::ALL {
                    cx.typed::<Structured>(s, TypedKind::Structured, mode, 1, one.clone())
                        .await?;
                }
            }
            ScenarioName::Clients => {
                for &c in &args.clients {
                    let c = c as usize;
                    cx.measure(s, "ping".into(), None, 0, shape(c, c, 1, secs), Ping)
                        .await?;
                }
            }
            ScenarioName::SlowClients => {
                let slow = Slow(Duration::from_millis(args.handler_ms));
                for &c in &args.clients {
                    let c = c as usize;
                    let what = format!("sleep {} ms", args.handler_ms);
                    cx.measure(s, what, None, 0, shape(c, c, 1, secs), slow)
                        .await?;
                }
            }
            ScenarioName::Orb => {
                let threads = args.threads as usize;
                let classic = shape(
                    threads,
                    args.connections as usize,
                    args.in_flight as usize,
                    secs,
                );
                let pipelined = shape(threads, 1, 4096, secs);
                let payload = Bytes::from(vec![0x5a; args.payload]);
                let classic_name = format!(
                    "{} conn x {} call{}",
                    args.connections,
                    args.in_flight,
                    if args.in_flight == 1 { "" } else { "s" }
                );
                for (what, load) in [
                    (classic_name, classic),
                    ("pipelined: 1 conn".to_string(), pipelined),
                ] {
                    cx.measure(s, format!("{what}, ping"), None, 0, load.clone(), Ping)
                        .await?;
                    let w = SendBytes(payload.clone());
                    let what = format!("{what}, send {}", size_label(args.payload));
                    cx.measure(s, what, Some(Mode::Send), args.payload, load, w)
                        .await?;
                }
            }
            ScenarioName::Framework => {} // measured by compare_frameworks
            ScenarioName::All => unreachable!("expanded"),
        }
    }
    Ok(cx.rows)
}

/// gRPC (tonic over the byte-stream adapter) vs native RPC on one transport, with
/// `grpc_demo::compare`: one connection, one call in flight.
async fn compare_frameworks<T: Transport>(
    name: &'static str,
    transport: T,
    addr: impl Fn() -> T::Addr,
    args: &ScenarioArgs,
    progress: &ProgressBar,
) -> Result<FrameworkRow, String> {
    progress.set_message(format!("{name} framework"));
    let cfg = grpc_demo::compare::CompareConfig {
        small_calls: args.small_calls as usize,
        large_calls: args.large_calls as usize,
        ..Default::default()
    };
    let c = grpc_demo::compare::compare(name, transport, addr, &cfg)
        .await
        .map_err(|e| format!("{name} framework: {e}"))?;
    progress.inc(1);
    Ok(FrameworkRow {
        transport: name,
        small_calls_per_s: (c.grpc.small_calls_per_s, c.native.small_calls_per_s),
        large_mb_per_s: (c.grpc.large_mb_per_s, c.native.large_mb_per_s),
        ratio: (c.small_ratio(), c.large_ratio()),
    })
}

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
                    ],
                    rows.iter()
                        .map(|x| {
                            vec![
                                x.transport.to_string(),
                                x.load.clients.to_string(),
                                x.stats.completed.to_string(),
                                format!("{:.0}", x.stats.calls_per_s),
                                format!("{:.3}", x.stats.mean_us / 1e3),
                                format!("{:.3}", x.stats.p99_us / 1e3),
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
            ScenarioName::Framework | ScenarioName::All => {}
        }
    }
    let _ = writeln!(out, "\nwall time {:.1} s", r.wall_seconds);
    out
}

fn mode_name(m: Option<Mode>) -> String {
    match m {
        Some(Mode::Send) => "send",
        Some(Mode::Oneway) => "oneway",
        Some(Mode::Recv) => "recv",
        Some(Mode::Echo) => "echo",
        None => "-",
    }
    .into()
}

/// Typed throughput: one line per (transport, payload kind, size), modes as columns.
fn typed_table(out: &mut String, rows: &[&Row]) {
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
        lines,
    );
}

/// Rows of one size request share a bucket even if their encodings differ by a few bytes.
fn bucket(bytes: usize) -> u32 {
    (bytes.max(1) as f64).log2().round() as u32
}

fn table(out: &mut String, head: &[&str], rows: Vec<Vec<String>>) {
    let mut w: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| -> String {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = w[i] - c.chars().count();
                if i < 2 {
                    format!("{c}{}", " ".repeat(pad))
                } else {
                    format!("{}{c}", " ".repeat(pad))
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
    };
    let _ = writeln!(
        out,
        "{}",
        line(head.iter().map(|s| s.to_string()).collect())
    );
    for r in rows {
        let _ = writeln!(out, "{}", line(r));
    }
}

/// One SVG: for the client scenarios, calls completed vs clients per transport; for typed,
/// echo Mbit/s vs encoded size per transport and payload; for structured and orb, calls/s bars
/// drawn as points per row.
pub fn write_svg(r: &ScenarioReport, path: &Path) -> Result<(), String> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut push = |name: String, x: f64, y: f64| match series.iter_mut().find(|s| s.0 == name) {
        Some(s) => s.1.push((x, y)),
        None => series.push((name, vec![(x, y)])),
    };
    let (x_label, y_label, title);
    let first = r.scenarios.first().copied().ok_or("nothing to plot")?;
    match first {
        ScenarioName::Clients | ScenarioName::SlowClients => {
            for x in r.rows.iter().filter(|x| x.scenario == first.label()) {
                push(
                    format!("{} {}", x.transport, first.label()),
                    x.load.clients as f64,
                    x.stats.completed as f64,
                );
            }
            (x_label, y_label, title) = ("concurrent clients", "calls completed", "clients");
        }
        ScenarioName::Typed => {
            for x in r
                .rows
                .iter()
                .filter(|x| x.scenario == "typed" && x.mode == Some(Mode::Echo))
            {
                push(
                    format!("{} {}", x.transport, x.what),
                    x.payload_bytes as f64,
                    x.stats.mbit_s,
                );
            }
            (x_label, y_label, title) = ("encoded bytes", "echo Mbit/s", "typed echo");
        }
        ScenarioName::Framework => {
            for (i, f) in r.framework.iter().enumerate() {
                push("gRPC 64 B calls/s".into(), i as f64, f.small_calls_per_s.0);
                push(
                    "native 64 B calls/s".into(),
                    i as f64,
                    f.small_calls_per_s.1,
                );
            }
            (x_label, y_label, title) = ("transport (in run order)", "calls/s", "framework");
        }
        _ => {
            for (i, x) in r
                .rows
                .iter()
                .filter(|x| x.scenario == first.label())
                .enumerate()
            {
                push(x.transport.to_string(), i as f64, x.stats.calls_per_s);
            }
            (x_label, y_label, title) = ("row", "calls/s", first.label());
        }
    }
    let pts: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
    if pts.is_empty() {
        return Err("nothing to plot: no rows were measured".into());
    }
    let xmax = pts.iter().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let ymax = pts.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("bench scenario {title}"), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, pts)) in series.into_iter().enumerate() {
        let color = crate::plot::COLORS[i % crate::plot::COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
