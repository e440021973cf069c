//! One connection: a driver task that owns the queue pair and the protocol engine, and the two
//! halves that talk to it.
//!
//! The engine (`engine.rs`) decides everything; the driver only moves between it and the
//! device. It waits on the completion channel fd (tokio `AsyncFd`; or spins in busy-poll mode),
//! on rdma_cm events, on the sender's commands and on the engine's next deadline. On every wake
//! it drains the CQ completely, feeds each completion to the engine, posts the work the engine
//! asks for (one doorbell per batch) and hands the engine's deliveries to the receiving half.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use sideway::ibverbs::completion::CompletionChannel;
use sideway::rdmacm::communication_manager::{EventType, Identifier};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, Notify};
use transport_core::{
    BackendError, BufferPool, Capabilities, Connection, HeaderBytes, Message, MessageReceiver,
    MessageSender, Metrics, TransportError,
};

use crate::cm::{CmMsg, Established};
use crate::config::VerbsConfig;
use crate::engine::{self, Engine, OutMsg, RecvBuf, Work, MAX_WRS_PER_WORK};
use crate::error::{VerbsError, WorkRequestKind};
use crate::ffi::{ChannelFd, Completion, Endpoint, HeldBytes, ReadSpec, SqLocal, WcFailure};
use crate::pool::{Pool, PoolBuf};
use crate::proto::TH_LEN;

/// Messages queued in the engine before the driver stops taking more from the sender.
const OUTQ_MAX: usize = 64;

/// Where the driver's timer is parked while the engine has no deadline: far enough that it
/// never fires (a year; a deadline that appears moves it back).
const IDLE_TIMER: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);

/// Why a connection ended badly; kept so that every later call reports the same cause.
#[derive(Debug, Clone)]
enum Fail {
    PeerGone(&'static str),
    Truncated { received: u64, expected: u64 },
    Verbs(Arc<VerbsError>),
}

impl Fail {
    fn verbs(e: VerbsError) -> Fail {
        Fail::Verbs(Arc::new(e))
    }

    fn to_error(&self) -> TransportError {
        match self {
            Fail::PeerGone(s) => {
                TransportError::Io(io::Error::new(io::ErrorKind::ConnectionReset, *s))
            }
            Fail::Truncated { received, expected } => TransportError::Truncated {
                received: *received,
                expected: *expected,
            },
            Fail::Verbs(e) => TransportError::Backend(BackendError::from_arc(e.clone())),
        }
    }
}

fn wc(kind: WorkRequestKind, e: WcFailure) -> Fail {
    Fail::verbs(e.into_error(kind))
}

fn device_fail(op: &'static str, device: &str, e: io::Error) -> Fail {
    Fail::verbs(VerbsError::verbs(op, device, e))
}

/// What the receiving half gets.
enum ToApp {
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
    /// Deliveries handed to the receiving half and not yet taken by the application, and
    /// their payload bytes.
    backlog: AtomicUsize,
    backlog_bytes: AtomicU64,
    /// Set while the engine waits for the application to take deliveries.
    watching: AtomicBool,
    /// Woken by the receiving half when it takes a delivery while `watching`.
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
    #[cfg(feature = "test-hooks")]
    InjectQpError,
}

/// The payload of an outgoing message: its bytes and, when known, their registration.
struct OutPayload {
    bytes: Bytes,
    held: Option<HeldBytes>,
}

/// A received message in its receive buffer.
struct Received {
    buf: PoolBuf,
    len: usize,
}

impl RecvBuf for Received {
    fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[..self.len]
    }

    fn into_payload(self, range: Range<usize>) -> Bytes {
        Bytes::from_owner(self.buf).slice(range)
    }
}

/// A received rendezvous payload still shared with the READs that filled it.
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

/// Starts the driver of an established connection.
pub(crate) fn start(
    est: Established,
    cfg: Arc<VerbsConfig>,
) -> Result<VerbsConnection, TransportError> {
    let Established {
        res,
        id,
        events,
        peer,
    } = est;
    let cq_fd = crate::ffi::watch(res.ep.channel_fd())?;
    let (cmd_tx, cmd_rx) = mpsc::channel(OUTQ_MAX);
    let (dtx, drx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::default());
    let caps = cfg.capabilities();
    let sender = VerbsSender {
        tx: cmd_tx,
        shared: shared.clone(),
        metrics: res.metrics.clone(),
        pool: res.pool.clone(),
        cfg: cfg.clone(),
        closed: false,
    };
    let receiver = VerbsReceiver {
        rx: drx,
        done: None,
        metrics: res.metrics.clone(),
        shared: shared.clone(),
    };
    let engine = Engine::new(cfg.engine_config(), res.metrics.clone(), Instant::now());
    let driver = Driver {
        cq_fd: Some(cq_fd),
        ep: Some(res.ep),
        engine,
        targets: HashMap::new(),
        pool: res.pool,
        metrics: res.metrics,
        cfg,
        device: res.device.clone(),
        id: Some(id),
        cm_rx: events,
        cmd_rx,
        cmd_open: true,
        deliver: Some(dtx),
        receiver_gone: false,
        shared,
        close_acks: Vec::new(),
        failed: None,
        peer_disconnected: false,
        completions: Vec::new(),
        timer: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
        timer_at: None,
        spin_until: None,
        member: Some(res.member),
    };
    tokio::spawn(driver.run());
    Ok(VerbsConnection {
        sender,
        receiver,
        caps,
        peer,
        device: res.device,
    })
}

struct Driver {
    // Dropped before the endpoint (it watches the endpoint's channel fd).
    cq_fd: Option<AsyncFd<ChannelFd<CompletionChannel>>>,
    ep: Option<Endpoint<PoolBuf>>,
    engine: Engine<OutPayload>,
    /// Targets of the incoming rendezvous transfers being read, by the engine's tag.
    targets: HashMap<u64, Arc<PoolBuf>>,
    pool: Pool,
    metrics: Arc<Metrics>,
    cfg: Arc<VerbsConfig>,
    device: String,
    id: Option<Arc<Identifier>>,
    cm_rx: mpsc::UnboundedReceiver<CmMsg>,
    cmd_rx: mpsc::Receiver<Cmd>,
    cmd_open: bool,
    deliver: Option<mpsc::UnboundedSender<ToApp>>,
    receiver_gone: bool,
    shared: Arc<Shared>,
    close_acks: Vec<oneshot::Sender<()>>,
    failed: Option<Fail>,
    peer_disconnected: bool,
    completions: Vec<Completion<PoolBuf>>,
    /// Sleeps until the engine's next deadline (`timer_at`).
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    timer_at: Option<Instant>,
    /// Adaptive polling: until then the driver polls the CQ instead of sleeping on the
    /// completion channel (`VerbsConfig::poll_spin` after the last activity).
    spin_until: Option<Instant>,
    /// Counts this connection and its memory in its domain until teardown.
    member: Option<crate::domain::Member>,
}

enum Wake {
    Cq,
    Cm(Option<CmMsg>),
    Cmd(Option<Cmd>),
    Other,
}

impl Driver {
    fn ep(&mut self) -> &mut Endpoint<PoolBuf> {
        self.ep.as_mut().expect("endpoint lives until teardown")
    }

    async fn run(mut self) {
        loop {
            if self.failed.is_none() {
                match self.progress() {
                    Ok(0) => {}
                    Ok(_) => self.active(),
                    Err(f) => self.fail(f),
                }
            }
            if self.failed.is_some() || self.peer_disconnected {
                break;
            }
            if !self.receiver_gone && self.deliver.as_ref().is_none_or(|d| d.is_closed()) {
                self.receiver_gone = true;
                self.deliver = None;
                self.engine.receiver_gone();
                continue;
            }
            if !self.cmd_open && self.receiver_gone {
                // Both halves are gone: finish what is outstanding (the peer still reading a
                // payload of ours), then disconnect; give up after `linger` without progress.
                self.engine.local_gone(Instant::now());
                let idle =
                    self.engine.is_idle() && self.ep.as_ref().is_none_or(|e| e.outstanding() == 0);
                if idle || self.engine.linger_expired() {
                    break;
                }
            }
            let busy = self.cfg.busy_poll || self.spinning();
            if !busy {
                // rxe (and most providers) arm through the kernel: one system call.
                self.metrics.syscalls.incr();
                if let Err(e) = self.ep().arm() {
                    let f = device_fail("ibv_req_notify_cq", &self.device, e);
                    self.fail(f);
                    break;
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
            let take_cmds = self.cmd_open && self.engine.queued() < OUTQ_MAX;
            // One timer, moved only when the engine's deadline moves (not one per wake).
            let deadline = self.engine.poll_timeout();
            if deadline != self.timer_at {
                let at = match deadline {
                    Some(d) => tokio::time::Instant::from_std(d),
                    // Nothing to wait for. The timer is not polled then, but an entry left at
                    // its old deadline (the hello deadline of a connection set up long ago)
                    // would still fire and wake this task once: with many idle connections
                    // that was most of their wake-ups. Move it out of the way instead.
                    None => tokio::time::Instant::now() + IDLE_TIMER,
                };
                self.timer.as_mut().reset(at);
                self.timer_at = deadline;
            }
            let watch_app = self.engine.waiting_for_app();
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
                _ = tokio::task::yield_now(), if busy => Wake::Other,
                _ = self.timer.as_mut(), if deadline.is_some() => Wake::Other,
                _ = shared.drained.notified(), if watch_app => Wake::Other,
            };
            if !matches!(wake, Wake::Other) {
                self.active();
            }
            match wake {
                Wake::Cq => match self.ep().take_events() {
                    // One read(2) per event plus the one that finds the channel empty.
                    Ok(n) => self.metrics.syscalls.add(u64::from(n) + 1),
                    Err(e) => {
                        let f = device_fail("ibv_get_cq_event", &self.device, e);
                        self.fail(f);
                    }
                },
                Wake::Cm(Some(m)) => self.on_cm(m),
                Wake::Cm(None) => {}
                Wake::Cmd(Some(c)) => {
                    self.on_cmd(c);
                    // Take whatever else is queued: one doorbell for the whole batch.
                    while self.engine.queued() < OUTQ_MAX {
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
                Wake::Other => {}
            }
        }
        self.teardown();
    }

    /// Something happened: keep polling the CQ for the spin budget before sleeping again.
    fn active(&mut self) {
        if !self.cfg.poll_spin.is_zero() {
            self.spin_until = Some(Instant::now() + self.cfg.poll_spin);
        }
    }

    /// Whether the spin budget after the last activity still runs (clears it once spent).
    fn spinning(&mut self) -> bool {
        match self.spin_until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                self.spin_until = None;
                false
            }
            None => false,
        }
    }

    /// The sending half is gone: a dropped sender closes the sending direction.
    fn sender_gone(&mut self) {
        self.cmd_open = false;
        self.engine.close();
    }

    fn on_cmd(&mut self, c: Cmd) {
        match c {
            Cmd::Msg(m, held) => self.engine.send(OutMsg {
                header: m.header,
                len: m.payload.len(),
                payload: OutPayload {
                    bytes: m.payload,
                    held,
                },
            }),
            Cmd::Close(ack) => {
                self.engine.close();
                if self.engine.close_sent() {
                    let _ = ack.send(());
                } else {
                    self.close_acks.push(ack);
                }
            }
            #[cfg(feature = "test-hooks")]
            Cmd::InjectQpError => {
                // Test hook: the flushed work requests surface as errors, like a real fault.
                if let Err(e) = self.ep().set_error() {
                    let f = device_fail("ibv_modify_qp (error state)", &self.device, e);
                    self.fail(f);
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
                if let Some((received, expected)) = self.engine.reading() {
                    self.fail(Fail::Truncated { received, expected });
                } else if !self.engine.peer_closed() {
                    self.fail(Fail::PeerGone(
                        "RDMA peer disconnected without closing the connection",
                    ));
                } else {
                    // Clean: the receiver saw the end; later sends fail.
                    if let Ok(mut f) = self.shared.fail.lock() {
                        f.get_or_insert(Fail::PeerGone("RDMA peer closed the connection"));
                    }
                    self.peer_disconnected = true;
                }
            }
            _ => {}
        }
    }

    /// Drains the CQ, then lets the engine act on time, the application's pace and queued
    /// messages. Returns the completions seen.
    fn progress(&mut self) -> Result<usize, Fail> {
        let mut total = 0;
        loop {
            let n = self.poll_round()?;
            if n == 0 {
                break;
            }
            total += n;
        }
        Ok(total)
    }

    /// One poll of the CQ (up to a batch), then one step of the engine. Returns completions seen.
    fn poll_round(&mut self) -> Result<usize, Fail> {
        let mut comps = std::mem::take(&mut self.completions);
        let n = match self.ep().poll(&mut comps) {
            Ok(n) => n,
            Err(e) => return Err(device_fail("ibv_poll_cq", &self.device, e)),
        };
        self.metrics.completions.add(n as u64);
        let mut result = Ok(());
        for c in comps.drain(..) {
            if result.is_ok() {
                result = self.on_completion(c);
            }
        }
        self.completions = comps;
        result?;
        self.step()?;
        Ok(n)
    }

    /// The engine acts: deadlines, the application's backlog, deliveries, work to post.
    fn step(&mut self) -> Result<(), Fail> {
        let backlog = self.shared.backlog.load(Ordering::Acquire);
        let bytes = self.shared.backlog_bytes.load(Ordering::Acquire);
        self.engine.set_backlog(backlog, bytes);
        if self.timer_at.is_some() && self.timer.is_elapsed() {
            self.engine
                .handle_timeout(Instant::now())
                .map_err(Fail::verbs)?;
        }
        self.deliver_ready();
        self.pump_out()?;
        // The clock is read only when this step armed a deadline (a FIN, the first RTS).
        if self.engine.needs_clock() {
            self.engine.clock(Instant::now());
        }
        if self.engine.close_sent() {
            for a in self.close_acks.drain(..) {
                let _ = a.send(());
            }
        }
        self.shared
            .watching
            .store(self.engine.waiting_for_app(), Ordering::Release);
        Ok(())
    }

    fn on_completion(&mut self, c: Completion<PoolBuf>) -> Result<(), Fail> {
        match c {
            Completion::Recv { buf, len, status } => {
                if let Err(e) = status {
                    return Err(self.wc_fail(WorkRequestKind::Receive, e));
                }
                let r = Received { buf, len };
                let buf = match self.engine.on_recv(r) {
                    Ok(Some(r)) => r.buf,
                    // Handed over to the application: a fresh buffer takes its place.
                    Ok(None) => self
                        .pool
                        .get_recv(self.cfg.recv_buf_size())
                        .map_err(Fail::verbs)?,
                    Err(e) => return Err(Fail::verbs(e)),
                };
                if self.ep().stage_recv(buf).is_err() {
                    return Err(Fail::verbs(VerbsError::Internal(
                        "receive table overrun".into(),
                    )));
                }
                Ok(())
            }
            Completion::Read { tag, len, status } => {
                if let Err(e) = status {
                    let (received, expected) = self.engine.reading().unwrap_or((0, len as u64));
                    if e.is_flush() {
                        return Err(Fail::Truncated { received, expected });
                    }
                    return Err(wc(WorkRequestKind::RdmaRead, e));
                }
                self.engine.on_read_done(tag, len);
                Ok(())
            }
            Completion::Sent { status, kind } => match status {
                Ok(()) => {
                    self.engine.on_activity();
                    Ok(())
                }
                Err(e) => Err(self.wc_fail(kind, e)),
            },
        }
    }

    fn wc_fail(&self, kind: WorkRequestKind, e: WcFailure) -> Fail {
        if e.is_flush() && self.engine.peer_closed() {
            Fail::PeerGone("RDMA peer closed the connection")
        } else {
            wc(kind, e)
        }
    }

    fn deliver_ready(&mut self) {
        while let Some(d) = self.engine.poll_delivery() {
            let item = match d {
                engine::Delivery::Msg(m) => ToApp::Msg(m),
                engine::Delivery::Rendezvous { tag, header, len } => {
                    let Some(target) = self.targets.remove(&tag) else {
                        continue; // cannot happen: the engine delivers only what was read
                    };
                    let payload = match Arc::try_unwrap(target) {
                        Ok(buf) => Bytes::from_owner(buf).slice(0..len),
                        Err(shared) => Bytes::from_owner(SharedBuf(shared)).slice(0..len),
                    };
                    ToApp::Msg(Message::new(header, payload))
                }
                engine::Delivery::TooLarge { len, max, header } => {
                    ToApp::TooLarge { len, max, header }
                }
                engine::Delivery::End => ToApp::End,
            };
            let bytes = match &item {
                ToApp::Msg(m) => m.payload.len() as u64,
                _ => 0,
            };
            if let Some(tx) = &self.deliver {
                // Counted before sending, so the receiver never takes one it was not counted.
                self.shared.backlog.fetch_add(1, Ordering::AcqRel);
                self.shared.backlog_bytes.fetch_add(bytes, Ordering::AcqRel);
                if tx.send(item).is_err() {
                    self.shared.backlog.fetch_sub(1, Ordering::AcqRel);
                    self.shared.backlog_bytes.fetch_sub(bytes, Ordering::AcqRel);
                    self.deliver = None;
                }
            }
        }
    }

    /// Posts what the engine asks for while the send queue has room; one doorbell for all.
    fn pump_out(&mut self) -> Result<(), Fail> {
        while self.ep().sq_room() >= MAX_WRS_PER_WORK {
            let Some(w) = self.engine.poll_work() else {
                break;
            };
            self.post(w)?;
        }
        let d = match self.ep().ring() {
            Ok(d) => d,
            Err(e) => return Err(device_fail("ibv_post_send", &self.device, e)),
        };
        self.metrics.doorbells.add(d);
        Ok(())
    }

    fn post(&mut self, w: Work<OutPayload>) -> Result<(), Fail> {
        match w {
            Work::Control(th) => {
                let ep = self.ep();
                let n = th.encode(&HeaderBytes::EMPTY, ep.next_ctrl_slot());
                ep.stage_send(SqLocal::Ctrl { len: n });
            }
            Work::Eager {
                th,
                header,
                payload,
            } => {
                let plen = payload.bytes.len();
                let inline_max = self.ep().inline_max();
                if TH_LEN + header.len() + plen <= inline_max {
                    let ep = self.ep();
                    let n = th.encode(&header, ep.next_ctrl_slot());
                    ep.stage_send(SqLocal::Inline {
                        len: n,
                        payload: payload.bytes,
                    });
                    self.metrics.payload_bytes_copied.add(plen as u64);
                } else if let Some(h) = payload.held.or_else(|| self.pool.lookup(&payload.bytes)) {
                    let ep = self.ep();
                    let n = th.encode(&header, ep.next_ctrl_slot());
                    ep.stage_send(SqLocal::CtrlPayload { len: n, payload: h });
                } else {
                    let mut buf = self
                        .pool
                        .get_for(TH_LEN + header.len() + plen)
                        .map_err(Fail::verbs)?;
                    let n = th.encode(&header, buf.as_mut_slice());
                    buf.as_mut_slice()[n..n + plen].copy_from_slice(&payload.bytes);
                    self.metrics.payload_bytes_copied.add(plen as u64);
                    self.ep().stage_send(SqLocal::Buf { buf, len: n + plen });
                }
            }
            Work::Rts {
                mut th,
                header,
                payload,
            } => {
                let held = match payload.held.filter(HeldBytes::exposable) {
                    Some(h) => h,
                    None => self.pool.register(&payload.bytes).map_err(Fail::verbs)?,
                };
                let (addr, rkey) = match self.ep().stage_expose(th.id, held) {
                    Ok(x) => x,
                    Err(e) => return Err(device_fail("ibv_alloc_mw / bind", &self.device, e)),
                };
                th.addr = addr;
                th.rkey = rkey;
                let ep = self.ep();
                let n = th.encode(&header, ep.next_ctrl_slot());
                ep.stage_send(SqLocal::Ctrl { len: n });
            }
            Work::Unexpose { id } => self.ep().stage_unexpose(id),
            Work::Read(c) => {
                let target = match c.alloc {
                    Some(total) => {
                        let t = Arc::new(self.pool.get_for(total).map_err(Fail::verbs)?);
                        self.targets.insert(c.tag, t.clone());
                        t
                    }
                    None => match self.targets.get(&c.tag) {
                        Some(t) => t.clone(),
                        None => {
                            return Err(Fail::verbs(VerbsError::Internal(
                                "READ without a target".into(),
                            )))
                        }
                    },
                };
                let spec = ReadSpec {
                    target,
                    offset: c.offset,
                    len: c.len,
                    remote_addr: c.remote_addr,
                    rkey: c.rkey,
                    tag: c.tag,
                };
                if let Err(e) = self.ep().stage_read(spec) {
                    return Err(device_fail("RDMA READ", &self.device, e));
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
        self.deliver_ready();
        if let Some(tx) = self.deliver.take() {
            let _ = tx.send(ToApp::Fail(f));
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
            s.get_or_insert(Fail::PeerGone("the verbs connection is closed"));
        }
        if let Some(tx) = self.deliver.take() {
            if self.failed.is_none() {
                let _ = tx.send(ToApp::End);
            }
        }
        drop(self.cq_fd.take());
        let ep = self.ep.take();
        let id = self.id.take();
        let targets = std::mem::take(&mut self.targets);
        let member = self.member.take();
        let work = move || {
            if let Some(id) = &id {
                let _ = id.disconnect();
            }
            // The QP goes first (no more DMA), then the windows, then the memory they exposed
            // or the device wrote (the endpoint's field order), then the READ targets.
            drop(ep);
            drop(targets);
            drop(id);
            drop(member);
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
    #[cfg(feature = "test-hooks")]
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
    rx: mpsc::UnboundedReceiver<ToApp>,
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
        if let Some(item) = &d {
            let bytes = match item {
                ToApp::Msg(m) => m.payload.len() as u64,
                _ => 0,
            };
            let _ = self
                .shared
                .backlog
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                    Some(v.saturating_sub(1))
                });
            let _ =
                self.shared
                    .backlog_bytes
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                        Some(v.saturating_sub(bytes))
                    });
            if self.shared.watching.load(Ordering::Acquire) {
                self.shared.drained.notify_one();
            }
        }
        match d {
            Some(ToApp::Msg(m)) => {
                self.metrics.messages_received.incr();
                Ok(Some(m))
            }
            Some(ToApp::TooLarge { len, max, header }) => {
                Err(TransportError::MessageTooLarge { len, max, header })
            }
            Some(ToApp::End) => {
                self.done = Some(None);
                Ok(None)
            }
            Some(ToApp::Fail(f)) => {
                let e = f.to_error();
                self.done = Some(Some(f));
                Err(e)
            }
            None => {
                let f = self
                    .shared
                    .fail
                    .lock()
                    .ok()
                    .and_then(|f| f.clone())
                    .unwrap_or(Fail::PeerGone("the verbs connection ended"));
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
