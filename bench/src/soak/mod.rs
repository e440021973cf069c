//! `bench soak`: RPC clients run for a bounded time while faults strike, and every call is
//! accounted for. Three victims, in turn (`--kill`, default all three):
//!
//! - `server`: the server process is killed (SIGKILL, mid-call and mid-frame) and started
//!   again; the clients run here.
//! - `client`: a child process of clients is killed and started again; the server runs here
//!   and must give back every connection, descriptor and task.
//! - `link`: the server and the clients run here, every connection through a fault proxy
//!   (the [`proxy`] module, uds and tcp only) that breaks one live connection at a time, its
//!   faults in turn: `rst` (both sockets closed abruptly, a RST on TCP), `half-close` (the
//!   write side toward the server shut down, so the server reads end of stream while the
//!   client waits for its reply; every other time the mirror, toward the client) and `cut`
//!   (part of a chunk inside a frame forwarded, then both sockets closed; toward the server
//!   and toward the client in turn).
//!
//! ```text
//! bench soak --transports uds,tcp --seconds 20 --clients 8 --kill-every-ms 700
//! bench soak --transports tcp --kill link
//! ```
//!
//! Each client calls `echo` with a payload that names its call (its id and a pattern derived
//! from it; 64 B, 64 KiB and 1 MiB in turn), one call at a time, and reconnects when its
//! connection fails. A call ends in one of three ways: its own payload comes back
//! (`answered`), a typed error (`failed`: the fault struck under it), or no end within
//! [`CALL_BOUND`] (`lost`). A reply carrying another call's payload is `misdelivered`. After
//! the run the process's descriptors and tasks must be back where they were before it
//! (`leaked`), and for `link` no connection may be left open at the server or the proxy. One
//! line per transport and victim; the command fails if anything was lost, misdelivered or
//! leaked, or if no call was answered after a restart (after the first fault, for `link`).
//! `--transports verbs` has no `link` (no byte stream to cut): asked for, it is refused; by
//! default it is skipped with a line saying so.
//!
//! A fourth victim, `device` (verbs only, not in the default; needs `--remove-device
//! DEVICE:NETDEV` and root), deletes the RDMA device with `rdma link delete` halfway through
//! and adds it back (the [`device`] module): every verbs call ends, Unix-socket calls beside
//! them go on, the delete returns, and the verbs clients are answered again afterwards. A
//! fifth, `qp` (verbs only, not in the default), forces one live connection's queue pair to
//! the error state at a time, on the server's and the clients' side in turn (the [`qp`]
//! module).

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Args;
use transport_core::{Connection, Transport};
use transport_rpc::{ClientConfig, RpcClient};
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};

use crate::proto;

mod device;
pub mod proxy;
mod qp;

use proxy::{Endpoint, Fault, Proxy, Toward};

/// A call that has not ended by then is lost (the RPC deadline is off: a call may only end
/// by its reply or by its connection's failure).
const CALL_BOUND: Duration = Duration::from_secs(20);
/// How long a killed server takes at most to listen again.
const RESTART_BOUND: Duration = Duration::from_secs(20);
/// Payload sizes the clients take in turn.
const SIZES: [usize; 3] = [64, 64 << 10, 1 << 20];

/// `bench soak`'s arguments.
#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Transports to soak, in turn (uds, tcp, verbs; verbs needs --verbs-addr).
    #[arg(long, value_delimiter = ',', default_value = "uds,tcp")]
    pub transports: Vec<SoakTransport>,
    /// For verbs: the address the server listens on (an RDMA device's IP and a free port).
    #[arg(long)]
    pub verbs_addr: Option<std::net::SocketAddr>,
    /// Seconds of calls per transport and victim.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub seconds: u64,
    /// Clients calling at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub clients: u64,
    /// A fault strikes this often: the victim process is killed (SIGKILL) and started again,
    /// or (link) the proxy breaks one connection.
    #[arg(long, default_value_t = 700, value_parser = clap::value_parser!(u64).range(10..))]
    pub kill_every_ms: u64,
    /// What the faults strike, in turn [default: server,client,link]: the server process (the
    /// clients here account for every call), the clients (a child process of clients; the
    /// server here must give back every connection, descriptor and task), the link (clients
    /// and server here, through a fault proxy that resets a connection, half-closes it or cuts
    /// it mid-frame; uds and tcp only: verbs has no byte stream to cut).
    #[arg(long, value_delimiter = ',')]
    pub kill: Option<Vec<Victim>>,
    /// For `--kill device` (verbs): the RDMA device to delete and add back, and the network
    /// device it is bound to, as DEVICE:NETDEV (e.g. rxe0:eth0). Needs root (`rdma link`).
    #[arg(long)]
    pub remove_device: Option<String>,
}

/// Why `--kill link` and `--transports verbs` do not go together.
const NO_LINK_ON_VERBS: &str = "--kill link is for uds and tcp: verbs has no byte stream for \
     the fault proxy to reset, half-close or cut; leave verbs out of --transports or link out \
     of --kill";

/// What `bench soak`'s faults strike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Victim {
    /// A `bench server` child; the clients run in the soak's process.
    Server,
    /// A child process of clients (`bench soak-client`); the server runs in the soak's process.
    Client,
    /// The connections: clients and server run in the soak's process, through a fault proxy
    /// that resets, half-closes or cuts one connection at a time (uds and tcp).
    Link,
    /// The RDMA device (verbs, with `--remove-device`): deleted with `rdma link delete` under
    /// verbs clients and server here, Unix-socket ones beside them, then added back.
    Device,
    /// Queue pairs (verbs): one live connection's forced to the error state at a time, on the
    /// server's and the clients' side in turn; clients and server here.
    Qp,
}

/// The hidden `bench soak-client`: clients calling until the process is killed.
#[derive(Args, Debug)]
pub struct SoakClientArgs {
    /// The transport.
    #[arg(long, value_enum)]
    pub transport: SoakTransport,
    /// The server's address: a socket path (uds) or IP:PORT.
    #[arg(long)]
    pub addr: String,
    /// Clients calling at once.
    #[arg(long, default_value_t = 4)]
    pub clients: u64,
}

/// A transport `bench soak` covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SoakTransport {
    /// Unix-domain sockets.
    Uds,
    /// TCP on loopback.
    Tcp,
    /// RDMA verbs (rdma_cm), at `--verbs-addr`.
    Verbs,
}

/// What one transport's soak counted.
#[derive(Debug, Default)]
struct Tally {
    calls: AtomicU64,
    answered: AtomicU64,
    failed: AtomicU64,
    lost: AtomicU64,
    misdelivered: AtomicU64,
    /// Calls answered on a server started again after a kill (link: on a connection made
    /// after a fault).
    answered_after_restart: AtomicU64,
    connects: AtomicU64,
}

/// The soak's runtime (and its child's): two workers, as the machines CI runs on.
fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))
}

/// Each transport with each victim, in turn, and whether it runs: link on verbs is skipped
/// when it comes from the default victims, and refused when asked for.
fn plan(a: &SoakArgs) -> Result<Vec<(SoakTransport, Victim, bool)>, String> {
    let victims = a
        .kill
        .clone()
        .unwrap_or_else(|| vec![Victim::Server, Victim::Client, Victim::Link]);
    let link_asked = a.kill.as_ref().is_some_and(|k| k.contains(&Victim::Link));
    if link_asked && a.transports.contains(&SoakTransport::Verbs) {
        return Err(NO_LINK_ON_VERBS.into());
    }
    let mut plan = Vec::new();
    for &t in &a.transports {
        for &v in &victims {
            let runs = match v {
                Victim::Link => t != SoakTransport::Verbs,
                Victim::Device | Victim::Qp => t == SoakTransport::Verbs,
                Victim::Server | Victim::Client => true,
            };
            plan.push((t, v, runs));
        }
    }
    Ok(plan)
}

/// Runs the soak on each transport; fails if any of them lost, misdelivered or leaked.
pub fn run(a: &SoakArgs) -> Result<(), String> {
    let rt = runtime()?;
    let dir = std::env::temp_dir().join(format!("bench-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut bad = Vec::new();
    for (t, victim, runs) in plan(a)? {
        let name = format!("{t:?}").to_lowercase();
        if !runs {
            if matches!(victim, Victim::Device | Victim::Qp) {
                println!("soak {name:<4} {victim:?} faults: skipped (an RDMA fault, verbs only)");
            } else {
                println!(
                    "soak {name:<4} link faults: skipped (verbs has no byte stream for the fault \
                     proxy to cut)"
                );
            }
            continue;
        }
        let line = match victim {
            Victim::Server => rt.block_on(server_killed(t, a, &dir))?,
            Victim::Client => rt.block_on(clients_killed(t, a, &dir))?,
            Victim::Link => rt.block_on(link_faults(t, a, &dir))?,
            Victim::Device => rt.block_on(device::device_removed(a, &dir))?,
            Victim::Qp => rt.block_on(qp::qp_faults(a))?,
        };
        println!("{}", line.0);
        if !line.1 {
            bad.push(match victim {
                Victim::Link => format!("{name} (link faults)"),
                Victim::Device => format!("{name} (device removal)"),
                Victim::Qp => format!("{name} (queue pair errors)"),
                v => format!("{name} ({} killed)", format!("{v:?}").to_lowercase()),
            });
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("soak failed on {}", bad.join(", ")))
    }
}

/// The clients here, a `bench server` child killed every `kill_every_ms` and started again:
/// the transport's report line and whether it passed.
async fn server_killed(
    t: SoakTransport,
    a: &SoakArgs,
    dir: &std::path::Path,
) -> Result<(String, bool), String> {
    let sock = dir.join(format!("{t:?}.sock"));
    let tcp = free_tcp_addr()?;
    let mut args = vec!["server".into(), "--listen".into(), tcp.to_string()];
    let verbs_at = match t {
        SoakTransport::Verbs => {
            let at = a
                .verbs_addr
                .ok_or("--transports verbs needs --verbs-addr (an RDMA device's IP:PORT)")?;
            // Its own port: on iWARP the TCP listener's would collide with rdma_cm's.
            args.extend(["--verbs".into(), "--verbs-listen".into(), at.to_string()]);
            at
        }
        SoakTransport::Uds => {
            args.extend(["--uds".into(), sock.display().to_string()]);
            tcp
        }
        SoakTransport::Tcp => tcp,
    };
    let server = Restartable { args };
    // The verbs transport (its device, pool, event threads) lives for the process, as an
    // application's would: the baseline is taken after its first connection.
    let verbs = match t {
        SoakTransport::Verbs => Some(
            transport_verbs::VerbsTransport::new(transport_verbs::VerbsConfig::default())
                .map_err(|e| format!("verbs: {e}"))?,
        ),
        _ => None,
    };
    let tally = Arc::new(Tally::default());
    let (kills, report, baseline) = match (t, verbs.clone()) {
        (SoakTransport::Uds, _) => {
            let addr = UdsAddr(sock.clone());
            drive(UdsTransport::default(), addr, &server, a, &tally).await?
        }
        (SoakTransport::Verbs, Some(v)) => drive(v, verbs_at, &server, a, &tally).await?,
        _ => drive(TcpTransport::default(), tcp, &server, a, &tally).await?,
    };
    // The clients and their connections are gone; their tasks end within a bound.
    let deadline = Instant::now() + Duration::from_secs(10);
    let after = Resources::settled(&baseline, deadline).await;
    let (fds, tasks) = after.leaked(&baseline);
    let registered = match &verbs {
        Some(v) => Registered::settled(v, deadline).await,
        None => Registered::default(),
    };
    let get = |c: &AtomicU64| c.load(Ordering::SeqCst);
    let (calls, answered, failed) = (get(&tally.calls), get(&tally.answered), get(&tally.failed));
    let (lost, misdelivered) = (get(&tally.lost), get(&tally.misdelivered));
    let ended_once = answered + failed + lost == calls;
    let restarted_ok = kills == 0 || get(&tally.answered_after_restart) > 0;
    let ok = lost == 0
        && misdelivered == 0
        && fds == 0
        && tasks == 0
        && ended_once
        && restarted_ok
        && registered.clean();
    let line = format!(
        "soak {:<4} {calls} calls in {} s by {} clients: {answered} answered, {failed} failed \
         with a typed error; {kills} server kills (SIGKILL), {} connects; lost {lost}, \
         misdelivered {misdelivered}, leaked {fds} fds and {tasks} tasks{} (RSS {:+} MiB){}{}",
        format!("{t:?}").to_lowercase(),
        a.seconds,
        a.clients,
        get(&tally.connects),
        registered.describe(),
        (after.rss_kib as i64 - baseline.rss_kib as i64) / 1024,
        if report.is_empty() {
            String::new()
        } else {
            format!("; {report}")
        },
        if ok { "" } else { " FAILED" },
    );
    Ok((line, ok))
}

/// Runs the clients against the server process for `a.seconds`, killing and restarting it;
/// returns the number of kills, a note (empty when nothing is worth saying) and what the
/// process held before the clients started.
async fn drive<T>(
    transport: T,
    addr: T::Addr,
    server: &Restartable,
    a: &SoakArgs,
    tally: &Arc<Tally>,
) -> Result<(u64, String, Resources), String>
where
    T: Transport + Clone + Send + Sync + 'static,
    T::Addr: Clone + Send + Sync + 'static,
{
    let mut child = server.start()?;
    wait_listening(&transport, &addr).await?;
    // What the process holds with the transport set up and no client yet.
    let baseline = Resources::now();
    let end = Instant::now() + Duration::from_secs(a.seconds);
    let generation = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..a.clients {
        let (transport, addr, tally) = (transport.clone(), addr.clone(), tally.clone());
        let (generation, stop) = (generation.clone(), stop.clone());
        clients.spawn(client(c, transport, addr, tally, generation, stop));
    }
    let mut kills = 0u64;
    let mut note = String::new();
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(a.kill_every_ms).min(end - Instant::now())).await;
        if Instant::now() >= end {
            break;
        }
        kill(&mut child)?;
        kills += 1;
        child = server.start()?;
        if let Err(e) = wait_listening(&transport, &addr).await {
            note = e;
            break;
        }
        generation.fetch_add(1, Ordering::SeqCst);
    }
    let joined = stop_clients(&stop, &mut clients).await;
    kill(&mut child)?;
    joined?;
    Ok((kills, note, baseline))
}

/// One client: calls until `stop`, reconnecting after failures.
async fn client<T: Transport>(
    id: u64,
    transport: T,
    addr: T::Addr,
    tally: Arc<Tally>,
    generation: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let mut n = 0u64;
    // Failed connects back off (10 ms doubling to 500 ms): a dead server is not stormed, and
    // under emulation the storm would slow its restart.
    let mut backoff = Duration::from_millis(10);
    while !stop.load(Ordering::SeqCst) {
        let Some(rpc) = connect(&transport, &addr).await else {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
            continue;
        };
        backoff = Duration::from_millis(10);
        tally.connects.fetch_add(1, Ordering::Relaxed);
        let born = generation.load(Ordering::SeqCst);
        while !stop.load(Ordering::SeqCst) {
            n += 1;
            let call_id = (id << 40) | n;
            let size = SIZES[(n % SIZES.len() as u64) as usize];
            let payload = named_payload(call_id, size);
            tally.calls.fetch_add(1, Ordering::SeqCst);
            match tokio::time::timeout(CALL_BOUND, rpc.call(proto::method::ECHO, payload.clone()))
                .await
            {
                Err(_) => {
                    tally.lost.fetch_add(1, Ordering::SeqCst);
                    break;
                }
                Ok(Ok(reply)) => {
                    if reply == payload {
                        tally.answered.fetch_add(1, Ordering::SeqCst);
                        if born > 0 {
                            tally.answered_after_restart.fetch_add(1, Ordering::Relaxed);
                        }
                    } else {
                        // Still an end of this call, but with the wrong bytes.
                        tally.answered.fetch_add(1, Ordering::SeqCst);
                        tally.misdelivered.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Ok(Err(_)) => {
                    tally.failed.fetch_add(1, Ordering::SeqCst);
                    break;
                }
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), rpc.close()).await;
    }
}

/// The server here, a child process of clients killed every `kill_every_ms` and started
/// again: afterwards the server must hold no connection, and the process no more descriptors
/// or tasks than before the first child.
async fn clients_killed(
    t: SoakTransport,
    a: &SoakArgs,
    dir: &std::path::Path,
) -> Result<(String, bool), String> {
    let counters = Arc::new(proto::ServerCounters::default());
    let sock = dir.join(format!("{t:?}-clients.sock"));
    let mut verbs = None;
    let (addr, served) = match t {
        SoakTransport::Uds => (
            sock.display().to_string(),
            serve_uds(&sock, &counters).await?,
        ),
        SoakTransport::Tcp => {
            let (at, task) = serve_tcp(&counters).await?;
            (at.to_string(), task)
        }
        SoakTransport::Verbs => {
            let mut at = a
                .verbs_addr
                .ok_or("--transports verbs needs --verbs-addr (an RDMA device's IP:PORT)")?;
            // Not the port the killed servers of the other mode used.
            at.set_port(at.port().wrapping_add(2));
            let v = transport_verbs::VerbsTransport::new(transport_verbs::VerbsConfig::default())
                .map_err(|e| format!("verbs: {e}"))?;
            let l = v
                .listen(&at)
                .await
                .map_err(|e| format!("verbs listen on {at}: {e}"))?;
            verbs = Some(v);
            let c = counters.clone();
            let task = tokio::spawn(async move { proto::serve(l, c).await });
            (at.to_string(), task)
        }
    };
    let name = format!("{t:?}").to_lowercase();
    let child_args = [
        "soak-client".to_string(),
        "--transport".into(),
        name.clone(),
        "--addr".into(),
        addr,
        "--clients".into(),
        a.clients.min(64).to_string(),
    ];
    let children = Restartable {
        args: child_args.to_vec(),
    };
    // The listener and its task are set up: that is the baseline.
    let baseline = Resources::now();
    let end = Instant::now() + Duration::from_secs(a.seconds);
    let mut kills = 0u64;
    while Instant::now() < end {
        let mut child = children.start()?;
        tokio::time::sleep(Duration::from_millis(a.kill_every_ms).min(end - Instant::now())).await;
        kill(&mut child)?;
        kills += 1;
    }
    let served_messages = counters.totals().messages_received;
    // Every connection of a killed child ends (a reset stream, a disconnect, a keepalive at
    // worst on TCP within the bound of an idle peer: none here, the kernel closes them).
    let deadline = Instant::now() + Duration::from_secs(20);
    let open = served_none(&counters, deadline).await;
    let after = Resources::settled(&baseline, deadline).await;
    let (fds, tasks) = after.leaked(&baseline);
    let registered = match &verbs {
        Some(v) => Registered::settled(v, deadline).await,
        None => Registered::default(),
    };
    served.abort();
    let ok = open == 0 && fds == 0 && tasks == 0 && served_messages > 0 && registered.clean();
    let line = format!(
        "soak {name:<4} {kills} client processes killed (SIGKILL) in {} s, {served_messages} \
         messages served; left open {open} connections, leaked {fds} fds and {tasks} \
         tasks{} (RSS {:+} MiB){}",
        a.seconds,
        registered.describe(),
        (after.rss_kib as i64 - baseline.rss_kib as i64) / 1024,
        if ok { "" } else { " FAILED" },
    );
    Ok((line, ok))
}

/// The fault the proxy injects at `turn`: rst, half-close, cut in turn, the half-close and
/// the cut aimed at the server for one round and at the client for the next.
fn fault_in_turn(turn: u64) -> Fault {
    let toward = if (turn / 3) % 2 == 0 {
        Toward::Server
    } else {
        Toward::Client
    };
    match turn % 3 {
        0 => Fault::Rst,
        1 => Fault::HalfClose(toward),
        _ => Fault::Cut(toward),
    }
}

/// The server and the clients here, every connection through the fault proxy, which breaks
/// one every `kill_every_ms`: every call must end once, a call must be answered after the
/// first fault, and afterwards no connection may be open at the server or the proxy and the
/// process hold no more descriptors or tasks than before the clients.
async fn link_faults(
    t: SoakTransport,
    a: &SoakArgs,
    dir: &std::path::Path,
) -> Result<(String, bool), String> {
    let counters = Arc::new(proto::ServerCounters::default());
    let (upstream, listen, served) = match t {
        SoakTransport::Uds => {
            let sock = dir.join("link-server.sock");
            let task = serve_uds(&sock, &counters).await?;
            let proxy_at = Endpoint::Unix(dir.join("link-proxy.sock"));
            (Endpoint::Unix(sock), proxy_at, task)
        }
        SoakTransport::Tcp => {
            let (at, task) = serve_tcp(&counters).await?;
            let proxy_at = Endpoint::Tcp("127.0.0.1:0".parse().expect("an address"));
            (Endpoint::Tcp(at), proxy_at, task)
        }
        SoakTransport::Verbs => return Err(NO_LINK_ON_VERBS.into()),
    };
    let proxy = match Proxy::start(&listen, upstream).await {
        Ok(p) => p,
        Err(e) => {
            served.abort();
            return Err(format!("the fault proxy at {listen}: {e}"));
        }
    };
    // The server's and the proxy's listeners and tasks are set up: that is the baseline.
    let baseline = Resources::now();
    let tally = Arc::new(Tally::default());
    // A connection made after a fault was applied counts its answers as after a restart.
    let generation = proxy.counts().applied();
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..a.clients {
        let (tally, generation, stop) = (tally.clone(), generation.clone(), stop.clone());
        match proxy.local() {
            Endpoint::Unix(p) => {
                let addr = UdsAddr(p.clone());
                let t = UdsTransport::default();
                clients.spawn(client(c, t, addr, tally, generation, stop));
            }
            Endpoint::Tcp(at) => {
                let t = TcpTransport::default();
                clients.spawn(client(c, t, *at, tally, generation, stop));
            }
        }
    }
    let end = Instant::now() + Duration::from_secs(a.seconds);
    let mut turn = 0u64;
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(a.kill_every_ms).min(end - Instant::now())).await;
        if Instant::now() >= end {
            break;
        }
        // No live connection now (every client reconnecting): the same fault next time.
        if proxy.inject(fault_in_turn(turn)) {
            turn += 1;
        }
    }
    if let Err(e) = stop_clients(&stop, &mut clients).await {
        served.abort();
        return Err(e);
    }
    // Every client closed its connection: the proxy's relays and the server's connections
    // end within a bound.
    let deadline = Instant::now() + Duration::from_secs(20);
    let _ = tokio::time::timeout_at(deadline.into(), proxy.idle()).await;
    let open = served_none(&counters, deadline).await + proxy.live();
    let after = Resources::settled(&baseline, deadline).await;
    let (fds, tasks) = after.leaked(&baseline);
    served.abort();
    let faults = proxy.counts();
    let (rst, half_close, cut) = (faults.rst(), faults.half_close(), faults.cut());
    drop(proxy);
    let get = |c: &AtomicU64| c.load(Ordering::SeqCst);
    let (calls, answered, failed) = (get(&tally.calls), get(&tally.answered), get(&tally.failed));
    let (lost, misdelivered) = (get(&tally.lost), get(&tally.misdelivered));
    let ended_once = answered + failed + lost == calls;
    let answered_after = rst + half_close + cut == 0 || get(&tally.answered_after_restart) > 0;
    let ok = lost == 0
        && misdelivered == 0
        && fds == 0
        && tasks == 0
        && open == 0
        && ended_once
        && answered_after;
    let line = format!(
        "soak {:<4} link faults: {calls} calls in {} s by {} clients: {answered} answered, \
         {failed} failed with a typed error; faults {rst} rst, {half_close} half-close, {cut} \
         cut; {} connects; lost {lost}, misdelivered {misdelivered}, leaked {fds} fds, {tasks} \
         tasks, {open} connections (RSS {:+} MiB){}{}",
        format!("{t:?}").to_lowercase(),
        a.seconds,
        a.clients,
        get(&tally.connects),
        (after.rss_kib as i64 - baseline.rss_kib as i64) / 1024,
        if answered_after {
            ""
        } else {
            "; no call answered after the first fault"
        },
        if ok { "" } else { " FAILED" },
    );
    Ok((line, ok))
}

/// `bench soak-client`: clients call until the process is killed (the soak kills it).
pub fn client_process(a: &SoakClientArgs) -> Result<(), String> {
    let rt = runtime()?;
    rt.block_on(async {
        let tally = Arc::new(Tally::default());
        let (generation, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let verbs = match a.transport {
            SoakTransport::Verbs => Some(
                transport_verbs::VerbsTransport::new(transport_verbs::VerbsConfig::default())
                    .map_err(|e| format!("verbs: {e}"))?,
            ),
            _ => None,
        };
        let mut clients = tokio::task::JoinSet::new();
        for c in 0..a.clients {
            let (tally, generation, stop) = (tally.clone(), generation.clone(), stop.clone());
            match (a.transport, &verbs) {
                (SoakTransport::Uds, _) => {
                    let addr = UdsAddr(a.addr.clone().into());
                    clients.spawn(client(
                        c,
                        UdsTransport::default(),
                        addr,
                        tally,
                        generation,
                        stop,
                    ));
                }
                (SoakTransport::Verbs, Some(v)) => {
                    let addr = a.addr.parse().map_err(|e| format!("{}: {e}", a.addr))?;
                    clients.spawn(client(c, v.clone(), addr, tally, generation, stop));
                }
                _ => {
                    let addr = a.addr.parse().map_err(|e| format!("{}: {e}", a.addr))?;
                    clients.spawn(client(
                        c,
                        TcpTransport::default(),
                        addr,
                        tally,
                        generation,
                        stop,
                    ));
                }
            }
        }
        while clients.join_next().await.is_some() {}
        Ok(())
    })
}

/// An RPC client on a new bench connection (`None`: the server is not there now).
async fn connect<T: Transport>(
    transport: &T,
    addr: &T::Addr,
) -> Option<RpcClient<<T::Connection as Connection>::Sender>> {
    let conn = tokio::time::timeout(Duration::from_secs(5), transport.connect(addr))
        .await
        .ok()?
        .ok()?;
    let config = ClientConfig::default().with_default_deadline(None);
    proto::rpc_client(conn, config).await.ok()
}

/// `size` (at least 8) bytes that name the call: its id, then a pattern seeded by it
/// (xorshift), so that a reply with another call's bytes, or bytes of two calls, differs.
fn named_payload(call_id: u64, size: usize) -> Bytes {
    let mut v = Vec::with_capacity(size.max(8));
    v.extend_from_slice(&call_id.to_le_bytes());
    let mut x = call_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while v.len() < size {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes()[..(size - v.len()).min(8)]);
    }
    Bytes::from(v)
}

/// Waits until `addr` accepts a connection (a new server process is listening).
async fn wait_listening<T: Transport>(transport: &T, addr: &T::Addr) -> Result<(), String> {
    let deadline = Instant::now() + RESTART_BOUND;
    loop {
        if let Ok(Ok(c)) =
            tokio::time::timeout(Duration::from_secs(1), transport.connect(addr)).await
        {
            drop(c);
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the server did not listen again within {RESTART_BOUND:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn kill(child: &mut Child) -> Result<(), String> {
    // `Child::kill` sends SIGKILL: the server dies mid-call, mid-frame, without closing.
    let _ = child.kill();
    child
        .wait()
        .map_err(|e| format!("waiting for the killed server: {e}"))?;
    Ok(())
}

/// A child process of this executable (`bench server`, `bench soak-client`) the soak kills
/// and starts again.
struct Restartable {
    args: Vec<String>,
}

impl Restartable {
    fn start(&self) -> Result<Child, String> {
        let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
        Command::new(exe)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting bench server: {e}"))
    }
}

/// A free loopback TCP address (bound and released: the server binds it next).
fn free_tcp_addr() -> Result<std::net::SocketAddr, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    l.local_addr().map_err(|e| format!("local addr: {e}"))
}

/// A verbs transport's connections and registered memory once a run has settled: no
/// connection may be left, and no pool buffer lent out (a message, READ target or payload
/// never given back: see `MemoryUse::lent_bytes`). Empty for the socket transports.
#[derive(Debug, Default)]
struct Registered(Option<transport_verbs::MemoryUse>);

impl Registered {
    /// The transport's use once nothing is left, or at `deadline`.
    async fn settled(v: &transport_verbs::VerbsTransport, deadline: Instant) -> Registered {
        loop {
            let m = v.memory_use();
            if (m.connections == 0 && m.lent_bytes == 0) || Instant::now() >= deadline {
                return Registered(Some(m));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn clean(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(|m| m.connections == 0 && m.lent_bytes == 0)
    }

    /// `, 0 verbs connections and 0 B lent of 12 MiB registered` (empty for sockets).
    fn describe(&self) -> String {
        self.0.as_ref().map_or_else(String::new, |m| {
            format!(
                ", {} verbs connections and {} B lent of {} MiB registered",
                m.connections,
                m.lent_bytes,
                m.registered_bytes >> 20
            )
        })
    }
}

/// A TCP server of the bench's protocol on a free loopback port: its address and its task.
async fn serve_tcp(
    counters: &Arc<proto::ServerCounters>,
) -> Result<(std::net::SocketAddr, Served), String> {
    let l = TcpTransport::default()
        .listen(&"127.0.0.1:0".parse().expect("an address"))
        .await
        .map_err(|e| format!("tcp listen: {e}"))?;
    let at = transport_core::Listener::local_addr(&l).map_err(|e| e.to_string())?;
    Ok((at, tokio::spawn(proto::serve(l, counters.clone()))))
}

/// A Unix-socket server of the bench's protocol at `sock`: its task.
async fn serve_uds(
    sock: &std::path::Path,
    counters: &Arc<proto::ServerCounters>,
) -> Result<Served, String> {
    let l = UdsTransport::default()
        .listen(&UdsAddr(sock.to_path_buf()))
        .await
        .map_err(|e| format!("listen on {}: {e}", sock.display()))?;
    Ok(tokio::spawn(proto::serve(l, counters.clone())))
}

/// A server task of [`proto::serve`].
type Served = tokio::task::JoinHandle<Result<(), transport_core::TransportError>>;

/// Stops the clients and waits (bounded by a call's bound) for every one to end.
async fn stop_clients(
    stop: &AtomicBool,
    clients: &mut tokio::task::JoinSet<()>,
) -> Result<(), String> {
    stop.store(true, Ordering::SeqCst);
    tokio::time::timeout(CALL_BOUND + Duration::from_secs(10), async {
        while let Some(r) = clients.join_next().await {
            r.map_err(|e| format!("a client task failed: {e}"))?;
        }
        Ok(())
    })
    .await
    .unwrap_or_else(|_| Err("the clients did not stop in time".into()))
}

/// Waits until the server serves no connection, or `deadline`; how many it still serves.
async fn served_none(counters: &proto::ServerCounters, deadline: Instant) -> usize {
    while counters.live() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    counters.live()
}

/// What the process holds: descriptors, runtime tasks, resident memory.
struct Resources {
    fds: usize,
    tasks: usize,
    rss_kib: u64,
}

impl Resources {
    fn now() -> Resources {
        let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
        let tasks = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        let rss_kib = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                let l = s.lines().find(|l| l.starts_with("VmRSS:"))?;
                l.split_whitespace().nth(1)?.parse().ok()
            })
            .unwrap_or(0);
        Resources {
            fds,
            tasks,
            rss_kib,
        }
    }

    /// What the process holds once it holds no more than `base`, or at `deadline`.
    async fn settled(base: &Resources, deadline: Instant) -> Resources {
        let mut now = Resources::now();
        while now.leaked(base) != (0, 0) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            now = Resources::now();
        }
        now
    }

    /// Descriptors and tasks held beyond `base`.
    fn leaked(&self, base: &Resources) -> (usize, usize) {
        (
            self.fds.saturating_sub(base.fds),
            self.tasks.saturating_sub(base.tasks),
        )
    }
}

#[cfg(test)]
mod tests;
