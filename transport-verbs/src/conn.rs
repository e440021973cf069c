//! One connection: a driver task that owns the queue pair, and the two halves that talk to it.
//!
//! The driver waits on the completion channel fd (tokio `AsyncFd`; or spins in busy-poll mode),
//! on rdma_cm events and on the sender's commands; on every wake it drains the CQ completely,
//! re-posts receive buffers, returns credits and posts whatever the credits allow, with one
//! doorbell per batch.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sideway::ibverbs::completion::CompletionChannel;
use sideway::rdmacm::communication_manager::{EventType, Identifier};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, Notify};
use transport_core::{
    BufferPool, Capabilities, Connection, HeaderBytes, Message, MessageReceiver, MessageSender,
    Metrics, TransportError,
};

use crate::cm::CmMsg;
use crate::ffi::{ChannelFd, Completion, Endpoint, HeldBytes, ReadSpec, SqLocal, WcError};
use crate::pool::{Pool, PoolBuf};
use crate::proto::{Kind, Th, TH_LEN, VERSION};
use crate::VerbsConfig;

/// Commands queued by the sender before the driver stops taking more.
const OUTQ_MAX: usize = 64;

pub(crate) struct Resources {
    pub(crate) ep: Endpoint,
    pub(crate) pool: Pool,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) device: String,
}

/// Posts the initial receive buffers (before the peer can send).
pub(crate) fn prepost(mut r: Resources, cfg: &VerbsConfig) -> Result<Resources, TransportError> {
    for _ in 0..cfg.recv_depth {
        let b = r.pool.get(cfg.recv_buf_size())?;
        r.ep.stage_recv(b);
    }
    let d = r.ep.ring()?;
    r.metrics.doorbells.add(d);
    Ok(r)
}

/// Destroys an identifier off the async threads (rdma_destroy_id may wait for the event pump).
pub(crate) fn drop_id_off_thread(id: Arc<Identifier>) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn_blocking(move || drop(id));
        }
        Err(_) => drop(id),
    }
}

/// Why a connection ended badly; kept so that every later call reports the same cause.
#[derive(Debug, Clone)]
enum Fail {
    PeerGone(String),
    Truncated { received: u64, expected: u64 },
    Backend(String),
}

impl Fail {
    fn to_error(&self) -> TransportError {
        match self {
            Fail::PeerGone(s) => {
                TransportError::Io(io::Error::new(io::ErrorKind::ConnectionReset, s.clone()))
            }
            Fail::Truncated { received, expected } => TransportError::Truncated {
                received: *received,
                expected: *expected,
            },
            Fail::Backend(s) => TransportError::Backend(s.clone()),
        }
    }
}

enum Delivery {
    Msg(Message),
    TooLarge {
        len: u64,
        max: u64,
        header: HeaderBytes,
    },
    End,
    Fail(Fail),
}

#[derive(Default)]
struct Shared {
    fail: Mutex<Option<Fail>>,
    /// Deliveries handed to the receiving half and not yet taken by the application.
    backlog: AtomicUsize,
    /// Set while the driver holds receive buffers back because the application is behind.
    deferring: AtomicBool,
    /// Woken by the receiving half when it takes a delivery while the driver is deferring.
    drained: Notify,
}

impl Shared {
    fn error(&self) -> Option<TransportError> {
        self.fail
            .lock()
            .ok()
            .and_then(|f| f.as_ref().map(Fail::to_error))
    }
}

enum Cmd {
    Msg(Message, Option<HeldBytes>),
    Close(oneshot::Sender<()>),
    InjectQpError,
}

enum Out {
    Msg(Message, Option<HeldBytes>),
    Fin(u32),
    Close,
}

enum In {
    Ready(Delivery),
    Reading {
        tag: u64,
        header: HeaderBytes,
        id: u32,
        len: usize,
        remaining: usize,
        received: u64,
        target: Arc<PoolBuf>,
    },
}

/// A received rendezvous payload: the pool buffer the READs landed in.
struct SharedBuf(Arc<PoolBuf>);

impl AsRef<[u8]> for SharedBuf {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

/// An established verbs connection (see the crate docs).
pub struct VerbsConnection {
    sender: VerbsSender,
    receiver: VerbsReceiver,
    caps: Capabilities,
    peer: String,
    device: String,
}

impl std::fmt::Debug for VerbsConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsConnection")
            .field("peer", &self.peer)
            .field("device", &self.device)
            .finish()
    }
}

impl VerbsConnection {
    /// The RDMA device this connection runs on.
    pub fn device(&self) -> &str {
        &self.device
    }
}

pub(crate) struct Conn;

impl Conn {
    pub(crate) fn start(
        r: Resources,
        id: Arc<Identifier>,
        cm_rx: mpsc::UnboundedReceiver<CmMsg>,
        cfg: Arc<VerbsConfig>,
        peer: String,
    ) -> Result<VerbsConnection, TransportError> {
        let Resources {
            ep,
            pool,
            metrics,
            device,
        } = r;
        let cq_fd = crate::ffi::watch(ep.channel_fd())?;
        let (cmd_tx, cmd_rx) = mpsc::channel(OUTQ_MAX);
        let (dtx, drx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::default());
        let caps = crate::capabilities(&cfg);
        let sender = VerbsSender {
            tx: cmd_tx,
            shared: shared.clone(),
            metrics: metrics.clone(),
            pool: pool.clone(),
            cfg: cfg.clone(),
            closed: false,
        };
        let receiver = VerbsReceiver {
            rx: drx,
            done: None,
            metrics: metrics.clone(),
            shared: shared.clone(),
        };
        let owed = cfg.recv_depth as u32 - 1;
        let driver = Driver {
            cq_fd: Some(cq_fd),
            ep: Some(ep),
            pool,
            metrics,
            cfg,
            id: Some(id),
            cm_rx,
            cmd_rx,
            cmd_open: true,
            deliver: Some(dtx),
            shared,
            credits: 1,
            owed,
            peer_buf: 0,
            hello_sent: false,
            outq: VecDeque::new(),
            reads: VecDeque::new(),
            reads_in_flight: 0,
            deferred: Vec::new(),
            inbound: VecDeque::new(),
            next_tag: 0,
            rndv_out: HashMap::new(),
            next_rndv: 0,
            close_acks: Vec::new(),
            close_sent: false,
            peer_closed: false,
            peer_disconnected: false,
            failed: None,
            completions: Vec::new(),
            stalled: false,
        };
        tokio::spawn(driver.run());
        Ok(VerbsConnection {
            sender,
            receiver,
            caps,
            peer,
            device,
        })
    }
}

struct Driver {
    // Dropped before the endpoint (it watches the endpoint's channel fd).
    cq_fd: Option<AsyncFd<ChannelFd<CompletionChannel>>>,
    ep: Option<Endpoint>,
    pool: Pool,
    metrics: Arc<Metrics>,
    cfg: Arc<VerbsConfig>,
    id: Option<Arc<Identifier>>,
    cm_rx: mpsc::UnboundedReceiver<CmMsg>,
    cmd_rx: mpsc::Receiver<Cmd>,
    cmd_open: bool,
    deliver: Option<mpsc::UnboundedSender<Delivery>>,
    shared: Arc<Shared>,
    /// Receive buffers the peer has granted us (each SEND consumes one).
    credits: u32,
    /// Receive buffers we re-posted but have not yet granted to the peer.
    owed: u32,
    /// The peer's receive buffer size (from its HELLO); 0 until then.
    peer_buf: usize,
    hello_sent: bool,
    outq: VecDeque<Out>,
    reads: VecDeque<ReadSpec>,
    /// RDMA READs posted and not yet completed (at most `rendezvous_window`).
    reads_in_flight: usize,
    /// Receive buffers held back (not re-posted, no credit returned) while the application is
    /// behind: the peer then runs out of credits and waits, instead of memory growing here.
    deferred: Vec<PoolBuf>,
    inbound: VecDeque<In>,
    next_tag: u64,
    /// Our payloads the peer may be reading (until its FIN).
    rndv_out: HashMap<u32, HeldBytes>,
    next_rndv: u32,
    close_acks: Vec<oneshot::Sender<()>>,
    close_sent: bool,
    peer_closed: bool,
    peer_disconnected: bool,
    failed: Option<Fail>,
    completions: Vec<Completion>,
    stalled: bool,
}

enum Wake {
    Cq,
    Cm(Option<CmMsg>),
    Cmd(Option<Cmd>),
    Spin,
    Linger,
    Drained,
}

impl Driver {
    fn ep(&mut self) -> &mut Endpoint {
        self.ep.as_mut().expect("endpoint lives until teardown")
    }

    async fn run(mut self) {
        let mut linger: Option<tokio::time::Instant> = None;
        loop {
            if self.failed.is_none() {
                match self.progress() {
                    // Work still moving (e.g. the peer still reading a rendezvous payload and
                    // sending FINs): the linger period counts from the last progress, as a
                    // closed TCP socket keeps delivering queued data in the background.
                    Ok(n) if n > 0 => linger = None,
                    Ok(_) => {}
                    Err(f) => self.fail(f),
                }
            }
            if self.failed.is_some() || self.peer_disconnected {
                break;
            }
            let halves_gone = !self.cmd_open && self.deliver.as_ref().is_none_or(|d| d.is_closed());
            if halves_gone {
                let idle = self.outq.is_empty()
                    && self.reads.is_empty()
                    && self.rndv_out.is_empty()
                    && self.ep.as_ref().is_none_or(|e| e.outstanding() == 0);
                if idle && self.close_sent {
                    break;
                }
                let deadline =
                    *linger.get_or_insert_with(|| tokio::time::Instant::now() + self.cfg.linger);
                if tokio::time::Instant::now() >= deadline {
                    break;
                }
            }
            let busy = self.cfg.busy_poll;
            if !busy {
                match self.ep().arm() {
                    Ok(()) => {}
                    Err(e) => {
                        self.fail(Fail::Backend(format!("ibv_req_notify_cq: {e}")));
                        break;
                    }
                }
                // A completion that raced the arming is processed now, not at the next event.
                match self.poll_round() {
                    Ok(0) => {}
                    Ok(_) => continue,
                    Err(f) => {
                        self.fail(f);
                        break;
                    }
                }
            }
            if !self.deferred.is_empty() && !self.behind() {
                self.undefer();
                continue;
            }
            let take_cmds = self.cmd_open && self.outq.len() < OUTQ_MAX;
            let deferring = !self.deferred.is_empty();
            let shared = self.shared.clone();
            let cq_fd = self.cq_fd.as_ref().expect("fd lives until teardown");
            let wake = tokio::select! {
                biased;
                r = cq_fd.readable(), if !busy => {
                    if let Ok(mut g) = r { g.clear_ready(); }
                    Wake::Cq
                }
                m = self.cm_rx.recv() => Wake::Cm(m),
                c = self.cmd_rx.recv(), if take_cmds => Wake::Cmd(c),
                _ = tokio::task::yield_now(), if busy => Wake::Spin,
                _ = tokio::time::sleep(Duration::from_millis(50)), if linger.is_some() => Wake::Linger,
                _ = shared.drained.notified(), if deferring => Wake::Drained,
            };
            match wake {
                Wake::Cq => {
                    if let Err(e) = self.ep().take_events() {
                        self.fail(Fail::Backend(format!("ibv_get_cq_event: {e}")));
                    }
                }
                Wake::Cm(Some(m)) => self.on_cm(m),
                Wake::Cm(None) => {}
                Wake::Cmd(Some(c)) => {
                    self.on_cmd(c);
                    // Take whatever else is queued: one doorbell for the whole batch.
                    while self.outq.len() < OUTQ_MAX {
                        match self.cmd_rx.try_recv() {
                            Ok(c) => self.on_cmd(c),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => {
                                self.sender_gone();
                                break;
                            }
                        }
                    }
                }
                Wake::Cmd(None) => self.sender_gone(),
                Wake::Spin | Wake::Linger | Wake::Drained => {}
            }
        }
        self.teardown();
    }

    /// The sending half is gone: a dropped sender closes the sending direction.
    fn sender_gone(&mut self) {
        self.cmd_open = false;
        if !self.close_sent && !self.outq.iter().any(|o| matches!(o, Out::Close)) {
            self.outq.push_back(Out::Close);
        }
    }

    fn on_cmd(&mut self, c: Cmd) {
        match c {
            Cmd::Msg(m, held) => self.outq.push_back(Out::Msg(m, held)),
            Cmd::Close(ack) => {
                if self.close_sent {
                    let _ = ack.send(());
                } else {
                    if !self.outq.iter().any(|o| matches!(o, Out::Close)) {
                        self.outq.push_back(Out::Close);
                    }
                    self.close_acks.push(ack);
                }
            }
            Cmd::InjectQpError => {
                // Test hook: the flushed work requests surface as errors, like a real fault.
                if let Err(e) = self.ep().set_error() {
                    self.fail(Fail::Backend(format!(
                        "forcing the QP to error failed: {e}"
                    )));
                }
            }
        }
    }

    fn on_cm(&mut self, m: CmMsg) {
        match m.kind {
            Some(EventType::Disconnected)
            | Some(EventType::DeviceRemoval)
            | Some(EventType::TimewaitExit)
            | None => {
                // Whatever the peer sent before leaving is in the CQ: take it first.
                if self.failed.is_none() {
                    if let Err(f) = self.progress() {
                        self.fail(f);
                        return;
                    }
                }
                let reading = self.inbound.iter().find_map(|i| match i {
                    In::Reading { len, received, .. } => Some((*received, *len as u64)),
                    In::Ready(_) => None,
                });
                if let Some((received, expected)) = reading {
                    self.fail(Fail::Truncated { received, expected });
                } else if !self.peer_closed {
                    self.fail(Fail::PeerGone(format!(
                        "RDMA peer disconnected ({:?}) without closing the connection",
                        m.kind
                    )));
                } else {
                    // Clean: the receiver saw the end; later sends fail.
                    if let Ok(mut f) = self.shared.fail.lock() {
                        f.get_or_insert(Fail::PeerGone("RDMA peer closed the connection".into()));
                    }
                    self.peer_disconnected = true;
                }
            }
            _ => {}
        }
    }

    /// Drains the CQ and posts what can be posted, until nothing changes.
    /// Returns the completions seen.
    fn progress(&mut self) -> Result<usize, Fail> {
        let mut total = 0;
        loop {
            let n = self.poll_round()?;
            if n == 0 {
                return Ok(total);
            }
            total += n;
        }
    }

    /// One poll of the CQ (up to a batch) plus the resulting posts. Returns completions seen.
    fn poll_round(&mut self) -> Result<usize, Fail> {
        let mut comps = std::mem::take(&mut self.completions);
        let n = self
            .ep()
            .poll(&mut comps)
            .map_err(|e| Fail::Backend(format!("ibv_poll_cq: {e}")))?;
        self.metrics.completions.add(n as u64);
        let mut result = Ok(());
        for c in comps.drain(..) {
            if result.is_ok() {
                result = self.on_completion(c);
            }
        }
        self.completions = comps;
        result?;
        self.deliver_ready();
        self.pump_out()?;
        Ok(n)
    }

    fn on_completion(&mut self, c: Completion) -> Result<(), Fail> {
        match c {
            Completion::Recv { buf, len, status } => {
                if let Err(e) = status {
                    return Err(self.wc_fail("receive", e));
                }
                self.on_recv(buf, len)
            }
            Completion::Read {
                target,
                tag,
                len,
                status,
            } => {
                self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
                if let Err(e) = status {
                    let (received, expected) = self
                        .inbound
                        .iter()
                        .find_map(|i| match i {
                            In::Reading {
                                tag: t,
                                received,
                                len,
                                ..
                            } if *t == tag => Some((*received, *len as u64)),
                            _ => None,
                        })
                        .unwrap_or((0, len as u64));
                    if e.is_flush() {
                        return Err(Fail::Truncated { received, expected });
                    }
                    return Err(Fail::Backend(format!(
                        "RDMA READ of a rendezvous payload failed after {received} of {expected} bytes: {e}"
                    )));
                }
                drop(target);
                self.metrics.bytes_received.add(len as u64);
                let mut fin = None;
                for slot in self.inbound.iter_mut() {
                    if let In::Reading {
                        tag: t,
                        header,
                        id,
                        len: total,
                        remaining,
                        received,
                        target,
                    } = slot
                    {
                        if *t != tag {
                            continue;
                        }
                        *remaining -= 1;
                        *received += len as u64;
                        if *remaining == 0 {
                            let payload =
                                Bytes::from_owner(SharedBuf(target.clone())).slice(0..*total);
                            fin = Some(*id);
                            *slot = In::Ready(Delivery::Msg(Message::new(*header, payload)));
                        }
                        break;
                    }
                }
                if let Some(id) = fin {
                    self.outq.push_front(Out::Fin(id));
                }
                Ok(())
            }
            Completion::Sent { status } => match status {
                Ok(()) => Ok(()),
                Err(e) => Err(self.wc_fail("send", e)),
            },
        }
    }

    fn wc_fail(&self, what: &str, e: WcError) -> Fail {
        if e.is_flush() && self.peer_closed {
            Fail::PeerGone("RDMA peer closed the connection".into())
        } else {
            Fail::Backend(format!(
                "the queue pair entered the error state ({what} completion: {e})"
            ))
        }
    }

    fn on_recv(&mut self, buf: PoolBuf, len: usize) -> Result<(), Fail> {
        let (th, header, off) = Th::decode(&buf.as_slice()[..len.min(buf.len())])
            .map_err(|e| Fail::Backend(format!("malformed verbs message: {e}")))?;
        self.credits += th.credits as u32;
        self.metrics.bytes_received.add(off as u64);
        let max = self.cfg.max_message_size as u64;
        match th.kind {
            Kind::Hello => {
                if th.addr != VERSION {
                    return Err(Fail::Backend(format!(
                        "verbs protocol version {} from the peer, this side speaks {VERSION}",
                        th.addr
                    )));
                }
                self.peer_buf = th.len as usize;
            }
            Kind::Eager => {
                if self.peer_closed {
                    return Err(Fail::Backend("verbs message after the peer's close".into()));
                }
                let plen = th.len as usize;
                self.metrics.bytes_received.add(plen as u64);
                let total = header.len() as u64 + plen as u64;
                if total > max {
                    self.inbound.push_back(In::Ready(Delivery::TooLarge {
                        len: total,
                        max,
                        header,
                    }));
                } else if plen >= self.cfg.zero_copy_recv_min {
                    // Hand the buffer itself to the user; post a fresh one in its place.
                    let fresh = self
                        .pool
                        .get(self.cfg.recv_buf_size())
                        .map_err(|e| Fail::Backend(e.to_string()))?;
                    let payload = Bytes::from_owner(buf).slice(off..off + plen);
                    self.inbound
                        .push_back(In::Ready(Delivery::Msg(Message::new(header, payload))));
                    self.repost(fresh);
                    return Ok(());
                } else {
                    let payload = Bytes::copy_from_slice(&buf.as_slice()[off..off + plen]);
                    self.metrics.payload_bytes_copied.add(plen as u64);
                    self.inbound
                        .push_back(In::Ready(Delivery::Msg(Message::new(header, payload))));
                }
            }
            Kind::Rts => {
                if self.peer_closed {
                    return Err(Fail::Backend("verbs message after the peer's close".into()));
                }
                let plen = th.len as usize;
                let total = header.len() as u64 + th.len;
                if total > max {
                    self.inbound.push_back(In::Ready(Delivery::TooLarge {
                        len: total,
                        max,
                        header,
                    }));
                    self.outq.push_front(Out::Fin(th.id));
                } else {
                    let target = Arc::new(
                        self.pool
                            .get_for(plen)
                            .map_err(|e| Fail::Backend(e.to_string()))?,
                    );
                    let tag = self.next_tag;
                    self.next_tag += 1;
                    let chunk = self.cfg.rendezvous_chunk.max(4096);
                    let mut chunks = 0;
                    let mut offset = 0;
                    while offset < plen {
                        let n = chunk.min(plen - offset);
                        self.reads.push_back(ReadSpec {
                            target: target.clone(),
                            offset,
                            len: n,
                            remote_addr: th.addr + offset as u64,
                            rkey: th.rkey,
                            tag,
                        });
                        chunks += 1;
                        offset += n;
                    }
                    self.inbound.push_back(In::Reading {
                        tag,
                        header,
                        id: th.id,
                        len: plen,
                        remaining: chunks,
                        received: 0,
                        target,
                    });
                }
            }
            Kind::Fin => {
                self.rndv_out.remove(&th.id);
            }
            Kind::Credit => {}
            Kind::Close => {
                self.peer_closed = true;
                self.inbound.push_back(In::Ready(Delivery::End));
            }
        }
        // Same buffer goes back to the receive queue.
        self.repost(buf);
        Ok(())
    }

    /// Deliveries the application may leave untaken before receive buffers are held back.
    fn backlog_max(&self) -> usize {
        4 * self.cfg.recv_depth
    }

    /// True when the application is behind and its receiver is still there.
    fn behind(&self) -> bool {
        self.deliver.as_ref().is_some_and(|d| !d.is_closed())
            && self.shared.backlog.load(Ordering::Acquire) >= self.backlog_max()
    }

    /// Re-posts a receive buffer and owes the peer its credit, or holds it back while the
    /// application is behind (see `deferred`).
    fn repost(&mut self, buf: PoolBuf) {
        if self.behind() {
            self.deferred.push(buf);
            self.shared.deferring.store(true, Ordering::Release);
        } else {
            self.owed += 1;
            self.ep().stage_recv(buf);
        }
    }

    /// Re-posts every held-back buffer (posted by the next `ring`).
    fn undefer(&mut self) {
        self.shared.deferring.store(false, Ordering::Release);
        for buf in std::mem::take(&mut self.deferred) {
            self.owed += 1;
            self.ep().stage_recv(buf);
        }
    }

    fn deliver_ready(&mut self) {
        while let Some(In::Ready(_)) = self.inbound.front() {
            let Some(In::Ready(d)) = self.inbound.pop_front() else {
                unreachable!()
            };
            if let Some(tx) = &self.deliver {
                if tx.send(d).is_err() {
                    self.deliver = None;
                } else {
                    self.shared.backlog.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
    }

    fn take_owed(&mut self) -> u16 {
        let n = self.owed.min(u16::MAX as u32);
        self.owed -= n;
        n as u16
    }

    /// Posts what credits and send-queue room allow; one doorbell for all of it.
    fn pump_out(&mut self) -> Result<(), Fail> {
        let mut posted_any = false;
        loop {
            if self.ep().sq_room() == 0 {
                break;
            }
            // A window of READs: sends queued behind them (FIN, replies) are not held up for
            // the whole of a large transfer (the send queue is FIFO).
            if self.reads_in_flight < self.cfg.rendezvous_window.max(1) {
                if let Some(r) = self.reads.pop_front() {
                    self.ep().stage_read(r);
                    self.reads_in_flight += 1;
                    posted_any = true;
                    continue;
                }
            }
            if !self.hello_sent {
                if self.credits < 1 {
                    break;
                }
                let mut th = Th::new(Kind::Hello);
                th.credits = self.take_owed();
                th.len = self.cfg.recv_buf_size() as u64;
                th.addr = VERSION;
                self.stage_ctrl(th);
                self.hello_sent = true;
                posted_any = true;
                continue;
            }
            if self.peer_buf == 0 {
                break;
            }
            let need = match self.outq.front() {
                None => break,
                Some(Out::Close) => 1,
                Some(_) => 2,
            };
            if self.credits < need {
                if !self.stalled {
                    self.metrics.credit_stalls.incr();
                    self.stalled = true;
                }
                break;
            }
            self.stalled = false;
            let out = self.outq.pop_front().expect("front exists");
            self.stage_out(out)?;
            posted_any = true;
        }
        // Grant credits on their own when enough are owed and nothing carried them.
        // At least 2: a CREDIT costs the peer one buffer, which must not trigger a CREDIT back.
        let threshold = (self.cfg.recv_depth as u32 / 4).max(2);
        if self.owed >= threshold && self.credits >= 1 && self.ep().sq_room() > 0 && self.hello_sent
        {
            let mut th = Th::new(Kind::Credit);
            th.credits = self.take_owed();
            self.stage_ctrl(th);
            posted_any = true;
        }
        let d = self
            .ep()
            .ring()
            .map_err(|e| Fail::Backend(format!("posting work requests failed: {e}")))?;
        self.metrics.doorbells.add(d);
        let _ = posted_any;
        Ok(())
    }

    fn stage_ctrl(&mut self, th: Th) {
        let ep = self.ep.as_mut().expect("endpoint");
        let n = th.encode(&HeaderBytes::EMPTY, ep.next_ctrl_slot());
        ep.stage_send(SqLocal::Ctrl { len: n }, false);
        self.credits -= 1;
        self.metrics.bytes_sent.add(n as u64);
    }

    fn stage_out(&mut self, out: Out) -> Result<(), Fail> {
        match out {
            Out::Fin(id) => {
                let mut th = Th::new(Kind::Fin);
                th.id = id;
                th.credits = self.take_owed();
                self.stage_ctrl(th);
            }
            Out::Close => {
                let mut th = Th::new(Kind::Close);
                th.credits = self.take_owed();
                self.stage_ctrl(th);
                self.close_sent = true;
                for a in self.close_acks.drain(..) {
                    let _ = a.send(());
                }
            }
            Out::Msg(m, held) => {
                let plen = m.payload.len();
                let hl = m.header.len();
                let credits = self.take_owed();
                let inline_max = self.ep().inline_max();
                if TH_LEN + hl + plen <= self.peer_buf {
                    let mut th = Th::new(Kind::Eager);
                    th.credits = credits;
                    th.len = plen as u64;
                    if TH_LEN + hl + plen <= inline_max {
                        let ep = self.ep.as_mut().expect("endpoint");
                        let n = th.encode(&m.header, ep.next_ctrl_slot());
                        ep.stage_send(
                            SqLocal::Inline {
                                len: n,
                                payload: m.payload,
                            },
                            false,
                        );
                        self.metrics.payload_bytes_copied.add(plen as u64);
                    } else if let Some(h) = held.or_else(|| self.pool.lookup(&m.payload)) {
                        let ep = self.ep.as_mut().expect("endpoint");
                        let n = th.encode(&m.header, ep.next_ctrl_slot());
                        ep.stage_send(SqLocal::CtrlPayload { len: n, payload: h }, false);
                    } else {
                        let mut buf = self
                            .pool
                            .get_for(TH_LEN + hl + plen)
                            .map_err(|e| Fail::Backend(e.to_string()))?;
                        let n = th.encode(&m.header, buf.as_mut_slice());
                        buf.as_mut_slice()[n..n + plen].copy_from_slice(&m.payload);
                        self.metrics.payload_bytes_copied.add(plen as u64);
                        self.ep()
                            .stage_send(SqLocal::Buf { buf, len: n + plen }, false);
                    }
                    self.credits -= 1;
                    self.metrics.bytes_sent.add((TH_LEN + hl + plen) as u64);
                } else {
                    let h = match held {
                        Some(h) => h,
                        None => self
                            .pool
                            .register(&m.payload)
                            .map_err(|e| Fail::Backend(e.to_string()))?,
                    };
                    let id = self.next_rndv;
                    self.next_rndv = self.next_rndv.wrapping_add(1);
                    let mut th = Th::new(Kind::Rts);
                    th.credits = credits;
                    th.id = id;
                    th.len = plen as u64;
                    th.addr = h.bytes.as_ptr() as u64;
                    th.rkey = h.rkey;
                    self.rndv_out.insert(id, h);
                    let ep = self.ep.as_mut().expect("endpoint");
                    let n = th.encode(&m.header, ep.next_ctrl_slot());
                    ep.stage_send(SqLocal::Ctrl { len: n }, false);
                    self.credits -= 1;
                    self.metrics.bytes_sent.add((n + plen) as u64);
                }
            }
        }
        Ok(())
    }

    fn fail(&mut self, f: Fail) {
        if self.failed.is_some() {
            return;
        }
        self.failed = Some(f.clone());
        if let Ok(mut s) = self.shared.fail.lock() {
            *s = Some(f.clone());
        }
        // Messages received whole before the failure are still delivered, then the failure.
        let mut ready = Vec::new();
        while let Some(In::Ready(_)) = self.inbound.front() {
            if let Some(In::Ready(d)) = self.inbound.pop_front() {
                ready.push(d);
            }
        }
        if let Some(tx) = self.deliver.take() {
            for d in ready {
                let _ = tx.send(d);
            }
            let _ = tx.send(Delivery::Fail(f));
        }
        self.close_acks.clear();
        if let Some(ep) = self.ep.as_mut() {
            let _ = ep.set_error();
        }
    }

    fn teardown(mut self) {
        if self.failed.is_none() && !self.peer_disconnected {
            // Clean end: the receiver gets whatever is left, then the end of the stream.
            self.deliver_ready();
        }
        if let Ok(mut s) = self.shared.fail.lock() {
            s.get_or_insert(Fail::PeerGone("the verbs connection is closed".into()));
        }
        if let Some(tx) = self.deliver.take() {
            if self.failed.is_none() {
                let _ = tx.send(Delivery::End);
            }
        }
        drop(self.cq_fd.take());
        let ep = self.ep.take();
        let id = self.id.take();
        let rndv = std::mem::take(&mut self.rndv_out);
        let reads = std::mem::take(&mut self.reads);
        let inbound = std::mem::take(&mut self.inbound);
        let work = move || {
            if let Some(id) = &id {
                let _ = id.disconnect();
            }
            // The QP goes first (no more DMA), then the memory it could have touched.
            drop(ep);
            drop(reads);
            drop(inbound);
            drop(rndv);
            drop(id);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(work);
            }
            Err(_) => work(),
        }
    }
}

/// The sending half of a verbs connection.
pub struct VerbsSender {
    tx: mpsc::Sender<Cmd>,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    pool: Pool,
    cfg: Arc<VerbsConfig>,
    closed: bool,
}

impl std::fmt::Debug for VerbsSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsSender").finish_non_exhaustive()
    }
}

impl VerbsSender {
    fn gone(&self) -> TransportError {
        self.shared.error().unwrap_or(TransportError::Closed)
    }

    /// Test hook: moves the queue pair to the error state, as a device fault would. Every
    /// pending and later operation fails with a typed error.
    #[doc(hidden)]
    pub async fn inject_qp_error(&mut self) {
        let _ = self.tx.send(Cmd::InjectQpError).await;
    }
}

impl MessageSender for VerbsSender {
    async fn send(&mut self, msg: Message) -> Result<(), TransportError> {
        let len = msg.len();
        if len > self.cfg.max_message_size {
            return Err(TransportError::MessageTooLarge {
                len: len as u64,
                max: self.cfg.max_message_size as u64,
                header: HeaderBytes::EMPTY,
            });
        }
        if self.closed {
            return Err(TransportError::Closed);
        }
        if let Some(e) = self.shared.error() {
            return Err(e);
        }
        // Payloads above the eager limit go by rendezvous: register (or find) them here, so
        // a registration failure is this call's error.
        let held = if msg.payload.len() > self.cfg.eager_limit {
            Some(self.pool.register(&msg.payload)?)
        } else {
            None
        };
        self.tx
            .send(Cmd::Msg(msg, held))
            .await
            .map_err(|_| self.gone())?;
        self.metrics.messages_sent.incr();
        Ok(())
    }

    fn buffer_pool(&self) -> Arc<dyn BufferPool> {
        self.pool.buffer_pool()
    }

    fn max_message_size(&self) -> usize {
        self.cfg.max_message_size
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Close(tx))
            .await
            .map_err(|_| self.gone())?;
        rx.await.map_err(|_| self.gone())
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

/// The receiving half of a verbs connection.
pub struct VerbsReceiver {
    rx: mpsc::UnboundedReceiver<Delivery>,
    done: Option<Option<Fail>>,
    metrics: Arc<Metrics>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for VerbsReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsReceiver").finish_non_exhaustive()
    }
}

impl MessageReceiver for VerbsReceiver {
    async fn recv(&mut self) -> Result<Option<Message>, TransportError> {
        match &self.done {
            Some(None) => return Ok(None),
            Some(Some(f)) => return Err(f.to_error()),
            None => {}
        }
        let d = self.rx.recv().await;
        if d.is_some() {
            let _ = self
                .shared
                .backlog
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                    Some(v.saturating_sub(1))
                });
            if self.shared.deferring.load(Ordering::Acquire) {
                self.shared.drained.notify_one();
            }
        }
        match d {
            Some(Delivery::Msg(m)) => {
                self.metrics.messages_received.incr();
                Ok(Some(m))
            }
            Some(Delivery::TooLarge { len, max, header }) => {
                Err(TransportError::MessageTooLarge { len, max, header })
            }
            Some(Delivery::End) => {
                self.done = Some(None);
                Ok(None)
            }
            Some(Delivery::Fail(f)) => {
                let e = f.to_error();
                self.done = Some(Some(f));
                Err(e)
            }
            None => {
                let f = Fail::PeerGone("the verbs connection ended".into());
                self.done = Some(Some(f.clone()));
                Err(f.to_error())
            }
        }
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

impl Connection for VerbsConnection {
    type Sender = VerbsSender;
    type Receiver = VerbsReceiver;

    fn capabilities(&self) -> Capabilities {
        self.caps.clone()
    }

    fn metrics(&self) -> Arc<Metrics> {
        self.sender.metrics.clone()
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }

    fn split(self) -> (VerbsSender, VerbsReceiver) {
        (self.sender, self.receiver)
    }
}
