//! Polling together: one task per runtime thread that polls, in turn, the completion queues of
//! the receivers waiting on that thread, once many of them spin at once.
//!
//! While its spin budget runs, a receiver waiting for a message polls its connection's CQ on
//! its own task, going through the runtime between polls: a lone ping-pong then takes its
//! reply with no hop. With hundreds of such receivers on one thread, each is a task in the
//! runtime's local queue, and tasks woken from other threads (the device's pump thread) wait
//! behind all of them: tokio's current-thread scheduler serves its injection queue once every
//! 31 local polls. Some connections then get a call through every few milliseconds, others
//! wait for seconds (docs/notes/2026-12-04-scenarios-polled-together.md). Once
//! `VerbsConfig::poll_together_from` receivers spin on one thread, the next ones join the
//! thread's poller instead: one task that polls each of their CQs per turn and hands the
//! messages over through the connections' channels (local wake-ups), so every waiting
//! connection is looked at once per turn and the local queue stays short. While the poller has
//! receivers, every receiver of the thread joins it; it ends when none waits.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use super::Core;

/// Deliveries the pollers made (turns in which a poller took completions from a CQ), for tests.
#[cfg(feature = "test-hooks")]
static POLLED_TOGETHER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook: how many times a thread's poller took completions from a waiting receiver's CQ
/// (all connections of the process).
#[cfg(feature = "test-hooks")]
pub fn polled_together() -> u64 {
    POLLED_TOGETHER.load(Ordering::Relaxed)
}

/// A receiver's place in its thread's poller, made once per receiver.
pub(super) struct PollSlot {
    core: Weak<Mutex<Core>>,
    /// Set while the receiver waits through the poller; cleared by the receiver when it stops
    /// waiting, or by the poller when the connection's spin budget has run out (the driver
    /// then takes the CQ back and sleeps on its events).
    waiting: AtomicBool,
    /// In the poller's list (changed under the poller's lock only).
    listed: AtomicBool,
}

impl PollSlot {
    pub(super) fn new(core: &Arc<Mutex<Core>>) -> Arc<PollSlot> {
        Arc::new(PollSlot {
            core: Arc::downgrade(core),
            waiting: AtomicBool::new(false),
            listed: AtomicBool::new(false),
        })
    }
}

#[derive(Default)]
struct State {
    slots: Vec<Arc<PollSlot>>,
    running: bool,
}

/// The poller of one thread.
#[derive(Default)]
pub(super) struct Poller {
    state: Mutex<State>,
    /// Receivers of this thread spinning on their own task now.
    own: AtomicUsize,
}

thread_local! {
    static POLLER: Arc<Poller> = Arc::new(Poller::default());
}

/// How a receiver that is about to spin waits.
pub(super) enum Place {
    /// On its own task; the guard counts it among its thread's spinning receivers.
    Own(OwnSpin),
    /// Through its thread's poller, which now lists it: it awaits its channel, holding the
    /// guard until it stops waiting.
    Together(Waiting),
}

/// Counts a receiver spinning on its own task until dropped.
pub(super) struct OwnSpin(Arc<Poller>);

impl Drop for OwnSpin {
    fn drop(&mut self) {
        self.0.own.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Keeps a receiver listed as waiting until dropped.
pub(super) struct Waiting(Arc<PollSlot>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.store(false, Ordering::Release);
    }
}

/// Where the receiver of `slot` spins: on its own task while fewer than `from` receivers of
/// this thread do and no poller runs here, else through this thread's poller (started here if
/// need be; without a tokio runtime to start it on, on its own task).
pub(super) fn place(slot: &Arc<PollSlot>, from: usize) -> Place {
    let poller = POLLER.with(Arc::clone);
    let mut st = poller.state.lock().unwrap_or_else(|p| p.into_inner());
    // A poller with receivers is running (it ends only once it has none): while it has
    // them, every receiver of the thread joins it, so none is favoured.
    if st.slots.is_empty() && poller.own.load(Ordering::Relaxed) < from {
        drop(st);
        return poller.own_spin();
    }
    if !st.running {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            drop(st);
            return poller.own_spin();
        };
        st.running = true;
        rt.spawn(poller.clone().run());
    }
    poller.list(&mut st, slot);
    Place::Together(Waiting(slot.clone()))
}

/// Clears the poller's running flag when its task ends, however it ends (its runtime may be
/// shut down with it).
struct Stopped(Arc<Poller>);

impl Drop for Stopped {
    fn drop(&mut self) {
        let mut st = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        st.running = false;
        for s in st.slots.drain(..) {
            s.listed.store(false, Ordering::Relaxed);
        }
    }
}

impl Poller {
    fn own_spin(self: Arc<Self>) -> Place {
        self.own.fetch_add(1, Ordering::Relaxed);
        Place::Own(OwnSpin(self))
    }

    fn list(&self, st: &mut State, slot: &Arc<PollSlot>) {
        slot.waiting.store(true, Ordering::Release);
        if !slot.listed.swap(true, Ordering::Relaxed) {
            st.slots.push(slot.clone());
        }
    }

    /// Turns until no receiver waits: each turn polls every listed CQ once (renewing the
    /// receiver's lease on it while the connection's spin budget runs), then yields.
    async fn run(self: Arc<Self>) {
        let _stopped = Stopped(self.clone());
        let mut turn: Vec<Arc<PollSlot>> = Vec::new();
        loop {
            {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                st.slots.retain(|s| {
                    let keep = s.waiting.load(Ordering::Acquire) && s.core.strong_count() > 0;
                    if !keep {
                        s.listed.store(false, Ordering::Relaxed);
                    }
                    keep
                });
                if st.slots.is_empty() {
                    return;
                }
                turn.extend(st.slots.iter().cloned());
            }
            let now = Instant::now();
            for slot in turn.drain(..) {
                let Some(core) = slot.core.upgrade() else {
                    continue;
                };
                // A half holding the lock is moving the connection on itself.
                let Ok(mut core) = core.try_lock() else {
                    continue;
                };
                if core.took_any() {
                    #[cfg(feature = "test-hooks")]
                    POLLED_TOGETHER.fetch_add(1, Ordering::Relaxed);
                }
                if !core.renew_lease(now) {
                    // Spent: the driver has the CQ back and sleeps on its events.
                    slot.waiting.store(false, Ordering::Release);
                }
            }
            tokio::task::yield_now().await;
        }
    }
}
