//! The link's own figures, measured through this crate's binding the way perftest measures
//! them: a busy-polled 2-byte SEND ping-pong (`ib_send_lat`) and a stream of large RDMA READs
//! with many in flight (`ib_read_bw`). No protocol engine, no async runtime, no credits: a
//! thread posts work requests and spins on its completion queue. The ping-pong does what
//! `ib_send_lat` does per round trip (one inline SEND built on the stack and posted at once,
//! signaled once per quarter of the send queue; one completion polled at a time, the receive
//! buffer posted again in place), so that its figure is the device's, not this crate's
//! bookkeeping: under emulation every user-space instruction shows in the round trip. What the
//! transport and RPC get is then read against what the device gives (`bench` prints link /
//! raw / RPC).
//!
//! The stream reads rather than writes: nothing in this crate grants remote write access (see
//! the crate's security model), and a READ stream moves the same bytes over the same queue
//! pair with the target's CPU idle, as a WRITE stream does. perftest's `ib_read_bw` and
//! `ib_write_bw` can be run beside it (`cargo xtask bench` does, in the soft-RoCE guest).
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use transport_verbs::link::{LinkClient, LinkServer};
//! use transport_verbs::{VerbsConfig, VerbsTransport};
//!
//! let verbs = VerbsTransport::new(VerbsConfig::default())?;
//! let ip = transport_verbs::local_rdma_ip()?;
//! let server = LinkServer::start(&verbs, std::net::SocketAddr::new(ip, 0))?;
//! let mut client = LinkClient::connect(&verbs, server.local_addr())?;
//! let mut worst = std::time::Duration::ZERO;
//! client.ping_pong(10_000, |rt| worst = worst.max(rt))?;
//! let elapsed = client.read_stream(1 << 20, 1000)?;
//! # let _ = elapsed; Ok(()) }
//! ```
//!
//! The server side of a link connection answers pings and exposes one buffer at a time for the
//! client's READs, through a memory window bound to that connection's queue pair (as any
//! rendezvous payload). It serves one client at a time.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sideway::rdmacm::communication_manager::Identifier;
use transport_core::TransportError;

use crate::cm::{self, Established};
use crate::error::{VerbsError, WorkRequestKind};
use crate::ffi::{Completion, Endpoint, ReadSpec, SqLocal, WcFailure};
use crate::pool::{Pool, PoolBuf};
use crate::VerbsTransport;

/// A wait for the peer that sees no completion for this long fails with a timeout.
pub const LINK_TIMEOUT: Duration = Duration::from_secs(10);

/// Round trips before the measured ones.
const WARMUP: u64 = 20;
/// RDMA READs in flight in a stream (perftest's default tx depth is 128; the send queue holds
/// binds and messages too).
const READS_IN_FLIGHT: usize = 32;

/// Control messages (first byte; in the control slot of a SEND, inline).
const PING: u8 = b'p';
/// Client -> server: expose a buffer of `u32` bytes; server -> client: `u64` address, `u32`
/// rkey, `u32` length.
const EXPOSE: u8 = b'x';
/// Largest buffer a client may ask to be exposed for a READ stream.
const MAX_STREAM: usize = 64 << 20;
/// Client -> server: the stream is over, revoke the exposure.
const DONE: u8 = b'd';
/// Client -> server: the client leaves (answered, so that it lands before the QP goes).
const QUIT: u8 = b'q';

/// One link connection: the endpoint, its pool and its identifier, driven by busy polling.
struct Link {
    ep: Endpoint<PoolBuf>,
    pool: Pool,
    comps: Vec<Completion<PoolBuf>>,
    device: String,
    _id: Arc<Identifier>,
}

/// A received control message (the first bytes of a receive buffer).
struct Ctrl {
    bytes: [u8; 16],
}

fn wc_error(kind: WorkRequestKind, e: WcFailure) -> TransportError {
    e.into_error(kind).into()
}

/// The error a failed completion reports (`None` for a successful one).
fn completion_error(c: &Completion<PoolBuf>) -> Option<TransportError> {
    match c {
        Completion::Recv { status: Err(e), .. } => Some(wc_error(WorkRequestKind::Receive, *e)),
        Completion::Read { status: Err(e), .. } => Some(wc_error(WorkRequestKind::RdmaRead, *e)),
        Completion::Sent {
            status: Err(e),
            kind,
        } => Some(wc_error(*kind, *e)),
        _ => None,
    }
}

fn timeout(what: &'static str) -> TransportError {
    VerbsError::Timeout {
        what,
        after: LINK_TIMEOUT,
    }
    .into()
}

/// How long a spinning wait has gone without a completion: the clock is read once per 1024
/// empty polls, and a wait that sees none for [`LINK_TIMEOUT`] (or is told to stop) ends.
struct Patience {
    last: Instant,
    spins: u32,
}

impl Patience {
    fn new() -> Patience {
        Patience {
            last: Instant::now(),
            spins: 0,
        }
    }

    /// A completion came: the wait starts over.
    fn progressed(&mut self) {
        self.last = Instant::now();
        self.spins = 0;
    }

    /// An empty poll: fails once the wait for `what` has lasted too long or `stop` is set.
    fn empty_poll(
        &mut self,
        what: &'static str,
        stop: Option<&AtomicBool>,
    ) -> Result<(), TransportError> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % 1024 == 0 {
            if self.last.elapsed() > LINK_TIMEOUT {
                return Err(timeout(what));
            }
            if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return Err(TransportError::Closed);
            }
        }
        std::hint::spin_loop();
        Ok(())
    }
}

impl Link {
    fn new(est: Established) -> Link {
        Link {
            ep: est.res.ep,
            pool: est.res.pool,
            comps: Vec::with_capacity(32),
            device: est.res.device,
            _id: est.id,
        }
    }

    fn device_err(&self, op: &'static str, e: std::io::Error) -> TransportError {
        VerbsError::verbs(op, &self.device, e).into()
    }

    /// Sends a control message of up to 16 bytes (inline). Waits for send-queue room for at
    /// most [`LINK_TIMEOUT`] without a completion.
    fn send_ctrl(&mut self, msg: &[u8]) -> Result<(), TransportError> {
        self.wait_sq_room()?;
        let slot = self.ep.next_ctrl_slot();
        slot[..msg.len()].copy_from_slice(msg);
        self.ep.stage_send(SqLocal::Ctrl { len: msg.len() });
        self.ep
            .ring()
            .map_err(|e| self.device_err("ibv_post_send", e))?;
        Ok(())
    }

    /// Polls until the send queue has room, for at most [`LINK_TIMEOUT`] without a completion.
    fn wait_sq_room(&mut self) -> Result<(), TransportError> {
        let mut patience = Patience::new();
        while self.ep.sq_room() == 0 {
            if self.poll_once(&mut |_| Ok(()))? > 0 {
                patience.progressed();
                continue;
            }
            patience.empty_poll("room in the send queue", None)?;
        }
        Ok(())
    }

    /// Polls the CQ once; each received message (re-posted at once) and each finished READ
    /// goes to `on`. Returns how many completions were seen.
    fn poll_once(
        &mut self,
        on: &mut dyn FnMut(Event) -> Result<(), TransportError>,
    ) -> Result<usize, TransportError> {
        let mut comps = std::mem::take(&mut self.comps);
        let n = self
            .ep
            .poll(&mut comps)
            .map_err(|e| self.device_err("ibv_poll_cq", e))?;
        let mut result = Ok(());
        for c in comps.drain(..) {
            if result.is_err() {
                continue;
            }
            if let Some(e) = completion_error(&c) {
                result = Err(e);
                continue;
            }
            result = match c {
                Completion::Recv { buf, len, .. } => {
                    let mut bytes = [0u8; 16];
                    let k = len.min(16);
                    bytes[..k].copy_from_slice(&buf.as_slice()[..k]);
                    // The buffer goes back to the receive queue before anything else.
                    match self.ep.stage_recv(buf) {
                        Ok(()) => on(Event::Msg(Ctrl { bytes })),
                        Err(_) => Err(VerbsError::Internal("receive table overrun".into()).into()),
                    }
                }
                Completion::Read { .. } => on(Event::ReadDone),
                Completion::Sent { .. } => Ok(()),
            };
        }
        self.comps = comps;
        result?;
        self.ep.ring().map_err(|e| self.device_err("ibv_post", e))?;
        Ok(n)
    }

    /// Spins until `on` says done; fails after `LINK_TIMEOUT` without a completion, or when
    /// `stop` is set.
    fn spin_until(
        &mut self,
        what: &'static str,
        stop: Option<&AtomicBool>,
        on: &mut dyn FnMut(Event) -> Result<bool, TransportError>,
    ) -> Result<(), TransportError> {
        let mut patience = Patience::new();
        let mut done = false;
        while !done {
            let n = self.poll_once(&mut |e| {
                if on(e)? {
                    done = true;
                }
                Ok(())
            })?;
            if n > 0 {
                patience.progressed();
                continue;
            }
            patience.empty_poll(what, stop)?;
        }
        Ok(())
    }

    /// Sends a ping (or its answer) the way `ib_send_lat` does: one inline SEND posted at once,
    /// signaled once per quarter of the send queue. Waits for send-queue room for at most
    /// [`LINK_TIMEOUT`] without a completion.
    fn send_ping(&mut self) -> Result<(), TransportError> {
        self.wait_sq_room()?;
        self.ep
            .post_inline_now(&[PING, 0])
            .map_err(|e| self.device_err("ibv_post_send", e))
    }

    /// One poll of the CQ, `ib_send_lat`-style: a received message's first bytes land in
    /// `into` (its buffer is posted again in place). Other completions are checked (a failed
    /// one is the error) and left in `self.comps`.
    fn poll_one(&mut self, into: &mut [u8]) -> Result<Option<usize>, TransportError> {
        self.comps.clear();
        let got = self
            .ep
            .poll_one(into, &mut self.comps)
            .map_err(|e| self.device_err("ibv_poll_cq", e))?;
        if let Some(e) = self.comps.iter().find_map(completion_error) {
            return Err(e);
        }
        Ok(got)
    }

    /// Spins until a message arrives, polling one completion at a time (`ib_send_lat`-style);
    /// fails after `LINK_TIMEOUT` without a completion, or when `stop` is set.
    fn next_msg(
        &mut self,
        what: &'static str,
        stop: Option<&AtomicBool>,
    ) -> Result<Ctrl, TransportError> {
        let mut bytes = [0u8; 16];
        let mut patience = Patience::new();
        loop {
            if self.poll_one(&mut bytes)?.is_some() {
                return Ok(Ctrl { bytes });
            }
            if !self.comps.is_empty() {
                patience.progressed();
                continue;
            }
            patience.empty_poll(what, stop)?;
        }
    }
}

enum Event {
    Msg(Ctrl),
    ReadDone,
}

/// The server side of link measurements: answers pings and exposes buffers for READ streams,
/// one client at a time, on a thread of its own (busy-polling while a client is connected).
pub struct LinkServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    wake: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LinkServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, TransportError> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

impl LinkServer {
    /// Listens at `addr` (an RDMA device's IP; port 0 picks one) on a new thread.
    pub fn start(
        transport: &VerbsTransport,
        addr: SocketAddr,
    ) -> Result<LinkServer, TransportError> {
        let transport = transport.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let (wake_tx, mut wake_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("verbs-link-server".into())
            .spawn(move || {
                let rt = match runtime() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                    let listening = cm::listen(
                        match transport.cm.get(&transport.domains) {
                            Ok(c) => c,
                            Err(e) => {
                                let _ = ready_tx.send(Err(e));
                                return;
                            }
                        },
                        transport.domains.clone(),
                        addr,
                        transport.config.clone(),
                        cm::RecvMode::Own,
                        move |est| {
                            // A removed device ends the listener: the loop below then ends
                            // when the last connection setup in flight is done.
                            if let Ok(est) = est {
                                let _ = tx.send(est);
                            }
                        },
                    );
                    let listening = match listening {
                        Ok(l) => {
                            let _ = ready_tx.send(Ok(l.addr));
                            l
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    // The last client's connection, kept until the next one arrives.
                    let mut previous: Option<Link> = None;
                    loop {
                        let est = tokio::select! {
                            e = rx.recv() => e,
                            _ = &mut wake_rx => None,
                        };
                        let Some(est) = est else { break };
                        // A failing client ends its connection only.
                        drop(previous.take());
                        let mut link = Link::new(est);
                        let _ = serve(&mut link, &flag);
                        previous = Some(link);
                        if flag.load(Ordering::Relaxed) {
                            break;
                        }
                    }
                    listening.close();
                });
            })?;
        let addr = ready_rx
            .recv()
            .map_err(|_| VerbsError::Internal("the link server thread died".into()))??;
        Ok(LinkServer {
            addr,
            stop,
            wake: Some(wake_tx),
            thread: Some(thread),
        })
    }

    /// Where clients connect.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for LinkServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.wake.take() {
            let _ = w.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves one link client until it leaves (or fails, or the server stops).
fn serve(link: &mut Link, stop: &AtomicBool) -> Result<(), TransportError> {
    let mut exposed: Option<u32> = None;
    let mut next_id = 0u32;
    loop {
        let m = match link.next_msg("a message from the link client", Some(stop)) {
            Ok(m) => m,
            // A client that goes quiet (it finished, or died) ends its connection.
            Err(e) => {
                if let Some(id) = exposed.take() {
                    link.ep.stage_unexpose(id);
                }
                return Err(e);
            }
        };
        match m.bytes[0] {
            PING => link.send_ping()?,
            EXPOSE => {
                let len = u32::from_le_bytes(m.bytes[1..5].try_into().expect("4 bytes")) as usize;
                if len == 0 || len > MAX_STREAM {
                    return Err(VerbsError::Internal("link: bad EXPOSE length".into()).into());
                }
                if let Some(id) = exposed.take() {
                    link.ep.stage_unexpose(id);
                }
                let buf = link.pool.get_for(len).map_err(TransportError::from)?;
                let bytes = Bytes::from_owner(buf).slice(0..len);
                let held = link.pool.register(&bytes).map_err(TransportError::from)?;
                next_id = next_id.wrapping_add(1);
                let (addr, rkey) = link
                    .ep
                    .stage_expose(next_id, held)
                    .map_err(|e| link.device_err("ibv_alloc_mw / bind", e))?;
                exposed = Some(next_id);
                let mut reply = [0u8; 17];
                reply[0] = EXPOSE;
                reply[1..9].copy_from_slice(&addr.to_le_bytes());
                reply[9..13].copy_from_slice(&rkey.to_le_bytes());
                reply[13..17].copy_from_slice(&(len as u32).to_le_bytes());
                link.send_ctrl(&reply)?;
            }
            DONE => {
                if let Some(id) = exposed.take() {
                    link.ep.stage_unexpose(id);
                    link.ep
                        .ring()
                        .map_err(|e| link.device_err("ibv_post_send", e))?;
                }
                link.send_ctrl(&[DONE])?;
            }
            QUIT => {
                // The caller keeps the connection until the next one, so this answer is sent
                // before the queue pair goes.
                link.send_ctrl(&[QUIT])?;
                return Ok(());
            }
            _ => return Err(VerbsError::Internal("link: unknown message".into()).into()),
        }
    }
}

/// The client side of link measurements (blocking; spins on the CQ while it waits).
pub struct LinkClient {
    link: Link,
    /// Keeps the connection's rdma_cm plumbing running (events are not needed while spinning).
    _rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for LinkClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkClient").finish_non_exhaustive()
    }
}

impl Drop for LinkClient {
    fn drop(&mut self) {
        // Tell the server, so that it goes back to accepting at once (bounded by LINK_TIMEOUT).
        if self.link.send_ctrl(&[QUIT]).is_ok() {
            let _ = self
                .link
                .spin_until("the link server's goodbye", None, &mut |e| {
                    Ok(matches!(e, Event::Msg(ref m) if m.bytes[0] == QUIT))
                });
        }
    }
}

impl LinkClient {
    /// Connects to a [`LinkServer`] at `addr` (blocking).
    pub fn connect(
        transport: &VerbsTransport,
        addr: SocketAddr,
    ) -> Result<LinkClient, TransportError> {
        let rt = runtime()?;
        let est = rt.block_on(cm::connect(
            transport.cm.get(&transport.domains)?,
            transport.domains.clone(),
            transport.config.clone(),
            addr,
            cm::RecvMode::Own,
        ))?;
        Ok(LinkClient {
            link: Link::new(est),
            _rt: rt,
        })
    }

    /// `count` 2-byte SEND round trips after a warm-up, busy-polled on both sides
    /// (`ib_send_lat`); `each` gets every measured round trip.
    pub fn ping_pong(
        &mut self,
        count: u64,
        mut each: impl FnMut(Duration),
    ) -> Result<(), TransportError> {
        for i in 0..WARMUP + count {
            let t = Instant::now();
            self.link.send_ping()?;
            let m = self.link.next_msg("the link server's pong", None)?;
            if m.bytes[0] != PING {
                return Err(VerbsError::Internal("link: not a pong".into()).into());
            }
            if i >= WARMUP {
                each(t.elapsed());
            }
        }
        Ok(())
    }

    /// Has the server expose `size` bytes, then RDMA READs them `count` times with up to 32
    /// READs in flight (`ib_read_bw`), after a warm-up that has completed; returns the time
    /// from the first measured READ to its last completion.
    pub fn read_stream(&mut self, size: usize, count: u64) -> Result<Duration, TransportError> {
        let len = u32::try_from(size)
            .ok()
            .filter(|&l| l > 0 && (l as usize) <= MAX_STREAM)
            .ok_or_else(|| VerbsError::Config("link stream size must be within 1..=64 MiB"))?;
        let mut req = [0u8; 5];
        req[0] = EXPOSE;
        req[1..5].copy_from_slice(&len.to_le_bytes());
        self.link.send_ctrl(&req)?;
        let mut answer = None;
        self.link
            .spin_until("the link server's exposure", None, &mut |e| {
                if let Event::Msg(m) = e {
                    if m.bytes[0] == EXPOSE {
                        answer = Some(m.bytes);
                        return Ok(true);
                    }
                }
                Ok(false)
            })?;
        let a = answer.expect("set when done");
        let remote_addr = u64::from_le_bytes(a[1..9].try_into().expect("8 bytes"));
        let rkey = u32::from_le_bytes(a[9..13].try_into().expect("4 bytes"));
        let target = Arc::new(self.link.pool.get_for(size).map_err(TransportError::from)?);
        let in_flight_max = READS_IN_FLIGHT
            .min(self.link.ep.sq_room().saturating_sub(2))
            .max(1);
        // The warm-up runs to its last completion before the clock starts: a READ posted
        // before the clock (a software device may have done most of its transfer by then)
        // must not count in the measured time: counting from the warm-up's last completion
        // while more are in flight reads above `ib_read_bw`.
        self.reads(&target, size, remote_addr, rkey, WARMUP, in_flight_max)?;
        let start = Instant::now();
        self.reads(&target, size, remote_addr, rkey, count, in_flight_max)?;
        let elapsed = start.elapsed();
        self.link.send_ctrl(&[DONE])?;
        self.link
            .spin_until("the link server's end of stream", None, &mut |e| {
                Ok(matches!(e, Event::Msg(ref m) if m.bytes[0] == DONE))
            })?;
        Ok(elapsed)
    }

    /// Posts `n` RDMA READs of `size` bytes from the exposed region into `target`, keeping
    /// up to `in_flight_max` in flight, and returns once the last has completed.
    fn reads(
        &mut self,
        target: &Arc<PoolBuf>,
        size: usize,
        remote_addr: u64,
        rkey: u32,
        n: u64,
        in_flight_max: usize,
    ) -> Result<(), TransportError> {
        let mut posted = 0u64;
        let mut done = 0u64;
        let mut in_flight = 0usize;
        while done < n {
            while posted < n && in_flight < in_flight_max && self.link.ep.sq_room() > 1 {
                let spec = ReadSpec {
                    target: target.clone(),
                    offset: 0,
                    len: size,
                    remote_addr,
                    rkey,
                    tag: posted,
                };
                self.link
                    .ep
                    .stage_read(spec)
                    .map_err(|e| self.link.device_err("RDMA READ", e))?;
                posted += 1;
                in_flight += 1;
            }
            self.link
                .ep
                .ring()
                .map_err(|e| self.link.device_err("ibv_post_send", e))?;
            let mut finished = 0;
            self.link
                .spin_until("an RDMA READ completion", None, &mut |e| {
                    if matches!(e, Event::ReadDone) {
                        finished += 1;
                    }
                    Ok(finished > 0)
                })?;
            done += finished;
            in_flight -= finished as usize;
        }
        Ok(())
    }
}
