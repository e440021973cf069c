//! One completion channel per device, shared by the CQs of every connection of the transport on
//! that device, and the thread that routes its events: the first step of one progress engine
//! per device (docs/verbs.md).
//!
//! A connection's driver arms its own CQ when it goes to sleep; the CQ's next completion puts
//! an event on the device's channel. The pump thread reads it, acknowledges it and hands it to
//! the connection whose CQ it names ([`CqRoute`]): the connection's handler
//! ([`CqRoute::handle_events`]) drains the CQ on this thread while its driver sleeps, and
//! otherwise (or when it cannot) the driver is woken to poll the CQ itself. The channel costs
//! one file descriptor per device instead of one per connection, and no runtime watches a
//! per-connection fd.
//!
//! The pump also reads the device's asynchronous events. When a shared receive queue runs
//! below its low-water mark (`IBV_EVENT_SRQ_LIMIT_REACHED`), the buffers it misses sit in
//! completions nobody has polled yet: those of connections that spin on a runtime busy with
//! other connections (a CQ that spins raises no event). The pump then drains every
//! connection's CQ ([`CqRoute::handle_events`]), arms the limit again and has the queue
//! deepened on a thread of its own (its depth doubles, up to `srq_max_depth`: more messages
//! are in flight at once than it holds), so the senders find buffers instead of retrying on
//! RNR NAKs until each runtime comes round.
//!
//! A thread, not a task, for the reason the rdma_cm pump is one (`cm.rs`): connections of one
//! transport live on several runtimes, and each must keep getting its events when another
//! runtime ends. The thread sleeps in poll(2) while no event comes, and ends once nothing but
//! itself holds the pump (the domain and every connection's route are gone).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sideway::ibverbs::completion::CompletionChannel;
use sideway::ibverbs::device_context::DeviceContext;
use tokio::sync::Notify;
use transport_core::Metrics;

use crate::ffi::{AsyncEvents, CqEvent};

/// How often the idle pump checks whether anything but itself still holds it.
const PUMP_EXIT_CHECK: Duration = Duration::from_secs(1);

/// Moves a connection on from the pump thread at its CQ's event; false when it cannot (its
/// driver is woken instead).
pub(crate) type OnEvent = Arc<dyn Fn() -> bool + Send + Sync>;

/// Where an event for one CQ goes.
struct Route {
    wake: Arc<Notify>,
    metrics: Arc<Metrics>,
    /// Tried first: the connection moved on here, without its driver.
    on_event: Option<OnEvent>,
    /// Drains the connection's CQ when the shared receive queue runs low.
    reclaim: Option<OnEvent>,
    /// Test hook: moves the connection's queue pair to the error state.
    #[cfg(feature = "test-hooks")]
    break_qp: Option<OnEvent>,
}

/// A shared receive queue whose low-water events a pump serves.
pub(crate) trait LowWater: Send + Sync {
    /// Names the queue in the device's asynchronous events.
    fn key(&self) -> usize;
    /// Asks the device for the next low-water event.
    fn arm(&self) -> std::io::Result<()>;
    /// Deepens the queue (up to its capacity); returns its depth after.
    fn grow(&self) -> std::io::Result<usize>;
    /// Whether [`LowWater::grow`] would deepen it.
    fn can_grow(&self) -> bool;
    /// Buffers it holds now.
    fn depth(&self) -> usize;
}

/// Buffers a shared receive queue keeps per connection it serves: past that it grows when a
/// connection is made, before it runs low (a connection in a ping-pong has a message and the
/// next one, or a credit update, in flight). A thousand clients that connect and then call
/// together find the queue grown already: growing it under their calls leaves the calls
/// caught meanwhile retrying on RNR NAKs (docs/notes/2026-12-06-srq-grows.md).
pub(crate) const SHARED_BUFFERS_PER_CONNECTION: usize = 2;

impl<B: crate::ffi::LocalMemory> LowWater for crate::ffi::Srq<B> {
    fn key(&self) -> usize {
        crate::ffi::Srq::key(self)
    }
    fn arm(&self) -> std::io::Result<()> {
        self.arm_limit()
    }
    fn grow(&self) -> std::io::Result<usize> {
        crate::ffi::Srq::grow(self)
    }
    fn can_grow(&self) -> bool {
        self.depth() < self.capacity()
    }
    fn depth(&self) -> usize {
        crate::ffi::Srq::depth(self)
    }
}

/// The pump that serves each shared receive queue's low-water events, by queue key, for the
/// whole process: the transports of a process share a device's context and its one queue of
/// asynchronous events, so whichever pump reads an event hands it on here.
static WATCHED: Mutex<Vec<(usize, Weak<CqPump>)>> = Mutex::new(Vec::new());

fn watched() -> std::sync::MutexGuard<'static, Vec<(usize, Weak<CqPump>)>> {
    WATCHED.lock().unwrap_or_else(|p| p.into_inner())
}

/// A device's shared completion channel and the routes of the CQs on it.
pub(crate) struct CqPump {
    channel: Arc<CompletionChannel>,
    routes: Mutex<HashMap<usize, Route>>,
    events: AsyncEvents,
    /// The domain's shared receive queue, if it has one (not kept alive by the pump).
    low_water: Mutex<Option<Weak<dyn LowWater>>>,
    /// A thread deepens the shared receive queue right now ([`CqPump::grow`]).
    growing: Arc<AtomicBool>,
    /// Routes, that is connections, on this device now.
    connections: Arc<AtomicUsize>,
}

impl CqPump {
    /// Makes the device's completion channel and starts its pump thread.
    pub(crate) fn start(ctx: &Arc<DeviceContext>, device: &str) -> std::io::Result<Arc<CqPump>> {
        let channel = CompletionChannel::new(ctx).map_err(std::io::Error::other)?;
        channel.set_nonblocking(true)?;
        let pump = Arc::new(CqPump {
            channel,
            routes: Mutex::new(HashMap::new()),
            events: AsyncEvents::new(ctx)?,
            low_water: Mutex::new(None),
            growing: Arc::default(),
            connections: Arc::default(),
        });
        let pumped = pump.clone();
        std::thread::Builder::new()
            .name(format!("verbs-cq-{device}"))
            .spawn(move || run(pumped))?;
        Ok(pump)
    }

    /// Serves the low-water events of the domain's shared receive queue `q`: at each, every
    /// route's CQ is drained ([`CqRoute::handle_events`]) and the limit armed again.
    pub(crate) fn watch(self: &Arc<Self>, q: Arc<dyn LowWater>) -> std::io::Result<()> {
        let key = q.key();
        {
            let mut w = watched();
            w.retain(|(k, p)| *k != key && p.strong_count() > 0);
            w.push((key, Arc::downgrade(self)));
        }
        q.arm()?;
        *self.low_water.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::downgrade(&q));
        Ok(())
    }

    /// The shared receive queue ran low: drains every connection's CQ (their completions
    /// hold its buffers), arms the limit again and has the queue grown (on a thread of its
    /// own, which arms the limit at its new quarter). Runs on a pump thread.
    fn reclaim(&self) {
        let handlers: Vec<OnEvent> = self
            .lock()
            .values()
            .filter_map(|r| r.reclaim.clone())
            .collect();
        let mut drained = 0usize;
        for h in &handlers {
            if h() {
                drained += 1;
            }
        }
        tracing::trace!(
            connections = handlers.len(),
            drained,
            "shared receive queue low: CQs drained"
        );
        if let Some(q) = self.queue() {
            if let Err(e) = q.arm() {
                tracing::warn!(error = %e, "ibv_modify_srq (limit) failed; the shared receive queue is no longer watched");
            }
            // Low: more messages are in flight at once than the queue holds.
            self.grow(q);
        }
    }

    /// The domain's shared receive queue, if it has one and it lives.
    fn queue(&self) -> Option<Arc<dyn LowWater>> {
        self.low_water
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
    }

    /// Has the shared receive queue `q` doubled, up to its capacity, on a thread of its own
    /// (registering the fresh buffers takes a while: milliseconds per buffer under
    /// emulation, and the pump thread routes every connection's events meanwhile), unless a
    /// growth runs already. It doubles again while the connections want more
    /// ([`SHARED_BUFFERS_PER_CONNECTION`]), then arms the limit at its new quarter.
    fn grow(&self, q: Arc<dyn LowWater>) {
        if !q.can_grow() || self.growing.swap(true, Ordering::AcqRel) {
            return;
        }
        let growing = self.growing.clone();
        let connections = self.connections.clone();
        let wanted = move |q: &dyn LowWater| {
            q.can_grow()
                && connections
                    .load(Ordering::Relaxed)
                    .saturating_mul(SHARED_BUFFERS_PER_CONNECTION)
                    > q.depth()
        };
        let spawned = std::thread::Builder::new()
            .name("verbs-srq-grow".into())
            .spawn(move || loop {
                let grown = q.grow();
                match &grown {
                    Ok(depth) => tracing::debug!(depth, "shared receive queue grown"),
                    Err(e) => {
                        tracing::warn!(error = %e, "the shared receive queue could not grow");
                    }
                }
                if let Err(e) = q.arm() {
                    tracing::warn!(error = %e, "ibv_modify_srq (limit) failed");
                }
                // A growth that failed is not tried again until the next event asks.
                if grown.is_ok() && wanted(&*q) {
                    continue;
                }
                growing.store(false, Ordering::Release);
                // A connection made after the look above, whose own look found this growth
                // still running, is served here.
                if grown.is_err() || !wanted(&*q) || growing.swap(true, Ordering::AcqRel) {
                    break;
                }
            });
        if let Err(e) = spawned {
            self.growing.store(false, Ordering::Release);
            tracing::warn!(error = %e, "no thread to grow the shared receive queue");
        }
    }

    /// The channel to create CQs on.
    pub(crate) fn channel(&self) -> &Arc<CompletionChannel> {
        &self.channel
    }

    /// Routes the events of the CQ named `cq_key` ([`crate::ffi::Endpoint::cq_key`]) to the
    /// returned route's [`CqRoute::woken`], counting the pump's system calls in `metrics`,
    /// until the route drops. Drop the route before the CQ.
    pub(crate) fn route(self: &Arc<Self>, cq_key: usize, metrics: Arc<Metrics>) -> CqRoute {
        let wake = Arc::new(Notify::new());
        let connections = {
            let mut routes = self.lock();
            routes.insert(
                cq_key,
                Route {
                    wake: wake.clone(),
                    metrics,
                    on_event: None,
                    reclaim: None,
                    #[cfg(feature = "test-hooks")]
                    break_qp: None,
                },
            );
            self.connections.store(routes.len(), Ordering::Relaxed);
            routes.len()
        };
        // More connections than the shared receive queue keeps buffers for: it grows now,
        // ahead of their messages.
        if let Some(q) = self.queue() {
            if connections.saturating_mul(SHARED_BUFFERS_PER_CONNECTION) > q.depth() {
                self.grow(q);
            }
        }
        CqRoute {
            pump: self.clone(),
            cq_key,
            wake,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Route>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Test hook: moves the queue pair of the `turn`-th connection on this device (modulo
    /// their number, in no particular order) to the error state; whether one was broken.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn break_one_qp(&self, turn: usize) -> bool {
        let hooks: Vec<OnEvent> = self
            .lock()
            .values()
            .filter_map(|r| r.break_qp.clone())
            .collect();
        if hooks.is_empty() {
            return false;
        }
        let n = hooks.len();
        (0..n).any(|i| hooks[(turn + i) % n]())
    }
}

/// One CQ's place in its device's pump: wakes its owner at each event of the CQ.
pub(crate) struct CqRoute {
    pump: Arc<CqPump>,
    cq_key: usize,
    wake: Arc<Notify>,
}

impl CqRoute {
    /// Completes at the CQ's next event since the last call (an event that came while nobody
    /// waited is kept: the next call completes at once).
    pub(crate) async fn woken(&self) {
        self.wake.notified().await
    }

    /// Lets the pump thread move the connection on itself: at the CQ's events (`on_event`
    /// returns whether it did; the owner is woken only when it could not), and when the
    /// device's shared receive queue runs low (`reclaim` drains the CQ, returning whether it
    /// took anything).
    pub(crate) fn handle_events(
        &self,
        on_event: OnEvent,
        reclaim: OnEvent,
        #[cfg(feature = "test-hooks")] break_qp: OnEvent,
    ) {
        let mut routes = self.pump.lock();
        if let Some(r) = routes.get_mut(&self.cq_key) {
            if Arc::ptr_eq(&r.wake, &self.wake) {
                r.on_event = Some(on_event);
                r.reclaim = Some(reclaim);
                #[cfg(feature = "test-hooks")]
                {
                    r.break_qp = Some(break_qp);
                }
            }
        }
    }
}

impl Drop for CqPump {
    fn drop(&mut self) {
        watched().retain(|(_, p)| p.strong_count() > 0);
    }
}

impl Drop for CqRoute {
    fn drop(&mut self) {
        let mut routes = self.pump.lock();
        // Removed only if it is still this route's entry.
        if routes
            .get(&self.cq_key)
            .is_some_and(|r| Arc::ptr_eq(&r.wake, &self.wake))
        {
            routes.remove(&self.cq_key);
            self.pump.connections.store(routes.len(), Ordering::Relaxed);
        }
    }
}

/// Reads the device's asynchronous events until none is left; a shared receive queue that
/// ran low is reclaimed by the pump that watches it ([`CqPump::watch`]).
fn async_events(pump: &CqPump) {
    loop {
        match pump.events.next() {
            Ok(Some(ev)) => {
                let Some(key) = ev.srq_limit_reached() else {
                    // Queue pairs and CQs report their failures through their work
                    // completions too; the event only says it first.
                    tracing::debug!(
                        event_type = ev.event_type(),
                        "verbs asynchronous event (enum ibv_event_type)"
                    );
                    continue;
                };
                let owner = watched()
                    .iter()
                    .find(|(k, _)| *k == key)
                    .and_then(|(_, p)| p.upgrade());
                // Acknowledged after the look-up: until then the SRQ cannot be destroyed.
                drop(ev);
                if let Some(owner) = owner {
                    owner.reclaim();
                }
            }
            Ok(None) => return,
            Err(e) => {
                // Another pump of the device may have read it first (EAGAIN is `None`);
                // anything else is left for the next wake-up.
                tracing::debug!(error = %e, "ibv_get_async_event failed");
                return;
            }
        }
    }
}

fn run(pump: Arc<CqPump>) {
    let fd = pump.channel.as_raw_fd();
    let async_fd = pump.events.fd();
    let mut watch_device = true;
    loop {
        if Arc::strong_count(&pump) <= 1 {
            break;
        }
        // Both descriptors stay open while `pump` lives (held here).
        let polled = if watch_device {
            crate::ffi::wait_readable_any([fd, async_fd], PUMP_EXIT_CHECK)
        } else {
            crate::ffi::wait_readable(fd, PUMP_EXIT_CHECK).map(|cq| [cq, false])
        };
        match polled {
            Ok([cq, dev]) => {
                if dev {
                    async_events(&pump);
                }
                if !cq {
                    continue;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if watch_device && crate::ffi::wait_readable(fd, Duration::ZERO).is_ok() => {
                // The device's event descriptor failed, not the channel: completions go on.
                tracing::warn!(error = %e, "poll(2) on the device's asynchronous events failed; the shared receive queue is no longer watched");
                watch_device = false;
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "poll(2) on the completion channel failed; verbs completion events stop");
                for r in pump.lock().values() {
                    r.wake.notify_one();
                }
                break;
            }
        }
        // Drain: the fd is level-triggered, so anything left wakes the next poll.
        let mut first: Option<Arc<Metrics>> = None;
        let mut broken = None;
        loop {
            match CqEvent::next(&pump.channel) {
                Ok(Some(ev)) => {
                    let routes = pump.lock();
                    let target = routes.get(&ev.cq_key()).map(|r| {
                        // One read(2) per event.
                        r.metrics.syscalls.incr();
                        first.get_or_insert_with(|| r.metrics.clone());
                        (r.wake.clone(), r.on_event.clone())
                    });
                    drop(routes);
                    // Acknowledged after the look-up: until then the CQ cannot be destroyed.
                    // The handler below reaches the CQ only through its connection, which
                    // drops the route before it destroys the CQ.
                    drop(ev);
                    if let Some((wake, on_event)) = target {
                        if !on_event.is_some_and(|f| f()) {
                            wake.notify_one();
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    broken = Some(e);
                    break;
                }
            }
        }
        // The read that found the channel empty (or failed).
        if let Some(m) = first {
            m.syscalls.incr();
        }
        if let Some(e) = broken {
            // No event can be told apart any more: every driver polls its CQ once more (a
            // failed device shows there as flushed work or a QP in error) and then relies on
            // its deadlines; the pump ends rather than spin on a channel that keeps failing.
            tracing::error!(error = %e, "ibv_get_cq_event failed; verbs completion events stop");
            for r in pump.lock().values() {
                r.wake.notify_one();
            }
            break;
        }
    }
}
