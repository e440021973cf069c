//! The link's own figures for verbs: the limit raw and RPC are measured against, as the OS's
//! blocking sockets are for uds and tcp ([`crate::os`]).
//!
//! Measured through `transport_verbs::link`, perftest-style, in the same run and placement:
//! - **ping-pong** ([`ping`]): 2-byte SENDs, busy-polled on both sides (`ib_send_lat`); every
//!   round trip goes into a histogram, as for the raw and RPC pings.
//! - **stream** ([`stream`]): RDMA READs of the message size from a buffer the server exposes,
//!   32 in flight (`ib_read_bw`; see `transport_verbs::link` for why READ and not WRITE).
//!
//! The server ([`Server`]) runs on a thread of its own pinned where the bench server is, and
//! the client on a thread pinned where the bench's client threads are. Both spin while they
//! measure (that is what a link figure is), and sleep otherwise.

use crate::measure::{self, Outcome};
use crate::sys;
use hdrhistogram::Histogram;
use std::net::SocketAddr;
use std::time::Duration;
use transport_verbs::link::{LinkClient, LinkServer};
use transport_verbs::VerbsTransport;

/// What the report says the link figures are.
pub const DESCRIBE: &str = "the link through this crate's binding, perftest-style: 2-byte SEND \
    ping-pong busy-polled on both sides (ib_send_lat) and a stream of RDMA READs of the size, 32 \
    in flight (ib_read_bw); no runtime, no protocol";

/// Where the link server listens, and the transport to reach it with.
#[derive(Clone)]
pub struct Target {
    verbs: VerbsTransport,
    addr: SocketAddr,
}

impl Target {
    /// A link server at `addr` (e.g. a remote `bench server --verbs`'s, see [`link_addr`]).
    pub fn at(verbs: &VerbsTransport, addr: SocketAddr) -> Target {
        Target {
            verbs: verbs.clone(),
            addr,
        }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Where `bench server --verbs` listening at `bench` serves the link figures: one port up.
/// (Port 0, any free port, stays 0.)
pub fn link_addr(bench: SocketAddr) -> SocketAddr {
    let port = match bench.port() {
        0 => 0,
        p => p.wrapping_add(1),
    };
    SocketAddr::new(bench.ip(), port)
}

/// The link server, on its own thread (see [`LinkServer`]).
pub struct Server {
    /// Serves until dropped.
    _inner: LinkServer,
    target: Target,
}

impl Server {
    /// Listens at `addr` (the RDMA device's IP, port 0), on a thread pinned to `core`.
    pub fn start(
        verbs: &VerbsTransport,
        addr: SocketAddr,
        core: Option<usize>,
    ) -> Result<Server, String> {
        let verbs2 = verbs.clone();
        let inner = std::thread::spawn(move || {
            // The server thread LinkServer starts inherits this thread's CPU mask.
            if let Some(c) = core {
                sys::pin_current_thread(c)?;
            }
            LinkServer::start(&verbs2, addr).map_err(|e| format!("link: listen on {addr}: {e}"))
        })
        .join()
        .map_err(|_| "link: the server thread panicked".to_string())??;
        let target = Target {
            verbs: verbs.clone(),
            addr: inner.local_addr(),
        };
        Ok(Server {
            _inner: inner,
            target,
        })
    }

    /// Where clients connect.
    pub fn target(&self) -> &Target {
        &self.target
    }
}

/// Runs `work` on a client thread pinned to `core` with a fresh link connection; returns its
/// result with the CPU use of the process over the work.
fn on_client<F, T>(
    t: &Target,
    core: Option<usize>,
    work: F,
) -> Result<(T, sys::Usage, Duration), String>
where
    F: FnOnce(&mut LinkClient) -> Result<(T, Duration), String> + Send + 'static,
    T: Send + 'static,
{
    let t = t.clone();
    std::thread::Builder::new()
        .name("link-client".into())
        .spawn(move || {
            if let Some(c) = core {
                sys::pin_current_thread(c)?;
            }
            let mut c = LinkClient::connect(&t.verbs, t.addr)
                .map_err(|e| format!("link: connect to {}: {e}", t.addr))?;
            let u0 = sys::usage();
            let (r, elapsed) = work(&mut c)?;
            Ok((r, sys::usage() - u0, elapsed))
        })
        .map_err(|e| format!("link: client thread: {e}"))?
        .join()
        .map_err(|_| "link: the client thread panicked".to_string())?
}

fn outcome(
    calls: u64,
    bytes: u64,
    elapsed: Duration,
    hist: Option<Histogram<u64>>,
    usage: sys::Usage,
) -> Outcome {
    let m = crate::os::Measured {
        elapsed,
        bytes,
        hist,
        // The link's loop only posts and polls: no counted system calls.
        syscalls: 0,
        messages: calls,
        usage,
    };
    crate::os::outcome(m, calls)
}

/// `count` busy-polled 2-byte SEND round trips (after a warm-up) from a client thread pinned
/// to `core`; the outcome has the round-trip histogram.
pub fn ping(t: &Target, count: u64, core: Option<usize>) -> Result<Outcome, String> {
    let (h, u, elapsed) = on_client(t, core, move |c| {
        let mut h = measure::new_hist();
        let start = std::time::Instant::now();
        c.ping_pong(count, |rt| measure::record(&mut h, rt))
            .map_err(|e| format!("link ping: {e}"))?;
        Ok((h, start.elapsed()))
    })?;
    Ok(outcome(count, 0, elapsed, Some(h), u))
}

/// `count` RDMA READs of `size` bytes (after a warm-up), 32 in flight, from a client thread
/// pinned to `core`.
pub fn stream(t: &Target, size: usize, count: u64, core: Option<usize>) -> Result<Outcome, String> {
    let ((), u, elapsed) = on_client(t, core, move |c| {
        let e = c
            .read_stream(size, count)
            .map_err(|e| format!("link stream: {e}"))?;
        Ok(((), e))
    })?;
    Ok(outcome(count, size as u64 * count, elapsed, None, u))
}
