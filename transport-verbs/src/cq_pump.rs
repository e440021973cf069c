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
//! A thread, not a task, for the reason the rdma_cm pump is one (`cm.rs`): connections of one
//! transport live on several runtimes, and each must keep getting its events when another
//! runtime ends. The thread sleeps in poll(2) while no event comes, and ends once nothing but
//! itself holds the pump (the domain and every connection's route are gone).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sideway::ibverbs::completion::CompletionChannel;
use sideway::ibverbs::device_context::DeviceContext;
use tokio::sync::Notify;
use transport_core::Metrics;

use crate::ffi::CqEvent;

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
}

/// A device's shared completion channel and the routes of the CQs on it.
pub(crate) struct CqPump {
    channel: Arc<CompletionChannel>,
    routes: Mutex<HashMap<usize, Route>>,
}

impl CqPump {
    /// Makes the device's completion channel and starts its pump thread.
    pub(crate) fn start(ctx: &Arc<DeviceContext>, device: &str) -> std::io::Result<Arc<CqPump>> {
        let channel = CompletionChannel::new(ctx).map_err(std::io::Error::other)?;
        channel.set_nonblocking(true)?;
        let pump = Arc::new(CqPump {
            channel,
            routes: Mutex::new(HashMap::new()),
        });
        let pumped = pump.clone();
        std::thread::Builder::new()
            .name(format!("verbs-cq-{device}"))
            .spawn(move || run(pumped))?;
        Ok(pump)
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
        self.lock().insert(
            cq_key,
            Route {
                wake: wake.clone(),
                metrics,
                on_event: None,
            },
        );
        CqRoute {
            pump: self.clone(),
            cq_key,
            wake,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Route>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
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

    /// Lets the pump thread move the connection on itself at the CQ's events (`on_event`
    /// returns whether it did); the owner is woken only when it could not.
    pub(crate) fn handle_events(&self, on_event: OnEvent) {
        let mut routes = self.pump.lock();
        if let Some(r) = routes.get_mut(&self.cq_key) {
            if Arc::ptr_eq(&r.wake, &self.wake) {
                r.on_event = Some(on_event);
            }
        }
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
        }
    }
}

fn run(pump: Arc<CqPump>) {
    let fd = pump.channel.as_raw_fd();
    loop {
        if Arc::strong_count(&pump) <= 1 {
            break;
        }
        // `fd` stays open while `pump` lives (held here).
        match crate::ffi::wait_readable(fd, PUMP_EXIT_CHECK) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
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
