//! `bench scenario NAME`: the classic middleware scenarios on every transport.
//!
//! ```text
//! bench scenario typed         sequences of strings / {string,f64} / {i64,i64,f64}: send, oneway, recv, echo in Mbit/s
//! bench scenario structured    a ~2.2 KB structured request (records + string array): calls/s
//! bench scenario clients       10, 20, 30, 50, 100 concurrent clients, trivial handler
//! bench scenario slow-clients  the same with a handler that takes 500 ms (a timer, no CPU)
//! bench scenario orb           "one call per connection, five connections" vs the pipelined default
//! bench scenario framework     gRPC (tonic over the byte-stream adapter) and tarpc on messages vs native RPC
//! bench scenario c-abi         the C client (transport-ffi's C ABI) vs the same client in Rust
//! bench scenario all           every scenario above
//! ```
//!
//! Each prints one table per scenario, or JSON with `--json`, and `--plot FILE.svg` draws it.

use crate::args::{Pin, TransportName};
use crate::local::placement;
use crate::plot::{Figure, Line, Marker, Panel, Series, Style, XAxis, YFormat};
use crate::report::{size_label, Placement, Table, Unavailable};
use bench::c_abi::{self, CAbiRow};
use bench::scenarios::load::{
    run_load, LoadConfig, Mode, Ping, ScenarioHandler, SendBytes, Slow, Stats, Typed, TypedKind,
    Workload,
};
use bench::scenarios::typed::{elements_for, Fixed, StringDouble, Structured};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_core::Transport;
use transport_rpc::{RpcServer, ServerConfig};
use transport_shm::conn::ShmConfig;
use transport_shm::ShmTransport;
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};
use transport_verbs::{VerbsConfig, VerbsTransport};

mod plot;
mod render;
pub use plot::write_svg;
pub use render::render;

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
    /// What a framework costs: gRPC (tonic over `transport-stream`) and tarpc (on
    /// `transport-tarpc`) vs native RPC.
    Framework,
    /// What the C ABI costs: transport-ffi's C ping client vs its Rust twin, in rounds.
    CAbi,
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
                ScenarioName::CAbi,
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
            ScenarioName::CAbi => "c-abi",
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
            ScenarioName::Framework | ScenarioName::CAbi | ScenarioName::All => 1.0,
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
    #[arg(long, value_delimiter = ',', value_parser = crate::args::parse_size, default_value = "1K,64K,500000")]
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
    #[arg(long, default_value = "64K", value_parser = crate::args::parse_size)]
    pub payload: usize,
    /// Framework and c-abi scenarios: number of small unary calls (64 B; c-abi: 0 B) per
    /// framework or client (c-abi: per round).
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub small_calls: u64,
    /// Framework and c-abi scenarios: number of 1 MiB unary echoes per framework or client
    /// (c-abi: per round).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    pub large_calls: u64,
    /// C-abi scenario: rounds, each running both clients (in alternating order).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub rounds: u64,
    /// CPU placement of client and server.
    #[arg(long, value_enum, default_value_t = Pin::Same)]
    pub pin: Pin,
    #[command(flatten)]
    pub verbs: crate::tuning::VerbsArgs,
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
    /// RNR NAKs the machine's RDMA devices counted during the row (verbs rows, where the
    /// device has the counter; see `sys::rnr_naks`): a shared receive queue that ran dry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rnr_naks: Option<u64>,
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
    /// tarpc on the transport's messages (`transport-tarpc`): small calls/s, large MB/s.
    pub tarpc: (f64, f64),
    /// tarpc on messages / native, small and large.
    pub tarpc_ratio: (f64, f64),
    /// tarpc on its own `serde_transport` over loopback TCP (bincode), small calls/s and large
    /// MB/s: measured on the tcp row only, the framework with the I/O it ships with.
    pub tarpc_serde_tcp: Option<(f64, f64)>,
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
    /// The c-abi scenario's rows.
    pub c_abi: Vec<CAbiRow>,
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
    let mut c_abi = Vec::new();
    let mut unavailable = Vec::new();
    let fw = scenarios.contains(&ScenarioName::Framework);
    let c = scenarios.contains(&ScenarioName::CAbi);
    for t in wanted {
        match t {
            TransportName::Uds => {
                // Every socket of the uds runs in one private directory, removed (with them)
                // when they end, error or not.
                let (dir, path) = crate::local::local_socket()?;
                let uds = UdsTransport::default();
                let addr = spawn_server(uds.clone(), UdsAddr(path), place.server_core)?;
                rows.extend(rt.block_on(run_on(&uds, &addr, "uds", &scenarios, args, &progress))?);
                if fw {
                    framework.push(rt.block_on(compare_frameworks(
                        "uds",
                        uds.clone(),
                        socket_paths(dir.path()),
                        args,
                        &progress,
                    ))?);
                }
                if c {
                    let path = dir.path().join("c-abi.sock");
                    let at = spawn_echo_server(uds.clone(), UdsAddr(path), place.server_core)?;
                    let uri = format!("unix:{}", at.0.display());
                    c_abi.push(compare_c_abi("uds", &uds, &at, &uri, args, &progress)?);
                }
                drop(dir);
            }
            TransportName::Shm => {
                let (dir, path) = crate::local::local_socket()?;
                let shm = ShmTransport::new(ShmConfig::with_max_message_size(
                    crate::proto::MAX_PAYLOAD + transport_core::MAX_HEADER_LEN,
                ));
                let addr = spawn_server(shm.clone(), UdsAddr(path), place.server_core)?;
                rows.extend(rt.block_on(run_on(&shm, &addr, "shm", &scenarios, args, &progress))?);
                if fw {
                    framework.push(rt.block_on(compare_frameworks(
                        "shm",
                        shm.clone(),
                        socket_paths(dir.path()),
                        args,
                        &progress,
                    ))?);
                }
                if c {
                    unavailable.push(Unavailable {
                        transport: "shm".into(),
                        reason: "c-abi: the C ABI does not open shared-memory URIs yet".into(),
                    });
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
                        tcp.clone(),
                        || any,
                        args,
                        &progress,
                    ))?);
                }
                if c {
                    let at = spawn_echo_server(tcp.clone(), any, place.server_core)?;
                    let uri = format!("tcp://{at}");
                    c_abi.push(compare_c_abi("tcp", &tcp, &at, &uri, args, &progress)?);
                }
            }
            TransportName::Verbs => match crate::local::verbs_here(&args.verbs) {
                Ok((verbs, any)) => {
                    let addr = spawn_server(verbs.clone(), any, place.server_core)?;
                    rows.extend(
                        rt.block_on(run_on(&verbs, &addr, "verbs", &scenarios, args, &progress))?,
                    );
                    if fw {
                        framework.push(rt.block_on(compare_frameworks(
                            "verbs",
                            verbs.clone(),
                            || any,
                            args,
                            &progress,
                        ))?);
                    }
                    if c {
                        // Both clients with the default settings, as a `verbs://` URI opens.
                        let at = spawn_echo_server(verbs, any, place.server_core)?;
                        let client = VerbsTransport::new(VerbsConfig::default())
                            .map_err(|e| format!("verbs: {e}"))?;
                        let uri = format!("verbs://{at}");
                        c_abi.push(compare_c_abi("verbs", &client, &at, &uri, args, &progress)?);
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
        c_abi,
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
        ScenarioName::Framework | ScenarioName::CAbi => 1,
        ScenarioName::All => 0,
    }
}

/// Starts the scenario server for `transport` on its own (pinned) thread.
fn spawn_server<T: Transport + Clone>(
    transport: T,
    addr: T::Addr,
    core: Option<usize>,
) -> Result<T::Addr, String> {
    // No spinning: the scenarios measure many connections per thread.
    crate::local::spawn_server_with(
        transport,
        addr,
        core,
        Duration::ZERO,
        |listener| async move {
            // The bench makes its own load: every client it starts is served (the default limit
            // follows RLIMIT_NOFILE, which verbs connections do not use).
            let mut config = ServerConfig::default();
            config.max_connections = usize::MAX;
            let server = RpcServer::new(ScenarioHandler::default(), config);
            let _ = server.serve(listener).await;
        },
    )
}

/// A server answering the bench's echo method, as `tp_rpc_serve` runs one (with the
/// spin-before-park hook).
fn spawn_echo_server<T: Transport + Clone>(
    transport: T,
    addr: T::Addr,
    core: Option<usize>,
) -> Result<T::Addr, String> {
    crate::local::spawn_server_with(
        transport,
        addr,
        core,
        transport_core::spin::DEFAULT_BUDGET,
        |listener| async move {
            let handler = crate::proto::rpc_handler(crate::proto::payload_pool());
            let _ = RpcServer::new(handler, ServerConfig::default())
                .serve(listener)
                .await;
        },
    )
}

/// The C client against its Rust twin on one transport (`bench::c_abi`): 0 B calls and
/// 1 MiB echoes, `--rounds` rounds. Runs on the calling thread, outside any runtime (both
/// clients drive runtimes of their own).
fn compare_c_abi<T: Transport>(
    name: &'static str,
    transport: &T,
    addr: &T::Addr,
    uri: &str,
    args: &ScenarioArgs,
    progress: &ProgressBar,
) -> Result<CAbiRow, String>
where
    <T::Connection as transport_core::Connection>::Sender: transport_core::MessageSender + Sync,
{
    progress.set_message(format!("{name} c-abi"));
    let small = c_abi::Run {
        method: crate::proto::method::ECHO,
        size: 0,
        warmup: 1000,
        calls: args.small_calls,
    };
    let large = c_abi::Run {
        size: 1 << 20,
        warmup: 10,
        calls: args.large_calls,
        ..small
    };
    let row = c_abi::compare(
        name,
        args.rounds as usize,
        small,
        large,
        |run| c_abi::c_client(uri, run),
        |run| c_abi::rust_client(transport, addr, run),
    )
    .map_err(|e| format!("{name} c-abi: {e}"))?;
    progress.inc(1);
    Ok(row)
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
        let rnr = || (self.name == "verbs").then(crate::sys::rnr_naks).flatten();
        let rnr0 = rnr();
        let stats = run_load(self.transport, self.addr, &load, Arc::new(workload))
            .await
            .map_err(|e| format!("{} {} {what}: {e}", self.name, scenario.label()))?;
        let rnr_naks = rnr0.zip(rnr()).map(|(a, b)| b.saturating_sub(a));
        self.progress.inc(1);
        self.rows.push(Row {
            scenario: scenario.label(),
            transport: self.name,
            what,
            mode,
            payload_bytes,
            load,
            stats,
            rnr_naks,
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
            ScenarioName::CAbi => {}      // measured by compare_c_abi
            ScenarioName::All => unreachable!("expanded"),
        }
    }
    Ok(cx.rows)
}

/// gRPC (tonic over the byte-stream adapter) and tarpc on messages vs native RPC on one
/// transport (and, on tcp, tarpc's own serde_transport), with
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
    let tarpc_serde_tcp = if name == "tcp" {
        let s = grpc_demo::compare::measure_tarpc_serde_tcp(&cfg)
            .await
            .map_err(|e| format!("tarpc serde_transport over tcp: {e}"))?;
        Some((s.small_calls_per_s, s.large_mb_per_s))
    } else {
        None
    };
    progress.inc(1);
    Ok(FrameworkRow {
        transport: name,
        small_calls_per_s: (c.grpc.small_calls_per_s, c.native.small_calls_per_s),
        large_mb_per_s: (c.grpc.large_mb_per_s, c.native.large_mb_per_s),
        ratio: (c.small_ratio(), c.large_ratio()),
        tarpc: (c.tarpc.small_calls_per_s, c.tarpc.large_mb_per_s),
        tarpc_ratio: (c.tarpc_small_ratio(), c.tarpc_large_ratio()),
        tarpc_serde_tcp,
    })
}

/// A fresh socket path in `dir` at each call (`fw-0.sock`, `fw-1.sock`, ...): the framework
/// comparison's listeners on uds and shm.
fn socket_paths(dir: &Path) -> impl Fn() -> UdsAddr + '_ {
    let n = std::sync::atomic::AtomicU32::new(0);
    move || {
        let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        UdsAddr(dir.join(format!("fw-{i}.sock")))
    }
}

#[cfg(test)]
mod tests;
