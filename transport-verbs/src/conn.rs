//! One connection: the queue pair and the protocol engine behind one lock (`Core`), the two
//! halves that use it directly, and a driver task that moves it on when they do not.
//!
//! The engine (`engine.rs`) decides everything; whoever holds the lock only moves between it
//! and the device: drains the CQ, feeds each completion to the engine, posts the work the
//! engine asks for (one doorbell per batch) and puts the engine's deliveries where the
//! receiving half takes them.
//! - The sender hands its message to the engine and posts it on its own task.
//! - The receiver, while the spin budget runs, polls the CQ on its own task and holds a lease
//!   on it, so a reply within the budget reaches it without a hop through another task. A
//!   plain small message it finds there is taken in one go (`Core::receive_small`: one
//!   completion polled, checked by the engine, copied, its buffer posted again in place; the
//!   engine steps only when it has work).
//! - The driver waits for its CQ's next event (routed by the device's pump thread,
//!   `cq_pump.rs`, which drains the CQ itself first: `Core::on_cq_event`), or spins while the
//!   budget runs and no receiver holds the lease, and on
//!   rdma_cm events and the engine's next deadline. It takes over whatever the halves leave: credits and completions while nobody
//!   waits, deadlines, the peer leaving, the teardown.
//! - On a current-thread runtime the three wait with a waker that knows their runtime
//!   (`home.rs`): woken from another thread (the pump), they are queued in their runtime's inbox
//!   and woken there in arrival order.

use std::collections::HashMap;
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sideway::rdmacm::communication_manager::{EventType, Identifier};
use tokio::sync::{mpsc, oneshot, Notify};
use transport_core::{
    BackendError, BufferPool, Capabilities, Connection, HeaderBytes, Message, MessageReceiver,
    MessageSender, Metrics, TransportError, TryRecv,
};

use crate::cm::{CmMsg, Established};
use crate::config::VerbsConfig;
use crate::cq_pump::{CqRoute, OnEvent};
use crate::engine::{self, Engine, OutMsg, RecvBuf, Work, MAX_WRS_PER_WORK};
use crate::error::{VerbsError, WorkRequestKind};
use crate::ffi::{Completion, Endpoint, HeldBytes, InPlace, ReadSpec, SqLocal, WcFailure};
use crate::pool::{Pool, PoolBuf};
use crate::proto::TH_LEN;

mod home;
mod poller;
#[cfg(feature = "test-hooks")]
pub use poller::polled_together;

/// Messages queued in the engine before the driver stops taking more from the sender.
const OUTQ_MAX: usize = 64;

/// The shortest lease a receiving half takes on the CQ while it polls (busy-poll mode has no
/// spin budget to size it by).
const MIN_LEASE: std::time::Duration = std::time::Duration::from_millis(1);

/// The longest lease a receiver's turns can ask for, in spin budgets: a lease outliving the
/// receiver's wait keeps the driver off the CQ until it ends.
const MAX_HOLD_SPINS: u32 = 4;
/// CQ polls a waiting receiver makes between two yields to the runtime while the spin budget
/// runs (from its second turn on): a few polls per yield bring the soft-RoCE guest's ping
/// closer to the link, and more than 64 gain nothing
/// (docs/notes/2026-12-02-verbs-cq-polls-before-yield.md).
const TIGHT_POLLS: u32 = 64;

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
    /// Wakes the driver: a half changed what it waits for (a deadline, a parked driver that
    /// should spin, a half that went away).
    kick: Notify,
    /// Wakes the sender waiting for room in the engine's queue, or for its close to be sent.
    room: Notify,
    /// Set by a sender before it waits on `room`: a step that makes room wakes it only then
    /// (most steps find nobody waiting).
    room_wanted: AtomicBool,
}

impl Shared {
    fn error(&self) -> Option<TransportError> {
        self.fail
            .lock()
            .ok()
            .and_then(|f| f.as_ref().map(Fail::to_error))
    }
}

/// The payload of an outgoing message: its bytes and, when known, their registration.
struct OutPayload {
    bytes: Bytes,
    held: Option<HeldBytes>,
}

/// A message as the engine takes it: `held` is the payload's registration (rendezvous).
fn out_msg(msg: Message, held: Option<HeldBytes>) -> OutMsg<OutPayload> {
    OutMsg {
        header: msg.header,
        len: msg.payload.len(),
        payload: OutPayload {
            bytes: msg.payload,
            held,
        },
    }
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
pub(crate) fn start(est: Established) -> Result<VerbsConnection, TransportError> {
    let Established {
        res,
        id,
        events,
        peer,
    } = est;
    let (dtx, drx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::default());
    // The settings this connection uses: the transport's, with the device's paths applied.
    let cfg = res.cfg.clone();
    let caps = cfg.capabilities();
    let engine = Engine::new(
        cfg.engine_config(res.speaks_first, res.ep.on_iwarp()),
        res.metrics.clone(),
        Instant::now(),
    );
    let core = Arc::new(Mutex::new(Core {
        ep: Some(res.ep),
        engine,
        targets: HashMap::new(),
        pool: res.pool.clone(),
        metrics: res.metrics.clone(),
        cfg: cfg.clone(),
        device: res.device.clone(),
        deliver: Some(dtx),
        receiver_gone: false,
        sender_gone: false,
        shared: shared.clone(),
        close_acks: Vec::new(),
        failed: None,
        peer_disconnected: false,
        qp_error_injected: false,
        ended: false,
        completions: Vec::new(),
        timeout_due: false,
        timer_at: None,
        parked: false,
        deferring: false,
        spin_until: None,
        active_since_check: false,
        app_lease: None,
        driver_turn: false,
        pump_turn: false,
        receiver_turn: false,
        delivered_now: false,
        reads_yield: false,
        reads_after_yield: false,
    }));
    let sender = VerbsSender {
        core: core.clone(),
        shared: shared.clone(),
        metrics: res.metrics.clone(),
        pool: res.pool,
        cfg: cfg.clone(),
        closed: false,
        home: home::Home::here(),
    };
    let receiver = VerbsReceiver {
        rx: drx,
        done: None,
        metrics: res.metrics.clone(),
        shared: shared.clone(),
        core: core.clone(),
        slot: poller::PollSlot::new(&core),
        home: None,
    };
    // While the driver sleeps on the completion channel, the device's pump thread moves the
    // connection on at its CQ's events itself (`Core::on_cq_event`); when the device's shared
    // receive queue runs low, it drains this CQ too, whatever the driver does (`Core::reclaim`).
    let weak = Arc::downgrade(&core);
    let on_event: OnEvent = Arc::new(move || {
        let Some(core) = weak.upgrade() else {
            return false;
        };
        // Waits for a half that holds the lock (never across an await). Skipping the event
        // instead would lose it: the half may have taken the completions, the pump would not
        // arm the CQ again, and with the driver's runtime busy no later completion would raise
        // an event.
        let mut core = lock(&core);
        core.on_cq_event()
    });
    // A core locked right now is skipped: its holder is moving the connection on, and the
    // pump does not wait behind a thread that may be preempted while thousands of other CQs
    // hold buffers.
    let weak = Arc::downgrade(&core);
    let reclaim: OnEvent = Arc::new(move || {
        weak.upgrade()
            .is_some_and(|core| core.try_lock().is_ok_and(|mut core| core.reclaim()))
    });
    #[cfg(feature = "test-hooks")]
    let break_qp: OnEvent = {
        let (weak, shared) = (Arc::downgrade(&core), shared.clone());
        Arc::new(move || {
            let Some(core) = weak.upgrade() else {
                return false;
            };
            let broke = lock(&core).break_qp();
            shared.kick.notify_one();
            broke
        })
    };
    res.cq_route.handle_events(
        on_event,
        reclaim,
        #[cfg(feature = "test-hooks")]
        break_qp,
    );
    let driver = Driver {
        cq_route: Some(res.cq_route),
        core,
        cfg,
        device: res.device.clone(),
        metrics: res.metrics,
        id: Some(id),
        cm_rx: events,
        shared,
        timer: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
        timer_at: None,
        lease: Box::pin(tokio::time::sleep(std::time::Duration::ZERO)),
        member: Some(res.member),
    };
    // Woken from the pump thread through this runtime's inbox (`home.rs`).
    tokio::spawn(home::homed(home::Home::here(), driver.run()));
    Ok(VerbsConnection {
        sender,
        receiver,
        caps,
        peer,
        device: res.device,
    })
}

/// Locks the connection's core; a panic while it was held (a bug) does not make the
/// connection unusable for teardown.
fn lock(core: &Mutex<Core>) -> std::sync::MutexGuard<'_, Core> {
    core.lock().unwrap_or_else(|e| e.into_inner())
}

/// The core locked by the driver: what it delivers meanwhile counts as a hand-off.
struct DriverTurn<'a>(std::sync::MutexGuard<'a, Core>);

impl DriverTurn<'_> {
    fn lock(core: &Mutex<Core>) -> DriverTurn<'_> {
        let mut g = lock(core);
        g.driver_turn = true;
        g.delivered_now = false;
        DriverTurn(g)
    }
}

impl std::ops::Deref for DriverTurn<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.0
    }
}

impl std::ops::DerefMut for DriverTurn<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        &mut self.0
    }
}

impl Drop for DriverTurn<'_> {
    fn drop(&mut self) {
        self.0.driver_turn = false;
    }
}

/// The queue pair and the protocol engine, shared by the driver task and the two halves.
///
/// Whoever holds the lock moves the connection on: the sender posts its message itself, the
/// receiver polls the CQ itself while it waits for a message, and the driver does both when
/// woken by the completion channel, rdma_cm or a deadline. A round trip then needs no hop
/// between tasks on either side. The lock is never held across an `.await`.
struct Core {
    ep: Option<Endpoint<PoolBuf>>,
    engine: Engine<OutPayload>,
    /// Targets of the incoming rendezvous transfers being read, by the engine's tag.
    targets: HashMap<u64, Arc<PoolBuf>>,
    pool: Pool,
    metrics: Arc<Metrics>,
    cfg: Arc<VerbsConfig>,
    device: String,
    deliver: Option<mpsc::UnboundedSender<ToApp>>,
    receiver_gone: bool,
    sender_gone: bool,
    shared: Arc<Shared>,
    close_acks: Vec<oneshot::Sender<()>>,
    failed: Option<Fail>,
    peer_disconnected: bool,
    /// The test hook moved the queue pair to the error state (a simulated device fault).
    qp_error_injected: bool,
    /// The driver has ended: the queue pair is being torn down.
    ended: bool,
    completions: Vec<Completion<PoolBuf>>,
    /// The driver's timer has fired for the engine's deadline `timer_at`.
    timeout_due: bool,
    /// The deadline the driver's timer is set to.
    timer_at: Option<Instant>,
    /// The driver sleeps on the completion channel (not spinning).
    parked: bool,
    /// The driver leaves the CQ to the receiving half while its lease runs (`app_lease`).
    deferring: bool,
    /// Adaptive polling: until then the connection polls the CQ instead of sleeping on the
    /// completion channel (`VerbsConfig::poll_spin` after the last activity).
    spin_until: Option<Instant>,
    /// Activity since the spin budget was last looked at: the budget runs from the next
    /// look ([`Core::spinning_at`], which has the clock at hand), so that acting on the
    /// connection reads no clock.
    active_since_check: bool,
    /// Until then the receiving half polls the CQ on its own task (renewed at every poll
    /// while it waits for a message); the driver stays out of its way.
    app_lease: Option<Instant>,
    /// The driver holds the lock: what it delivers is a hand-off (`Metrics::handoffs`).
    driver_turn: bool,
    /// The device's pump thread holds the lock (`Core::on_cq_event`): what it delivers is a
    /// hand-off too.
    pump_turn: bool,
    /// The receiving half holds the lock and polls on its own task: deliveries stay in the
    /// engine for it to take (`VerbsReceiver::take_direct`).
    receiver_turn: bool,
    /// This driver turn delivered a message: READs wait for the application's turn.
    delivered_now: bool,
    /// The driver held back a READ for the application's turn: it yields, then posts it.
    reads_yield: bool,
    /// The driver has yielded for a held-back READ: its next turn posts it.
    reads_after_yield: bool,
}

impl Core {
    fn ep(&mut self) -> &mut Endpoint<PoolBuf> {
        self.ep.as_mut().expect("endpoint lives until teardown")
    }

    /// Whether new work can still be posted.
    fn usable(&self) -> bool {
        !self.ended && self.failed.is_none() && self.ep.is_some()
    }

    /// Something happened: keep polling the CQ for the spin budget before sleeping again.
    fn active(&mut self) {
        if !self.cfg.poll_spin.is_zero() {
            self.active_since_check = true;
        }
    }

    /// Whether the spin budget after the last activity still runs (clears it once spent).
    fn spinning(&mut self) -> bool {
        self.spinning_at(Instant::now())
    }

    /// For the receiving half waiting for a message (on its own task or through its thread's
    /// poller): while the connection should spin, renews the half's lease on the CQ and returns
    /// true; else gives the CQ back to the driver at once (not when the lease would end) and
    /// returns false. `thread_busy`: a message reached the thread within the spin budget
    /// (`poller::busy_here`), so a connection that spins at all spins with its thread although
    /// it has been quiet itself. `hold`: how long the half's next turn may take to come round
    /// (the lease lasts at least that, up to `MAX_HOLD_SPINS` budgets).
    fn renew_lease(&mut self, now: Instant, thread_busy: bool, hold: Duration) -> bool {
        let thread_busy = thread_busy && !self.cfg.poll_spin.is_zero();
        let spin = self.usable() && (self.cfg.busy_poll || self.spinning_at(now) || thread_busy);
        if spin {
            let hold = hold.min(self.cfg.poll_spin * MAX_HOLD_SPINS);
            self.app_lease = Some(now + self.cfg.poll_spin.max(MIN_LEASE).max(hold));
        } else if self.app_lease.take().is_some() && self.deferring {
            self.shared.kick.notify_one();
        }
        spin
    }

    /// [`Core::spinning`] with the clock already read.
    fn spinning_at(&mut self, now: Instant) -> bool {
        if std::mem::take(&mut self.active_since_check) {
            self.spin_until = Some(now + self.cfg.poll_spin);
        }
        match self.spin_until {
            Some(t) if now < t => true,
            Some(_) => {
                self.spin_until = None;
                false
            }
            None => false,
        }
    }

    /// Whether the driver must be woken after a half acted: it sleeps although the
    /// connection should now spin, or the engine's deadline moved away from its timer.
    fn driver_needs_kick(&self) -> bool {
        (self.parked && self.spin_pending()) || self.engine.poll_timeout() != self.timer_at
    }

    /// Whether the connection should spin, as far as known without reading the clock: a
    /// budget runs or activity since the last look starts one.
    fn spin_pending(&self) -> bool {
        self.spin_until.is_some() || self.active_since_check
    }

    /// A half acted on the connection: keep spinning, and wake the driver if it must act too
    /// ([`Core::driver_needs_kick`]).
    fn acted(&mut self) {
        self.active();
        if self.driver_needs_kick() {
            self.shared.kick.notify_one();
        }
    }

    /// The sending half is gone: a dropped sender closes the sending direction.
    fn sender_gone(&mut self) {
        self.sender_gone = true;
        self.engine.close();
    }

    /// The device's pump thread read an event of this connection's CQ. While the driver
    /// sleeps on the completion channel (its CQ armed, no receiver polling), the pump drains
    /// the CQ here, so that the shared receive queue gets its buffers back and the receiver
    /// its messages at once, not once a busy runtime reaches the driver; then, as the driver
    /// would after an event, the connection spins for its budget: the driver is kicked to do
    /// that (and arms the CQ when the budget runs out). In pure event mode (`poll_spin` 0)
    /// the pump arms the CQ again itself and the driver sleeps on. Returns false when the
    /// driver must act instead (it is awake, or something failed).
    ///
    /// With many connections on one runtime, each woken by events, the buffers of the
    /// shared receive queue would otherwise stay taken until that runtime reaches each
    /// driver: a thousand clients empty a queue of 128 and spend the CPU on RNR retries
    /// (docs/notes/2026-12-03-scenarios-rnr-retries.md).
    fn on_cq_event(&mut self) -> bool {
        if !self.parked || self.deferring || self.cfg.busy_poll || !self.usable() {
            return false;
        }
        self.pump_turn = true;
        let handled = if self.cfg.poll_spin.is_zero() {
            self.progress_parked()
        } else {
            self.progress();
            self.failed.is_none()
        };
        self.pump_turn = false;
        if handled {
            self.active();
            if self.driver_needs_kick() {
                self.shared.kick.notify_one();
            }
            if !self.cfg.poll_spin.is_zero() {
                // The event used up the arming: until the driver runs, the CQ raises no
                // event, and a low shared receive queue must drain it (`Core::reclaim`).
                self.parked = false;
            }
        }
        handled
    }

    /// The device's shared receive queue ran low (the pump thread, at the device's
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`): drains the CQ, whose receive completions hold its
    /// buffers, and posts them again. A connection that spins on a runtime busy with others
    /// polls its CQ only when that runtime comes round, and a spinning CQ raises no event, so
    /// without this the queue stays empty and the peers' sends wait on RNR retries.
    /// Returns whether it took anything (the connection then spins, and its driver is woken
    /// if it must act).
    fn reclaim(&mut self) -> bool {
        // A parked driver armed the CQ after its last poll: a completion since then raised
        // an event, which the pump drains (`Core::on_cq_event`).
        if !self.usable() || self.parked {
            return false;
        }
        self.pump_turn = true;
        let n = self.drain_cq();
        self.pump_turn = false;
        if n > 0 {
            self.acted();
        }
        n > 0
    }

    /// [`Core::on_cq_event`]'s work in event mode: drain and step until the CQ stays empty
    /// after arming.
    fn progress_parked(&mut self) -> bool {
        loop {
            self.progress();
            if self.failed.is_some() {
                return false;
            }
            self.metrics.syscalls.incr();
            if let Err(e) = self.ep().arm() {
                let f = device_fail("ibv_req_notify_cq", &self.device, e);
                self.fail(f);
                return false;
            }
            // A completion that raced the arming is taken now, not at the next event.
            match self.poll_cq() {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(f) => {
                    self.fail(f);
                    return false;
                }
            }
        }
    }

    /// Drains the CQ, then lets the engine act on time, the application's pace and queued
    /// messages: one step after each batch of completions, or one step when there were none.
    /// Returns the completions seen. A failure is recorded (`fail`) and ends it.
    fn progress(&mut self) -> usize {
        if !self.usable() {
            return 0;
        }
        let n = self.drain_cq();
        if n == 0 && self.failed.is_none() {
            if let Err(f) = self.step() {
                self.fail(f);
            }
        }
        n
    }

    /// For a half on its own task: drains the CQ when it holds anything (the half steps the
    /// engine itself after it acted). An empty CQ costs one poll and no step of the engine.
    fn progress_if_any(&mut self) -> usize {
        if !self.usable() {
            return 0;
        }
        self.drain_cq()
    }

    /// For a poller on behalf of the receiving half: drains the CQ if it holds anything
    /// (deliveries go through the channel); true when it did (the connection then spins
    /// again, and the driver is woken if it must act on what was taken).
    fn took_any(&mut self) -> bool {
        if self.progress_if_any() == 0 {
            return false;
        }
        self.acted();
        true
    }

    /// Polls until the CQ is empty (a batch short of the poll's capacity says so), stepping
    /// the engine after each batch of completions: a lone completion costs one poll and one
    /// step.
    fn drain_cq(&mut self) -> usize {
        let mut total = 0;
        loop {
            match self.poll_cq() {
                Ok(0) => break,
                Ok(n) => {
                    total += n;
                    if let Err(f) = self.step() {
                        self.fail(f);
                        break;
                    }
                    // A batch short of the poll's capacity emptied the CQ: a completion since
                    // then is no different from one after an empty poll (the next look takes
                    // it), and the poll that would only confirm it is saved.
                    if n < crate::ffi::POLL_BATCH {
                        break;
                    }
                }
                Err(f) => {
                    self.fail(f);
                    break;
                }
            }
        }
        total
    }

    /// One poll of the CQ (up to a batch), each completion fed to the engine.
    fn poll_cq(&mut self) -> Result<usize, Fail> {
        let mut comps = std::mem::take(&mut self.completions);
        let n = match self.ep().poll(&mut comps) {
            Ok(n) => n,
            Err(e) => return Err(device_fail("ibv_poll_cq", &self.device, e)),
        };
        self.completions = comps;
        self.metrics.completions.add(n as u64);
        self.feed_completions()?;
        Ok(n)
    }

    /// Feeds the completions polled into `self.completions` to the engine, in order.
    fn feed_completions(&mut self) -> Result<(), Fail> {
        let mut comps = std::mem::take(&mut self.completions);
        let mut result = Ok(());
        for c in comps.drain(..) {
            if result.is_ok() {
                result = self.on_completion(c);
            }
        }
        self.completions = comps;
        result
    }

    /// The receiving half's look at the CQ, on its own task, with nothing delivered ahead:
    /// one completion polled; a plain small message ([`Engine::recv_small`]) is checked,
    /// copied and its buffer posted again in place in one go, and returned, with a step of the
    /// engine only when it has work ([`Engine::has_work`]) or a sender waits for room. Any
    /// other completion takes the generic path ([`Core::drain_cq`], which steps and drains
    /// the rest). Returns the message, if one came this way, and the completions seen.
    fn receive_small(&mut self) -> (Option<Message>, usize) {
        if !self.usable() {
            return (None, 0);
        }
        let Some(ep) = self.ep.as_mut() else {
            return (None, 0);
        };
        let engine = &mut self.engine;
        let polled = ep.poll_recv_in_place(|b| engine.recv_small(b), &mut self.completions);
        match polled {
            Ok(InPlace::Empty) => (None, 0),
            Ok(InPlace::Taken(m)) => {
                self.metrics.completions.incr();
                let room = self.shared.room_wanted.load(Ordering::Acquire);
                if self.timeout_due || room || self.engine.has_work() {
                    if let Err(f) = self.step() {
                        self.fail(f);
                    }
                }
                (Some(m), 1)
            }
            Ok(InPlace::Other) => {
                self.metrics.completions.incr();
                let fed = self.feed_completions().and_then(|()| self.step());
                if let Err(f) = fed {
                    self.fail(f);
                    return (None, 1);
                }
                (None, 1 + self.drain_cq())
            }
            Err(e) => {
                let f = device_fail("ibv_poll_cq", &self.device, e);
                self.fail(f);
                (None, 1)
            }
        }
    }

    /// The engine acts: deadlines, the application's backlog, deliveries, work to post.
    fn step(&mut self) -> Result<(), Fail> {
        let backlog = self.shared.backlog.load(Ordering::Acquire);
        let bytes = self.shared.backlog_bytes.load(Ordering::Acquire);
        self.engine.set_backlog(backlog, bytes);
        if self.timeout_due {
            self.engine
                .handle_timeout(Instant::now())
                .map_err(Fail::verbs)?;
        }
        // The receiving half stepping on its own task takes its deliveries from the engine
        // itself (`VerbsReceiver::take_direct`): no channel, no backlog to count.
        if !self.receiver_turn {
            self.deliver_ready();
        }
        self.pump_out()?;
        // The clock is read only when this step armed a deadline (a FIN, the first RTS).
        if self.engine.needs_clock() {
            self.engine.clock(Instant::now());
        }
        if self.engine.close_sent() && !self.close_acks.is_empty() {
            for a in self.close_acks.drain(..) {
                let _ = a.send(());
            }
        }
        if self.engine.queued() < OUTQ_MAX && self.shared.room_wanted.load(Ordering::Acquire) {
            // A sender waiting for room (or for its close) looks again.
            self.shared.room_wanted.store(false, Ordering::Release);
            self.shared.room.notify_one();
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
                    // The peer's side ended the READ (killed mid-transfer: its keys and queue
                    // pair go in no fixed order, so a flush, a remote access error or no
                    // answer): the incoming message was cut.
                    if e.is_peer_side() {
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
        if !e.is_flush() {
            return wc(kind, e);
        }
        if self.engine.peer_closed() {
            return Fail::PeerGone("RDMA peer closed the connection");
        }
        // On iWARP the connection is a TCP stream: a peer that dies or resets it moves the
        // queue pair to the error state before rdma_cm reports the disconnect, so the first
        // failure is a flush. Reported as the disconnect it is (cut mid-message: truncated).
        let iwarp = self.ep.as_ref().is_some_and(|ep| ep.on_iwarp());
        if iwarp && !self.qp_error_injected {
            return self.unclosed_disconnect();
        }
        wc(kind, e)
    }

    /// The failure of a connection the peer left without closing it: truncated when a message
    /// was being read, else a reset.
    fn unclosed_disconnect(&self) -> Fail {
        match self.engine.reading() {
            Some((received, expected)) => Fail::Truncated { received, expected },
            None => Fail::PeerGone("RDMA peer disconnected without closing the connection"),
        }
    }

    /// The engine's next delivery as the application takes it (`None`: nothing ready).
    fn next_delivery(&mut self) -> Option<ToApp> {
        loop {
            let item = match self.engine.poll_delivery()? {
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
            return Some(item);
        }
    }

    /// Hands every ready delivery to the receiving half's channel.
    fn deliver_ready(&mut self) {
        while let Some(item) = self.next_delivery() {
            let bytes = match &item {
                ToApp::Msg(m) => m.payload.len() as u64,
                _ => 0,
            };
            if let Some(tx) = &self.deliver {
                if self.driver_turn {
                    self.metrics.handoffs.incr();
                    self.delivered_now = true;
                } else if self.pump_turn {
                    self.metrics.handoffs.incr();
                }
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
    ///
    /// RDMA READs are posted by the driver task only, and never in a driver turn that has
    /// just delivered a message: the driver yields first (`Core::reads_yield`), so that the
    /// application takes the message and answers before the READ goes out. A software device
    /// (rxe) runs a READ's whole transfer in the softirq of the CPU whose thread posted it:
    /// posted from the application's thread, or before its answer, a 1 MiB READ holds that
    /// thread and the answer for the whole transfer, and an echo of 1 MiB moves one transfer
    /// at a time across both sides (docs/notes/2026-12-03-verbs-echo-1mib.md). On hardware the
    /// deferral costs one turn of the runtime before a large transfer.
    fn pump_out(&mut self) -> Result<(), Fail> {
        let hold = !self.driver_turn || (self.delivered_now && !self.reads_after_yield);
        self.engine.set_reads_held(hold);
        if hold && self.engine.read_ready() {
            if self.driver_turn {
                self.reads_yield = true;
            } else {
                self.shared.kick.notify_one();
            }
        } else if !hold {
            self.reads_after_yield = false;
        }
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

    /// The fast path of a small message, on the sender's task: when the engine lets it go at
    /// once ([`Engine::send_now`]: nothing queued ahead, credits in hand) and it fits inline,
    /// it is built in its control slot and posted with one inline SEND, with no queue, no step
    /// of the engine and no allocation. `None`: not taken (the caller queues it); `Some(Err)`:
    /// taken, and the post failed (the connection has failed).
    fn send_now(&mut self, msg: &Message) -> Option<Result<(), Fail>> {
        if !self.usable() || self.peer_disconnected {
            return None;
        }
        let (hlen, plen) = (msg.header.len(), msg.payload.len());
        let ep = self.ep();
        if TH_LEN + hlen + plen > ep.inline_max()
            || ep.sq_room() < MAX_WRS_PER_WORK
            || ep.has_staged()
        {
            return None;
        }
        let th = self.engine.send_now(hlen, plen)?;
        let ep = self.ep();
        let n = th.encode_message(&msg.header, &msg.payload, ep.next_ctrl_slot());
        if let Err(e) = ep.post_slot_inline_now(n) {
            return Some(Err(device_fail("ibv_post_send", &self.device, e)));
        }
        self.metrics.doorbells.incr();
        self.metrics.payload_bytes_copied.add(plen as u64);
        // The spin budget is renewed by the receiving half as it polls; a parked driver, or
        // a connection whose budget ran out, is woken as after any other send.
        if self.parked || !self.spin_pending() {
            self.acted();
        }
        Some(Ok(()))
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
                    let n = th.encode_message(&header, &payload.bytes, ep.next_ctrl_slot());
                    ep.stage_send(SqLocal::Ctrl { len: n });
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
                    let n = th.encode_message(&header, &payload.bytes, buf.as_mut_slice());
                    self.metrics.payload_bytes_copied.add(plen as u64);
                    self.ep().stage_send(SqLocal::Buf { buf, len: n });
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
            Work::Probe => {
                tracing::debug!("the peer's HELLO is late: probing with a zero-length READ");
                self.ep().stage_probe();
            }
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

    /// Test hook: moves the queue pair to the error state, as a device fault would (the
    /// flushed work requests surface as errors); whether it did (`false` once it has ended).
    #[cfg(feature = "test-hooks")]
    fn break_qp(&mut self) -> bool {
        if self.ep.is_none() || self.ended || self.failed.is_some() {
            return false;
        }
        self.qp_error_injected = true;
        if let Err(e) = self.ep().set_error() {
            let f = device_fail("ibv_modify_qp (error state)", &self.device.clone(), e);
            self.fail(f);
        }
        self.active();
        true
    }

    fn on_cm(&mut self, kind: Option<EventType>) {
        match kind {
            Some(EventType::DeviceRemoval) => {
                // What completed before is delivered first, then the removal: the driver
                // then tears the queue pair down, whatever the application still holds.
                self.progress();
                let f = Fail::verbs(VerbsError::DeviceRemoved {
                    device: self.device.clone(),
                });
                self.fail(f);
            }
            Some(EventType::Disconnected) | Some(EventType::TimewaitExit) | None => {
                // Whatever the peer sent before leaving is in the CQ: take it first.
                self.progress();
                if self.failed.is_some() {
                    return;
                }
                if self.engine.reading().is_some() || !self.engine.peer_closed() {
                    let f = self.unclosed_disconnect();
                    self.fail(f);
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
        // A sender waiting for room or for its close sees the failure.
        self.shared.room.notify_one();
        if let Some(ep) = self.ep.as_mut() {
            let _ = ep.set_error();
        }
    }
}

struct Driver {
    /// Wakes the driver at its CQ's completion events (the CQ is armed before it sleeps);
    /// dropped before the endpoint.
    cq_route: Option<CqRoute>,
    core: Arc<Mutex<Core>>,
    cfg: Arc<VerbsConfig>,
    device: String,
    metrics: Arc<Metrics>,
    id: Option<Arc<Identifier>>,
    cm_rx: mpsc::UnboundedReceiver<CmMsg>,
    shared: Arc<Shared>,
    /// Sleeps until the engine's next deadline (`timer_at`).
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    timer_at: Option<Instant>,
    /// Sleeps until the receiving half's lease on the CQ ends.
    lease: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Counts this connection and its memory in its domain until teardown.
    member: Option<crate::domain::Member>,
}

enum Wake {
    Cq,
    Cm(Option<CmMsg>),
    Other,
}

/// What the driver waits for in one turn, decided under the lock.
struct Turn {
    busy: bool,
    /// The receiving half polls until then: no CQ wait and no spinning here.
    defer_until: Option<Instant>,
    deadline: Option<Instant>,
    watch_app: bool,
}

impl Driver {
    async fn run(mut self) {
        loop {
            let (turn, reads_yield) = {
                let mut core = DriverTurn::lock(&self.core);
                match self.prepare(&mut core) {
                    Some(t) => (t, std::mem::take(&mut core.reads_yield)),
                    None => break,
                }
            };
            if reads_yield {
                // A READ waits for the application's turn (see `Core::pump_out`).
                tokio::task::yield_now().await;
                lock(&self.core).reads_after_yield = true;
                continue;
            }
            // One timer, moved only when the engine's deadline moves (not one per wake).
            if turn.deadline != self.timer_at {
                let at = match turn.deadline {
                    Some(d) => tokio::time::Instant::from_std(d),
                    // Nothing to wait for. The timer is not polled then, but an entry left at
                    // its old deadline (the hello deadline of a connection set up long ago)
                    // would still fire and wake this task once: with many idle connections
                    // that would be most of their wake-ups. Move it out of the way instead.
                    None => tokio::time::Instant::now() + IDLE_TIMER,
                };
                self.timer.as_mut().reset(at);
                self.timer_at = turn.deadline;
                lock(&self.core).timer_at = turn.deadline;
            }
            let busy = turn.busy;
            let deferring = turn.defer_until.is_some();
            if let Some(t) = turn.defer_until {
                self.lease.as_mut().reset(tokio::time::Instant::from_std(t));
            }
            let shared = self.shared.clone();
            let cq_route = self
                .cq_route
                .as_ref()
                .expect("the route lives until teardown");
            let wake = tokio::select! {
                biased;
                _ = cq_route.woken(), if !busy && !deferring => Wake::Cq,
                m = self.cm_rx.recv() => Wake::Cm(m),
                _ = shared.kick.notified() => Wake::Other,
                _ = tokio::task::yield_now(), if busy => Wake::Other,
                _ = self.timer.as_mut(), if turn.deadline.is_some() => Wake::Other,
                _ = self.lease.as_mut(), if deferring => Wake::Other,
                _ = shared.drained.notified(), if turn.watch_app => Wake::Other,
            };
            let mut core = DriverTurn::lock(&self.core);
            core.parked = false;
            core.deferring = false;
            match wake {
                // The device's pump read and acknowledged the event (and counted its reads).
                Wake::Cq => core.active(),
                Wake::Cm(Some(m)) => {
                    core.active();
                    core.on_cm(m.kind);
                }
                Wake::Cm(None) => core.active(),
                Wake::Other => {}
            }
        }
        self.teardown();
    }

    /// Moves the connection on and decides what to wait for next; `None` when the driver
    /// should end.
    fn prepare(&self, core: &mut Core) -> Option<Turn> {
        loop {
            core.timeout_due = self.timer_at.is_some() && self.timer.is_elapsed();
            if core.progress() > 0 {
                core.active();
            }
            if core.failed.is_some() || core.peer_disconnected {
                return None;
            }
            if !core.receiver_gone && core.deliver.as_ref().is_none_or(|d| d.is_closed()) {
                core.receiver_gone = true;
                core.deliver = None;
                core.engine.receiver_gone();
                continue;
            }
            if core.sender_gone && core.receiver_gone {
                // Both halves are gone: finish what is outstanding (the peer still reading a
                // payload of ours), then disconnect; give up after `linger` without progress.
                core.engine.local_gone(Instant::now());
                let idle =
                    core.engine.is_idle() && core.ep.as_ref().is_none_or(|e| e.outstanding() == 0);
                if idle || core.engine.linger_expired() {
                    return None;
                }
            }
            let busy = self.cfg.busy_poll || core.spinning();
            // A receiver holding the lease polls the CQ, whether the connection's own budget
            // runs or its thread's (`poller::busy_here`).
            if let Some(t) = core.app_lease {
                if Instant::now() < t {
                    core.parked = false;
                    core.deferring = true;
                    return Some(Turn {
                        busy: false,
                        defer_until: Some(t),
                        deadline: core.engine.poll_timeout(),
                        watch_app: core.engine.waiting_for_app(),
                    });
                }
                core.app_lease = None;
            }
            core.deferring = false;
            if !busy {
                // rxe (and most providers) arm through the kernel: one system call.
                self.metrics.syscalls.incr();
                if let Err(e) = core.ep().arm() {
                    let f = device_fail("ibv_req_notify_cq", &self.device, e);
                    core.fail(f);
                    return None;
                }
                // A completion that raced the arming is processed now, not at the next event
                // (the engine steps at the top of the loop).
                match core.poll_cq() {
                    Ok(0) => {}
                    Ok(_) => {
                        core.active();
                        continue;
                    }
                    Err(f) => {
                        core.fail(f);
                        return None;
                    }
                }
            }
            core.parked = !busy;
            return Some(Turn {
                busy,
                defer_until: None,
                deadline: core.engine.poll_timeout(),
                watch_app: core.engine.waiting_for_app(),
            });
        }
    }

    fn teardown(mut self) {
        let (ep, targets) = {
            let mut core = DriverTurn::lock(&self.core);
            if core.failed.is_none() && !core.peer_disconnected {
                // Clean end: the receiver gets whatever is left, then the end of the stream.
                core.deliver_ready();
            }
            if let Ok(mut s) = core.shared.fail.lock() {
                s.get_or_insert(Fail::PeerGone("the verbs connection is closed"));
            }
            if let Some(tx) = core.deliver.take() {
                if core.failed.is_none() {
                    let _ = tx.send(ToApp::End);
                }
            }
            core.ended = true;
            core.close_acks.clear();
            core.shared.room.notify_one();
            (core.ep.take(), std::mem::take(&mut core.targets))
        };
        drop(self.cq_route.take());
        let id = self.id.take();
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
    core: Arc<Mutex<Core>>,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    pool: Pool,
    cfg: Arc<VerbsConfig>,
    closed: bool,
    /// Where the task waiting for room is woken from other threads (`home.rs`).
    home: Option<home::Home>,
}

impl std::fmt::Debug for VerbsSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsSender").finish_non_exhaustive()
    }
}

impl VerbsSender {
    /// Fails a send on a sender that was closed or a connection that failed.
    fn check_open(&self) -> Result<(), TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        match self.shared.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn gone(&self) -> TransportError {
        self.shared.error().unwrap_or(TransportError::Closed)
    }

    /// Runs `f` on the core once the engine's queue has room (the driver or the receiver
    /// makes it as the peer grants credits), then wakes the driver if it must act on it.
    async fn with_room<R>(&self, f: impl FnOnce(&mut Core) -> R) -> Result<R, TransportError> {
        home::homed(self.home.clone(), self.with_room_here(f)).await
    }

    /// [`VerbsSender::with_room`] on the task's own waker.
    async fn with_room_here<R>(&self, f: impl FnOnce(&mut Core) -> R) -> Result<R, TransportError> {
        let mut f = Some(f);
        // The first look registers no waiter (the common case: there is room); a full queue
        // is looked at again with the waiter registered first, so no wake-up is lost.
        let mut waiting = false;
        loop {
            let notified = self.shared.room.notified();
            tokio::pin!(notified);
            if waiting {
                notified.as_mut().enable();
                // Before the look under the lock: a step after it sees the flag and wakes us.
                self.shared.room_wanted.store(true, Ordering::SeqCst);
            }
            {
                let mut core = lock(&self.core);
                if !core.usable() {
                    drop(core);
                    return Err(self.gone());
                }
                // Credits and send slots the peer returned since the last look (the step
                // below, after `f`, acts on them).
                core.progress_if_any();
                if !core.usable() {
                    drop(core);
                    return Err(self.gone());
                }
                if core.engine.queued() < OUTQ_MAX {
                    let f = f.take().expect("runs once");
                    let r = f(&mut core);
                    if let Err(fail) = core.step() {
                        core.fail(fail);
                    }
                    core.acted();
                    return Ok(r);
                }
                if !waiting {
                    waiting = true;
                    continue;
                }
                // Full: the driver moves the connection on (spinning) until there is room.
                core.active();
                self.shared.kick.notify_one();
            }
            notified.await;
        }
    }

    /// Sends `msg` by the fast path ([`Core::send_now`]) if it takes it: `Ok(false)` when it
    /// does not (the caller queues the message).
    fn try_send_now(&mut self, msg: &Message) -> Result<bool, TransportError> {
        if self.closed {
            return Err(TransportError::Closed);
        }
        if msg.len() > self.cfg.inline_size {
            return Ok(false);
        }
        let mut core = lock(&self.core);
        match core.send_now(msg) {
            Some(Ok(())) => {
                drop(core);
                self.metrics.messages_sent.incr();
                Ok(true)
            }
            Some(Err(f)) => {
                core.fail(f);
                drop(core);
                Err(self.gone())
            }
            None => Ok(false),
        }
    }

    /// [`MessageSender::send`] of a message the fast path did not take: queued in the engine
    /// once it has room.
    async fn send_queued(&mut self, msg: Message) -> Result<(), TransportError> {
        self.check_open()?;
        // Payloads above the eager limit go by rendezvous: register (or find) them here, so
        // a registration failure is this call's error.
        let held = if msg.payload.len() > self.cfg.eager_limit {
            Some(self.pool.register(&msg.payload)?)
        } else {
            None
        };
        self.with_room(move |core| core.engine.send(out_msg(msg, held)))
            .await?;
        self.metrics.messages_sent.incr();
        Ok(())
    }

    /// [`MessageSender::send_batch`] of what the fast path did not take.
    async fn send_batch_queued(&mut self, msgs: &mut Vec<Message>) -> Result<(), TransportError> {
        while let Some(first) = msgs.first() {
            if first.len() > self.cfg.max_message_size {
                // Refused as `send` refuses it (the RPC client checks sizes before queuing).
                let msg = msgs.remove(0);
                self.send(msg).await?;
                continue;
            }
            self.check_open()?;
            if first.payload.len() > self.cfg.eager_limit {
                // Rendezvous: registered here; taken out of `msgs` only once the engine has
                // it, so a future dropped while the queue is full leaves it in `msgs` (the
                // trait's cancel rule).
                let held = Some(self.pool.register(&first.payload)?);
                self.with_room(|core| core.engine.send(out_msg(msgs.remove(0), held)))
                    .await?;
                self.metrics.messages_sent.incr();
                continue;
            }
            let eager = self.cfg.eager_limit;
            let max = self.cfg.max_message_size;
            let taken = self
                .with_room(|core| {
                    let room = OUTQ_MAX.saturating_sub(core.engine.queued()).max(1);
                    let n = msgs
                        .iter()
                        .take(room)
                        .take_while(|m| m.payload.len() <= eager && m.len() <= max)
                        .count();
                    for msg in msgs.drain(..n) {
                        core.engine.send(out_msg(msg, None));
                    }
                    n
                })
                .await?;
            self.metrics.messages_sent.add(taken as u64);
        }
        Ok(())
    }

    /// Test hook: moves the queue pair to the error state, as a device fault would. Every
    /// pending and later operation fails with a typed error.
    #[cfg(feature = "test-hooks")]
    pub async fn inject_qp_error(&mut self) {
        lock(&self.core).break_qp();
        self.shared.kick.notify_one();
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
        if self.try_send_now(&msg)? {
            return Ok(());
        }
        // Boxed: the queued path's state (the wait for room) would otherwise make every
        // send's future several times larger, and a future is moved into place at each call
        // (a copy of its whole size, on the fast path too).
        Box::pin(self.send_queued(msg)).await
    }

    /// Hands the eager messages of `msgs` to the engine under one lock and posts them with
    /// one doorbell, as many at a time as the engine's queue takes; a message above the
    /// eager limit is registered first and handed over on its own, and one above the size
    /// limit is refused as [`Self::send`] refuses it. A message leaves `msgs` only when the
    /// engine takes it, so a future dropped while the queue is full loses none.
    async fn send_batch(&mut self, msgs: &mut Vec<Message>) -> Result<(), TransportError> {
        // One small message (an RPC call's request, a reply): the fast path, as `send`.
        if let [only] = msgs.as_slice() {
            if self.try_send_now(only)? {
                msgs.clear();
                return Ok(());
            }
        }
        // Boxed, as in `send`.
        Box::pin(self.send_batch_queued(msgs)).await
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
        self.with_room(move |core| {
            core.engine.close();
            if core.engine.close_sent() {
                let _ = tx.send(());
            } else {
                core.close_acks.push(tx);
            }
        })
        .await?;
        rx.await.map_err(|_| self.gone())
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

impl Drop for VerbsSender {
    fn drop(&mut self) {
        let mut core = lock(&self.core);
        core.sender_gone();
        // The CLOSE is posted by the driver, not here: a process dropping many connections at
        // once (tests/scale.rs: 2000 halves in one loop) would otherwise fire all their CLOSEs
        // in one burst into the peers' shared receive queue (128 buffers). On soft-RoCE such
        // a burst leaves hundreds of CLOSEs without a completion until `linger` runs out
        // (likely RNR retries of the burst), and teardown takes several times as long
        // (docs/notes/2026-12-02-verbs-rpc-client-without-reader-task.md).
        // The driver spins for the budget meanwhile, as after any activity.
        core.active();
        drop(core);
        self.shared.kick.notify_one();
    }
}

/// The receiving half of a verbs connection.
pub struct VerbsReceiver {
    rx: mpsc::UnboundedReceiver<ToApp>,
    done: Option<Option<Fail>>,
    metrics: Arc<Metrics>,
    shared: Arc<Shared>,
    core: Arc<Mutex<Core>>,
    /// Its place in its thread's poller (`VerbsConfig::poll_together_from`).
    slot: Arc<poller::PollSlot>,
    /// Where the task waiting for a message is woken from other threads (`home.rs`): the
    /// thread it last received on.
    home: Option<home::Home>,
}

impl std::fmt::Debug for VerbsReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsReceiver").finish_non_exhaustive()
    }
}

/// What the receiving half found when it looked under the lock ([`VerbsReceiver::look`]).
enum Look {
    /// The next delivery, taken straight from the engine.
    Got(ToApp),
    /// Completions taken with nothing for this half yet, or deliveries waiting in the
    /// channel: look again.
    Again,
    /// Nothing there.
    Nothing,
}

/// What the receiving half's fast path found ([`VerbsReceiver::recv_now`]).
enum Now {
    /// A plain small message, for the application.
    Got(Message),
    /// Nothing there: the CQ was empty, with nothing delivered ahead.
    Nothing,
    /// Not answered here: the general path ([`VerbsReceiver::next_now`]) looks.
    Ask,
}

impl VerbsReceiver {
    /// Under the lock: the next delivery, taken from the engine on this task when the channel
    /// holds none (deliveries reach the channel only under this lock, so with the channel
    /// empty the engine's are the oldest). Drains the CQ if it holds anything, leaving what
    /// it delivers in the engine for this half: no channel, no backlog count, no hand-off.
    /// A drain that took anything keeps the connection spinning and wakes the driver if it
    /// must act on what was taken.
    fn look(&self, core: &mut Core) -> Look {
        if !self.rx.is_empty() {
            return Look::Again;
        }
        if let Some(d) = core.next_delivery() {
            return Look::Got(d);
        }
        core.receiver_turn = true;
        let (small, took) = core.receive_small();
        core.receiver_turn = false;
        if took == 0 {
            return Look::Nothing;
        }
        core.acted();
        if let Some(m) = small {
            return Look::Got(ToApp::Msg(m));
        }
        // A failure on the way went through the channel, after what was ready.
        if !self.rx.is_empty() {
            return Look::Again;
        }
        core.next_delivery().map_or(Look::Again, Look::Got)
    }

    /// The fast path of `recv` and `try_recv`, taken first: with nothing delivered ahead (no
    /// end state, nothing counted for the channel or waiting in it, nothing ready in the
    /// engine), one look at the CQ under the lock; a plain small message found there
    /// ([`Core::receive_small`]) is returned as it came, with no [`Look`], [`ToApp`] or
    /// [`Self::outcome`] around it (each moves the message once more).
    fn recv_now(&mut self) -> Now {
        if self.done.is_some() || self.shared.backlog.load(Ordering::Acquire) > 0 {
            return Now::Ask;
        }
        // A busy lock: the general path tries it again, and waits if it is still busy.
        let Ok(mut core) = self.core.try_lock() else {
            return Now::Ask;
        };
        if !self.rx.is_empty() || core.engine.has_delivery() {
            return Now::Ask;
        }
        core.receiver_turn = true;
        let (small, took) = core.receive_small();
        core.receiver_turn = false;
        if took == 0 {
            return Now::Nothing;
        }
        core.acted();
        let Some(m) = small else {
            // Completions of other kinds: what they delivered waits in the engine (or, a
            // failure, in the channel), where the general path finds it.
            return Now::Ask;
        };
        drop(core);
        self.metrics.messages_received.incr();
        Now::Got(m)
    }

    /// A delivery taken from the channel: no longer in the backlog the engine watches.
    fn taken_from_channel(&self, item: ToApp) -> ToApp {
        let bytes = match &item {
            ToApp::Msg(m) => m.payload.len() as u64,
            _ => 0,
        };
        let _ = self
            .shared
            .backlog
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(1))
            });
        let _ = self
            .shared
            .backlog_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(bytes))
            });
        if self.shared.watching.load(Ordering::Acquire) {
            self.shared.drained.notify_one();
        }
        item
    }

    /// The next delivery if one is there now: `None` when there is none yet (or the lock is
    /// busy). Most messages of a ping-pong are found here, before any future is made.
    fn next_now(&mut self) -> Option<Option<ToApp>> {
        for round in 0..2 {
            // First round: a message reaches the channel counted in the backlog first
            // (`Core::deliver_ready`), so with none counted the channel is not asked (one
            // load instead of a channel poll per message). The uncounted items (the end, a
            // failure) are seen by `look`, which checks the channel under the lock and sends
            // this loop round again; a busy lock leaves them to `next`, which asks first.
            if round > 0 || self.shared.backlog.load(Ordering::Acquire) > 0 {
                match self.rx.try_recv() {
                    Ok(d) => return Some(Some(self.taken_from_channel(d))),
                    Err(mpsc::error::TryRecvError::Disconnected) => return Some(None),
                    Err(mpsc::error::TryRecvError::Empty) => {}
                }
            }
            let mut core = self.core.try_lock().ok()?;
            match self.look(&mut core) {
                Look::Got(d) => return Some(Some(d)),
                Look::Again => {}
                Look::Nothing => return None,
            }
        }
        None
    }

    /// The next delivery: taken from what was already delivered, else polled from the CQ on
    /// this task while the spin budget runs (the reply of a ping-pong then costs no hop
    /// through the driver or the channel), else awaited from the driver.
    async fn next(&mut self) -> Option<ToApp> {
        let mut looked = false;
        let mut turns = poller::Turns::default();
        // Counts this receiver among its thread's own-task spinners while it spins here.
        let mut own_spin: Option<poller::OwnSpin> = None;
        loop {
            match self.rx.try_recv() {
                Ok(d) => return Some(self.taken_from_channel(d)),
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
            let spin = {
                // The driver holds the lock only briefly; if it does, it is polling anyway.
                let Ok(mut core) = self.core.try_lock() else {
                    tokio::task::yield_now().await;
                    continue;
                };
                match self.look(&mut core) {
                    Look::Got(d) => return Some(d),
                    Look::Again => continue,
                    Look::Nothing => {}
                }
                let now = Instant::now();
                // The lease covers a few of this task's turns (`poller::Turns::hold`).
                let hold = turns.hold(now);
                let spin = core.renew_lease(now, poller::busy_here(now), hold);
                (
                    spin.then_some(core.cfg.poll_together_from),
                    core.cfg.poll_spin,
                )
            };
            let (Some(together_from), _) = spin else {
                let d = self.rx.recv().await;
                // Woken with a message while quiet: the thread is busy (`poller::busy_here`).
                poller::note_busy(Instant::now(), spin.1);
                return d.map(|d| self.taken_from_channel(d));
            };
            if own_spin.is_none() {
                match poller::place(&self.slot, together_from) {
                    poller::Place::Own(counted) => own_spin = Some(counted),
                    poller::Place::Together(waiting) => {
                        // The poller polls the CQ and hands the message over the channel.
                        let d = self.rx.recv().await;
                        drop(waiting);
                        poller::note_busy(Instant::now(), spin.1);
                        return d.map(|d| self.taken_from_channel(d));
                    }
                }
            }
            // From the second turn of this wait on: a few more polls before going through the
            // runtime. The first turn returns at once, so a caller that only looks whether a
            // message is there (the RPC server before it writes its replies) is not held.
            let mut again = false;
            if looked {
                for _ in 0..TIGHT_POLLS {
                    std::hint::spin_loop();
                    let Ok(mut core) = self.core.try_lock() else {
                        continue;
                    };
                    match self.look(&mut core) {
                        Look::Got(d) => return Some(d),
                        Look::Again => {
                            again = true;
                            break;
                        }
                        Look::Nothing => {}
                    }
                }
            }
            looked = true;
            if again {
                continue;
            }
            tokio::select! {
                biased;
                d = self.rx.recv() => return d.map(|d| self.taken_from_channel(d)),
                _ = tokio::task::yield_now() => {}
            }
        }
    }
}

impl MessageReceiver for VerbsReceiver {
    async fn recv(&mut self) -> Result<Option<Message>, TransportError> {
        match &self.done {
            Some(None) => return Ok(None),
            Some(Some(f)) => return Err(f.to_error()),
            None => {}
        }
        let now = match self.recv_now() {
            Now::Got(m) => return Ok(Some(m)),
            Now::Nothing => None,
            Now::Ask => self.next_now(),
        };
        let d = match now {
            Some(d) => d,
            None => {
                if !self.home.as_ref().is_some_and(home::Home::is_here) {
                    self.home = home::Home::here();
                }
                home::homed(self.home.clone(), self.next()).await
            }
        };
        self.outcome(d)
    }

    fn try_recv(&mut self) -> TryRecv {
        match &self.done {
            Some(None) => return TryRecv::Ready(Ok(None)),
            Some(Some(f)) => return TryRecv::Ready(Err(f.to_error())),
            None => {}
        }
        // One look, as `recv` takes first: no spin lease, no wake-up left behind (a busy
        // lock counts as nothing there yet).
        let now = match self.recv_now() {
            Now::Got(m) => return TryRecv::Ready(Ok(Some(m))),
            Now::Nothing => None,
            Now::Ask => self.next_now(),
        };
        match now {
            Some(d) => TryRecv::Ready(self.outcome(d)),
            None => TryRecv::Empty,
        }
    }

    fn has_buffered_message(&self) -> bool {
        !self.rx.is_empty()
    }

    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

impl VerbsReceiver {
    /// What `recv` returns for a delivery (or for the end of the deliveries: `None`), with
    /// the receiver's end state kept for the calls after it.
    fn outcome(&mut self, d: Option<ToApp>) -> Result<Option<Message>, TransportError> {
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
}

impl Drop for VerbsReceiver {
    fn drop(&mut self) {
        // The driver notices the closed delivery channel at its next turn: make it now.
        self.rx.close();
        {
            let mut core = lock(&self.core);
            core.app_lease = None;
            core.active();
        }
        self.shared.kick.notify_one();
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
