//! # bench
//!
//! The iperf-like comparison of raw transports and RPC over them, with a diagnosis of the gap.
//!
//! ```text
//! bench                         local mode: client and server in this process, every transport
//! bench --full --plot out.svg   the whole sweep (sizes 1 KB..1 MB x 1..32 client threads)
//! bench --json                  the report as JSON on stdout
//! bench server                  serve raw and RPC bench connections (TCP 127.0.0.1:5201)
//! bench server --listen ADDR    the same for a client on another host (see below)
//! bench client HOST[:PORT]      run the comparison against `bench server` on HOST (tcp or verbs)
//! bench client unix:PATH        the same against `bench server --uds PATH` on this host
//! bench scenario NAME           the middleware scenarios (typed, structured, clients, slow-clients, orb, all)
//! bench merge A.json B.json     one report from this machine's run and an emulated one's
//! bench doctor                  check the environment (memlock, RDMA devices, GIDs, MTU, socket limits)
//! bench count HOST --path P     one path (os/link, raw, rpc) and op, N messages, alone in its process:
//!                               what `cargo xtask profile` counts instructions of under callgrind
//! ```
//!
//! Raw figures use the backend's `Connection` directly (message ping-pong and message
//! streams); RPC figures use `RpcClient`/`RpcServer` over the same backend, so the ratio of
//! the two is the cost of the RPC layer. Every figure is repeated (`--repeat`) and printed as
//! median (min-max), with the CPU placement of client and server.
//!
//! ## The OS baseline (`os`)
//!
//! In local mode uds and tcp are also measured without the project at all: blocking
//! `std` sockets, one client and one server thread, no async runtime (the `os` module). A
//! 1-byte ping-pong stands beside the raw and RPC pings (`os µs/rt`, `os p50/p99 µs`) and a
//! one-way stream of writes of each size into a reading sink beside the send and oneway cells
//! of one client thread (`os Mbit/s`). That is what this machine gives a program that does
//! nothing but move the bytes, the limit the project is measured against: `raw/os` and
//! `rpc/os` (p50 ratios for latency, median paired throughput ratios for the streams) say how
//! much of it the raw connection and RPC get. The OS threads are placed like the bench's
//! (client CPU and server CPU of `--pin`) and measured in the same run, interleaved with raw
//! and RPC: the pings in chunks os, raw, rpc, rpc, raw, os, and each stream back to back with
//! its cell's raw and RPC runs. JSON: `ping.os`, `ping.raw_os_latency_ratio`,
//! `ping.rpc_os_latency_ratio`, `cells[].os`, `cells[].raw_os_utilization`,
//! `cells[].rpc_os_utilization` (null where not measured), and per transport
//! `os_baseline_kind` (`sockets`, `link` or `not_measured`) with `os_baseline` (what was
//! measured, or why not). `bench client` has no OS baseline for uds and tcp (it would
//! need a server of its own on the remote host). For verbs the os columns hold the link
//! (module `link`: a busy-polled SEND ping-pong and an RDMA READ stream through
//! `transport_verbs::link`), locally and against `bench server --verbs` (one port up).
//!
//! ## RPC alone (`--only rpc`)
//!
//! `bench --only rpc` and `bench client HOST --only rpc` measure the RPC path alone: no raw
//! connection and no os (or link) baseline is measured, the tables leave those columns out
//! and say so, there is no diagnosis (it sets RPC against raw), and the JSON has `null` where
//! raw and os figures and their ratios would be (`settings.layers` is `["rpc"]`).
//!
//! ## `bench server`
//!
//! The server's port is unauthenticated: anyone who can reach it can make the server send
//! and receive data and spend CPU. It therefore listens on loopback (`127.0.0.1:5201`) unless
//! `--listen` names another address, and prints a warning to stderr when that address is not
//! a loopback one: serve a remote client only on a network you trust. What one request may ask
//! for is bounded (see the `proto` module's limits: at most 2^20 messages, 16 MiB each and
//! 64 GiB in all per stream request). `--uds PATH` also listens on a Unix socket.
//! SIGINT or SIGTERM stops the server: its listeners are closed, the `--uds` socket file is
//! removed, and it exits with status 0.
//!
//! Local mode and `bench scenario` put their Unix sockets in a fresh private directory
//! (mode 0700, under the temporary directory), removed at the end of the run.

mod args;
mod blocking;
mod cli;
mod count;
mod doctor;
mod link;
mod local;
mod machine;
mod measure;
mod os;
mod plot;
mod proto;
mod report;
mod results;
mod scenario_cmd;
mod soak;
mod suite;
mod sys;
mod tuning;

use args::{Remote, RemoteTransport, TransportName};
use clap::Parser;
use cli::{Cli, Command, ResultsCommand, RunArgs, ServerArgs};
use indicatif::ProgressBar;
use local::{local_socket, placement, spawn_server, verbs_here};
use measure::{Peer, RpcIo};
use report::{Placement, Report, Unavailable};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use suite::{OsBaseline, Settings};
use transport_core::{Listener, Transport};
use transport_shm::conn::ShmConfig;
use transport_shm::ShmTransport;
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};
use transport_verbs::VerbsTransport;

/// Why `bench client` has no `os` figures.
const REMOTE_NO_OS: &str = "remote mode: the OS baseline needs a server of its own on the \
                            remote host, which `bench server` does not run";

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => local(&cli.run),
        Some(Command::Local(run)) => local(&run),
        Some(Command::Server(a)) => server(&a),
        Some(Command::Client {
            host,
            transport,
            run,
        }) => client(&host, transport, &run),
        Some(Command::Scenario(a)) => scenario_cmd::run(&a),
        Some(Command::Merge {
            base,
            emulated,
            machine,
            json,
        }) => merge(&base, &emulated, &machine, json),
        Some(Command::Results(ResultsCommand::Write(a))) => results::write_from_files(&a),
        Some(Command::Results(ResultsCommand::Check { dir, readme })) => {
            results::check(&dir, &readme).map(|()| {
                println!(
                    "{} and the block of {} match their JSON",
                    dir.display(),
                    readme.display()
                )
            })
        }
        Some(Command::Doctor { json }) => doctor::run(json),
        Some(Command::Count(a)) => count::run(&a),
        Some(Command::Soak(a)) => soak::run(&a),
        Some(Command::SoakClient(a)) => soak::client_process(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Samples a verbs transport's memory use during a run and keeps the sample with the most
/// connections (both ends are in this process in local mode).
struct VerbsMemorySampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<transport_verbs::MemoryUse>,
}

impl VerbsMemorySampler {
    fn start(verbs: VerbsTransport) -> VerbsMemorySampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = verbs.memory_use();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let m = verbs.memory_use();
                if m.connections > peak.connections
                    || (m.connections == peak.connections
                        && m.registered_bytes > peak.registered_bytes)
                {
                    peak = m;
                }
                std::thread::park_timeout(std::time::Duration::from_millis(50));
            }
            peak
        });
        VerbsMemorySampler { stop, thread }
    }

    fn stop(self) -> transport_verbs::MemoryUse {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.thread().unpark();
        self.thread.join().unwrap_or_default()
    }
}

/// The verbs lines of the report: how completions are waited for, and the memory per
/// connection at the run's busiest point.
fn verbs_notes(verbs: &VerbsTransport, peak: transport_verbs::MemoryUse) -> Vec<String> {
    let c = verbs.config();
    // The receive buffers as the device's paths made them (a device without a shared queue
    // for these settings gives each connection its own), else as configured.
    let effective = verbs
        .device_caps()
        .first()
        .map_or_else(|| c.clone(), |caps| caps.paths(c).apply(c));
    let polling = format!(
        "polling: {}; --verbs-poll-us; receive: {}; --verbs-srq-depth",
        sys::verbs_polling(c),
        sys::verbs_receive(&effective)
    );
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let memory = if peak.connections == 0 {
        "memory: no connection was sampled open".to_string()
    } else {
        format!(
            "memory at {} open connections (both ends): {:.3} MiB registered per connection (send slots, plus receive buffers without a shared receive queue), {:.1} MiB registered in all (one shared pool per device, {:.1} MiB of it in the shared receive queue)",
            peak.connections,
            mib(peak.per_connection_bytes / peak.connections),
            mib(peak.registered_bytes),
            mib(peak.shared_receive_bytes)
        )
    };
    let mut notes = vec![polling, memory];
    for caps in verbs.device_caps() {
        notes.push(format!("device {caps}"));
        notes.push(format!("paths on {}: {}", caps.device, caps.paths(c)));
    }
    notes
}

/// Local mode on a socket transport: starts the in-process bench server of `transport` at
/// `addr` and, unless `--only rpc`, the OS baseline server at `os`; runs the suite against
/// them. Both servers stop when the run ends.
/// With `--rpc-io blocking` the RPC rows go to a blocking RPC server at `blocking` instead.
fn run_local<T: Transport + Clone>(
    transport: T,
    addr: T::Addr,
    os: os::Target,
    blocking: os::Target,
    run: &LocalRun<'_>,
) -> Result<suite::TransportReport, String> {
    let LocalRun {
        place,
        spin,
        settings,
        progress,
    } = *run;
    let (addr, counters) = spawn_server(transport.clone(), addr, place.server_core, spin)?;
    let blocking = match settings.rpc_io {
        RpcIo::Async => None,
        RpcIo::Blocking => Some(blocking::Server::start(blocking, place.server_core, spin)?),
    };
    let peer = Peer {
        transport: &transport,
        addr: &addr,
        counters: Some(&counters),
        blocking: blocking.as_ref().map(blocking::Server::target),
        spin,
    };
    if !settings.raw() {
        return suite::run(&peer, rpc_only(), settings, progress);
    }
    let os = os::Server::start(os, place.server_core)?;
    suite::run(&peer, OsBaseline::Measure(os.target()), settings, progress)
}

/// What every transport of one local run shares: where client and server run, the runtimes'
/// spin, the settings and the progress bar.
#[derive(Clone, Copy)]
struct LocalRun<'a> {
    place: &'a Placement,
    spin: Duration,
    settings: &'a Settings,
    progress: &'a ProgressBar,
}

/// The os baseline of an `--only rpc` run: not measured, and its servers not started.
fn rpc_only() -> OsBaseline<'static> {
    OsBaseline::Skip(suite::ONLY_RPC.into())
}

fn local(args: &RunArgs) -> Result<(), String> {
    let started = Instant::now();
    let place = placement(args.pin, "local");
    let settings = args.settings(place.client_core);
    let mut wanted = args.transports.clone();
    wanted.dedup();
    // uds and tcp are measured with their OS baseline; verbs (if present) without.
    let sockets = wanted
        .iter()
        .filter(|&&t| t != TransportName::Verbs)
        .count() as u64;
    let progress = args.progress(settings.jobs(true) * sockets);
    let mut transports = Vec::new();
    let mut unavailable = Vec::new();
    let run = LocalRun {
        place: &place,
        spin: args.spin(),
        settings: &settings,
        progress: &progress,
    };
    for t in wanted {
        match t {
            TransportName::Uds => {
                // Removed (with the socket) when the run on uds ends, error or not.
                let (dir, path) = local_socket()?;
                let os = os::Target::Uds(dir.path().join("os.sock"));
                let blocking = os::Target::Uds(dir.path().join("rpc-blocking.sock"));
                let r = run_local(UdsTransport::default(), UdsAddr(path), os, blocking, &run);
                drop(dir);
                transports.push(r?);
            }
            TransportName::Shm => {
                // The OS baseline is the Unix socket's: what shared memory is there to beat.
                let (dir, path) = local_socket()?;
                let os = os::Target::Uds(dir.path().join("os.sock"));
                let blocking = os::Target::Uds(dir.path().join("rpc-blocking.sock"));
                let shm = ShmTransport::new(ShmConfig::with_max_message_size(
                    proto::MAX_PAYLOAD + transport_core::MAX_HEADER_LEN,
                ));
                let r = run_local(shm, UdsAddr(path), os, blocking, &run);
                drop(dir);
                transports.push(r?);
            }
            TransportName::Tcp => {
                let loopback: SocketAddr = "127.0.0.1:0".parse().expect("valid");
                let os = os::Target::Tcp(loopback);
                transports.push(run_local(
                    TcpTransport::default(),
                    loopback,
                    os,
                    os::Target::Tcp(loopback),
                    &run,
                )?);
            }
            TransportName::Verbs => match verbs_here(&args.tuning.verbs) {
                Ok((verbs, addr)) => {
                    let link = if settings.raw() {
                        Some(link::Server::start(&verbs, addr, place.server_core)?)
                    } else {
                        None
                    };
                    let (addr, counters) =
                        spawn_server(verbs.clone(), addr, place.server_core, args.spin())?;
                    let peer = Peer {
                        transport: &verbs,
                        addr: &addr,
                        counters: Some(&counters),
                        blocking: None,
                        spin: args.spin(),
                    };
                    let baseline = match &link {
                        Some(l) => OsBaseline::Link(l.target()),
                        None => rpc_only(),
                    };
                    let peak = VerbsMemorySampler::start(verbs.clone());
                    let mut r = suite::run(&peer, baseline, &settings.for_verbs(), &progress)?;
                    r.notes = verbs_notes(&verbs, peak.stop());
                    transports.push(r);
                }
                Err(reason) => unavailable.push(Unavailable {
                    transport: "verbs".into(),
                    reason,
                }),
            },
        }
    }
    progress.finish_and_clear();
    finish(args, place, settings, transports, unavailable, started)
}

fn finish(
    args: &RunArgs,
    placement: Placement,
    settings: Settings,
    transports: Vec<suite::TransportReport>,
    unavailable: Vec<Unavailable>,
    started: Instant,
) -> Result<(), String> {
    let diagnosis = transports
        .iter()
        .filter_map(|t| report::diagnose(t, settings.raw_twoway))
        .collect();
    let report = Report {
        version: env!("CARGO_PKG_VERSION").to_string(),
        machine: Some(machine::Machine::here()),
        placement,
        settings,
        transports,
        unavailable,
        diagnosis,
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    if let Some(path) = &args.plot {
        plot::write_svg(&report, path)?;
    }
    let json = || serde_json::to_string_pretty(&report).map_err(|e| e.to_string());
    if let Some(path) = &args.json_out {
        std::fs::write(path, json()? + "\n")
            .map_err(|e| format!("--json-out {}: {e}", path.display()))?;
    }
    if args.json {
        println!("{}", json()?);
    } else {
        print!("{}", report.render());
        if let Some(path) = &args.plot {
            println!("plot written to {}", path.display());
        }
    }
    Ok(())
}

/// `bench merge`: reads the reports and prints them as one.
fn merge(base: &Path, emulated: &[PathBuf], machine: &str, json: bool) -> Result<(), String> {
    let read = |path: &Path| -> Result<Report, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a bench JSON report: {e}", path.display()))
    };
    let mut report = read(base)?;
    for path in emulated {
        report.merge_emulated(read(path)?, machine);
    }
    if json {
        let s = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        println!("{s}");
    } else {
        print!("{}", report.render());
    }
    Ok(())
}

/// The warning `bench server` prints when it listens on `addr`, if any: every address but a
/// loopback one exposes the unauthenticated port to other hosts.
fn listen_warning(addr: &SocketAddr) -> Option<String> {
    if addr.ip().to_canonical().is_loopback() {
        return None;
    }
    Some(format!(
        "bench server: warning: {addr} is not a loopback address. The port is \
         unauthenticated: anyone who can reach it can make this server send and receive data \
         and use CPU. Listen on it only on a network you trust."
    ))
}

/// SIGINT and SIGTERM, registered before any listener exists so that a signal arriving while
/// the server starts still shuts it down cleanly instead of killing it with its socket file.
struct Shutdown {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Shutdown {
    fn register() -> Result<Shutdown, String> {
        use tokio::signal::unix::{signal, SignalKind};
        let e = |e: std::io::Error| format!("cannot handle signals: {e}");
        Ok(Shutdown {
            int: signal(SignalKind::interrupt()).map_err(e)?,
            term: signal(SignalKind::terminate()).map_err(e)?,
        })
    }

    /// Waits for the first of the signals; returns its name.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        }
    }
}

/// Serves `listener` if there is one, counting its connections in `counters`; otherwise
/// never returns.
async fn serve_if<L: Listener>(
    listener: Option<L>,
    counters: Arc<proto::ServerCounters>,
) -> Result<(), transport_core::TransportError> {
    match listener {
        Some(l) => proto::serve(l, counters).await,
        None => std::future::pending().await,
    }
}

fn server(a: &ServerArgs) -> Result<(), String> {
    if let Some(c) = a.core {
        sys::pin_current_thread(c)?;
    }
    let rt = sys::runtime(a.tuning.spin()).map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut shutdown = Shutdown::register()?;
        if let Some(w) = listen_warning(&a.listen) {
            eprintln!("{w}");
        }
        let tcp = TcpTransport::default()
            .listen(&a.listen)
            .await
            .map_err(|e| format!("listen on {}: {e}", a.listen))?;
        eprintln!(
            "bench server: tcp {} (raw and rpc); pinned: {}",
            tcp.local_addr().map_err(|e| e.to_string())?,
            a.core.map_or("no".to_string(), |c| format!("CPU {c}"))
        );
        let uds = match &a.uds {
            Some(p) => {
                let l = UdsTransport::default()
                    .listen(&UdsAddr(p.clone()))
                    .await
                    .map_err(|e| format!("listen on {}: {e}", p.display()))?;
                eprintln!("bench server: uds {}", p.display());
                Some(l)
            }
            None => None,
        };
        let verbs = if a.verbs {
            let at = a.verbs_listen.unwrap_or(a.listen);
            let v = VerbsTransport::new(a.tuning.verbs.config()).map_err(|e| e.to_string())?;
            let l = v.listen(&at).await.map_err(|e| {
                let hint = if at.ip().is_loopback() {
                    " (pass --listen with the RDMA device's IP, e.g. --listen 10.0.0.5:5201: \
                     verbs listeners are reachable from other hosts, and so is --listen's TCP port)"
                } else if at == a.listen {
                    " (on an iWARP device RDMA runs over TCP and cannot share the TCP \
                     listener's port: pass --verbs-listen with another port)"
                } else {
                    ""
                };
                format!("verbs listen on {at}: {e}{hint}")
            })?;
            eprintln!("bench server: verbs {at}");
            // The link figures (`os` columns of verbs) one port up.
            let at = link::link_addr(at);
            let link = link::Server::start(&v, at, a.core)?;
            eprintln!(
                "bench server: verbs link figures (busy-polled, one client at a time) {}",
                link.target().addr()
            );
            Some((l, link))
        } else {
            None
        };
        let _os = count::os_servers(&a.os_uds, &a.os_tcp)?;
        let (verbs, _link) = match verbs {
            Some((l, link)) => (Some(l), Some(link)),
            None => (None, None),
        };
        // One server on every listener: its connections are counted together (nobody in
        // this process reads the counts; a client reads its own).
        let counters = Arc::new(proto::ServerCounters::default());
        // The listeners live in these futures: the first signal drops them, which closes
        // them and removes the Unix socket file.
        tokio::select! {
            r = proto::serve(tcp, counters.clone()) => r.map_err(|e| e.to_string()),
            r = serve_if(uds, counters.clone()) => r.map_err(|e| e.to_string()),
            r = serve_if(verbs, counters) => r.map_err(|e| e.to_string()),
            name = shutdown.recv() => {
                eprintln!("bench server: {name}, shutting down");
                Ok(())
            }
        }
    })
}

fn client(host: &str, transport: Option<RemoteTransport>, args: &RunArgs) -> Result<(), String> {
    if args.rpc_io == RpcIo::Blocking {
        return Err("--rpc-io blocking is measured in local mode only (`bench local`)".into());
    }
    let started = Instant::now();
    if args.transports != RunArgs::default_transports() {
        return Err(
            "`bench client` runs one transport: choose it with --transport (or unix:PATH), not --transports"
                .into(),
        );
    }
    let remote_at = Remote::parse(host, transport)?;
    let mut place = placement(args.pin, "remote");
    place.summary = place
        .summary
        .replace("server on the remote host", remote_at.server_where());
    let settings = args.settings(place.client_core);
    let progress = args.progress(settings.jobs(false));
    let remote = || OsBaseline::Skip(REMOTE_NO_OS.into());
    // The server is another process: its counters are not ours to read.
    fn peer<'a, T: Transport>(transport: &'a T, addr: &'a T::Addr, spin: Duration) -> Peer<'a, T> {
        Peer {
            transport,
            addr,
            counters: None,
            blocking: None,
            spin,
        }
    }
    let (r, at) = match &remote_at {
        Remote::Uds(path) => (
            suite::run(
                &peer(
                    &UdsTransport::default(),
                    &UdsAddr(path.clone()),
                    args.spin(),
                ),
                remote(),
                &settings,
                &progress,
            ),
            path.display().to_string(),
        ),
        Remote::Ip(RemoteTransport::Verbs, addr) => {
            let v = VerbsTransport::new(args.tuning.verbs.config()).map_err(|e| e.to_string())?;
            // `bench server --verbs` serves the link figures one port up.
            let limit = link::Target::at(&v, link::link_addr(*addr));
            (
                suite::run(
                    &peer(&v, addr, args.spin()),
                    OsBaseline::Link(&limit),
                    &settings.for_verbs(),
                    &progress,
                ),
                addr.to_string(),
            )
        }
        Remote::Ip(_, addr) => (
            suite::run(
                &peer(&TcpTransport::default(), addr, args.spin()),
                remote(),
                &settings,
                &progress,
            ),
            addr.to_string(),
        ),
    };
    progress.finish_and_clear();
    let r = r.map_err(|e| format!("{e} (is `bench server` running on {at}?)"))?;
    finish(args, place, settings, vec![r], Vec::new(), started)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The server listens on loopback unless told otherwise, and its help says so.
    #[test]
    fn server_listens_on_loopback_by_default() {
        let cli = Cli::try_parse_from(["bench", "server"]).unwrap();
        let Some(Command::Server(a)) = cli.command else {
            panic!("not the server command: {cli:?}");
        };
        assert_eq!(a.listen, "127.0.0.1:5201".parse::<SocketAddr>().unwrap());
        assert!(a.listen.ip().is_loopback());
        assert_eq!(
            listen_warning(&a.listen),
            None,
            "the default is not warned about"
        );

        use clap::CommandFactory;
        let mut cmd = Cli::command();
        let help = cmd
            .find_subcommand_mut("server")
            .expect("server subcommand")
            .render_long_help()
            .to_string();
        assert!(help.contains("127.0.0.1:5201"), "{help}");
        assert!(help.contains("unauthenticated"), "{help}");
        assert!(help.contains("SIGTERM"), "{help}");
    }

    /// Any address but loopback warns that the port is unauthenticated.
    #[test]
    fn non_loopback_listen_is_warned_about() {
        for exposed in [
            "0.0.0.0:5201",
            "[::]:5201",
            "10.77.0.1:5201",
            "192.168.1.2:1",
        ] {
            let w = listen_warning(&exposed.parse().unwrap())
                .unwrap_or_else(|| panic!("no warning for {exposed}"));
            assert!(w.contains("unauthenticated"), "{w}");
            assert!(w.contains(exposed), "{w}");
        }
        for private in [
            "127.0.0.1:5201",
            "127.1.2.3:0",
            "[::1]:5201",
            "[::ffff:127.0.0.1]:9",
        ] {
            assert_eq!(listen_warning(&private.parse().unwrap()), None, "{private}");
        }
    }
}
