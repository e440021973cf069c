//! `bench count`: one measurement, alone in its process, for counting the instructions a
//! message costs (`cargo xtask profile` runs it under callgrind).
//!
//! A process that runs one path (the OS's sockets or the link, the raw connection, RPC) for one
//! operation and one size, `N` times, then exits, costs set-up + N x per-message work. Run for
//! `N` and `3N`, the difference divided by `2N` is what one message costs, set-up cancelled.
//! The same holds for the server's process (`bench server` under callgrind, stopped by
//! SIGTERM), which then counts the server's side of the same messages.
//!
//! ```text
//! bench server --uds /tmp/b.sock --os-uds /tmp/os.sock &
//! bench count unix:/tmp/b.sock --path raw --op ping --count 2000
//! bench count unix:/tmp/os.sock --path os --op oneway --size 64K --count 500
//! bench count 10.0.0.5 --transport verbs --path link --op ping --count 2000
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use transport_core::Transport;
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};
use transport_verbs::VerbsTransport;

use crate::args::RemoteTransport;
use crate::measure::{self, Job, Layer, Op, Outcome, Peer, RawTwoway};
use crate::{link, os};

/// Which path `bench count` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CountPath {
    /// What the machine gives without the project: blocking OS sockets (uds, tcp; the server
    /// needs `--os-uds` / `--os-tcp`) or the link's own ping-pong and READ stream (verbs, one
    /// port above the bench server's).
    Os,
    /// The link (verbs only; the same as `os` there).
    Link,
    /// The backend's connection, no RPC.
    Raw,
    /// RPC over the same backend.
    Rpc,
}

/// The operations `bench count` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CountOp {
    /// One round trip per message: a 1-byte raw ping-pong, a `void o()` call.
    Ping,
    /// A stream of messages of `--size` to the server: raw stream into a sink, oneway calls.
    Oneway,
    /// Twoway calls carrying `--size` to the server (RPC; raw and os measure their stream,
    /// as for oneway).
    Send,
}

/// `bench count`'s arguments.
#[derive(Args, Debug)]
pub struct CountArgs {
    /// The server: HOST[:PORT] (tcp, verbs) or `unix:PATH` (uds; for `--path os` the path of
    /// the server's `--os-uds` socket, and HOST:PORT its `--os-tcp` address).
    pub host: String,
    /// Transport to the server (default: uds for `unix:PATH`, else tcp).
    #[arg(long, value_enum)]
    pub transport: Option<RemoteTransport>,
    /// What is measured.
    #[arg(long, value_enum)]
    pub path: CountPath,
    /// The operation.
    #[arg(long, value_enum, default_value_t = CountOp::Ping)]
    pub op: CountOp,
    /// Payload bytes per message for oneway and send (K/M suffixes allowed).
    #[arg(long, default_value = "64K", value_parser = crate::args::parse_size)]
    pub size: usize,
    /// Messages (or round trips), after a warm-up of 20.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub count: u64,
    #[command(flatten)]
    pub verbs: crate::tuning::VerbsArgs,
}

/// Runs one measurement and prints one line: messages, seconds, and the path's p50 for pings.
pub fn run(a: &CountArgs) -> Result<(), String> {
    let remote = crate::args::Remote::parse(&a.host, a.transport)?;
    let size = match a.op {
        CountOp::Ping => 0,
        _ => a.size,
    };
    let o = match (&remote, a.path) {
        (crate::args::Remote::Uds(p), CountPath::Os) => {
            os_path(&os::Target::Uds(p.clone()), a, size)?
        }
        (crate::args::Remote::Ip(RemoteTransport::Tcp, addr), CountPath::Os) => {
            os_path(&os::Target::Tcp(*addr), a, size)?
        }
        (
            crate::args::Remote::Ip(RemoteTransport::Verbs, addr),
            CountPath::Os | CountPath::Link,
        ) => {
            let v = VerbsTransport::new(verbs_config(a)).map_err(|e| e.to_string())?;
            let t = link::Target::at(&v, link::link_addr(*addr));
            match a.op {
                CountOp::Ping => link::ping(&t, a.count, None)?,
                _ => link::stream(&t, size, a.count, None)?,
            }
        }
        (_, CountPath::Link) => {
            return Err("--path link is the verbs link: use --path os for uds and tcp".into())
        }
        (crate::args::Remote::Uds(p), path) => {
            job(&UdsTransport::default(), &UdsAddr(p.clone()), a, path)?
        }
        (crate::args::Remote::Ip(RemoteTransport::Verbs, addr), path) => {
            let v = VerbsTransport::new(verbs_config(a)).map_err(|e| e.to_string())?;
            job(&v, addr, a, path)?
        }
        (crate::args::Remote::Ip(_, addr), path) => job(&TcpTransport::default(), addr, a, path)?,
    };
    let p50 = o
        .latency
        .as_ref()
        .map(|h| format!(" p50 {:.2} µs", h.value_at_quantile(0.5) as f64 / 1000.0))
        .unwrap_or_default();
    println!(
        "count: {} messages in {:.3} s{p50}",
        o.calls,
        o.elapsed.as_secs_f64()
    );
    Ok(())
}

/// The `--verbs-*` settings, with time for a peer that runs under callgrind to connect.
fn verbs_config(a: &CountArgs) -> transport_verbs::VerbsConfig {
    let mut c = a.verbs.config();
    c.connect_timeout = c.connect_timeout.max(std::time::Duration::from_secs(120));
    c
}

fn os_path(t: &os::Target, a: &CountArgs, size: usize) -> Result<Outcome, String> {
    match a.op {
        CountOp::Ping => os::ping(t, a.count, None),
        _ => os::stream(t, size, a.count, None),
    }
}

fn job<T: Transport + Clone>(
    transport: &T,
    addr: &T::Addr,
    a: &CountArgs,
    path: CountPath,
) -> Result<Outcome, String> {
    let (op, layer) = match (a.op, path) {
        (CountOp::Ping, CountPath::Raw) => (Op::Ping, Layer::Raw),
        (CountOp::Ping, _) => (Op::Ping, Layer::Rpc),
        // The raw connection's send is its stream into a sink, as oneway's.
        (CountOp::Oneway | CountOp::Send, CountPath::Raw) => (Op::Oneway, Layer::Raw),
        (CountOp::Oneway, _) => (Op::Oneway, Layer::Rpc),
        (CountOp::Send, _) => (Op::Send, Layer::Rpc),
    };
    let peer = Peer {
        transport,
        addr,
        counters: None,
        blocking: None,
        // Counts are made without spinning: a spin's polls would be counted as work.
        spin: std::time::Duration::ZERO,
    };
    measure::run(
        &peer,
        Job {
            op,
            layer,
            size: match op {
                Op::Ping if layer == Layer::Raw => 1,
                Op::Ping => 0,
                _ => a.size,
            },
            count: a.count,
            threads: 1,
            // One call in flight: what a message costs, not what overlapping hides.
            window: 1,
            client_core: None,
            heap_payload: false,
            raw_twoway: RawTwoway::Stream,
        },
    )
}

/// `bench server`'s OS baseline servers (`--os-uds`, `--os-tcp`), alive while held.
pub fn os_servers(
    uds: &Option<PathBuf>,
    tcp: &Option<SocketAddr>,
) -> Result<Vec<os::Server>, String> {
    let mut v = Vec::new();
    if let Some(p) = uds {
        v.push(os::Server::start(os::Target::Uds(p.clone()), None)?);
        eprintln!(
            "bench server: os baseline (blocking sockets) uds {}",
            p.display()
        );
    }
    if let Some(a) = tcp {
        let s = os::Server::start(os::Target::Tcp(*a), None)?;
        if let os::Target::Tcp(at) = s.target() {
            eprintln!("bench server: os baseline (blocking sockets) tcp {at}");
        }
        v.push(s);
    }
    Ok(v)
}
