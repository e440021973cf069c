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

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

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
    /// Until when (microseconds since [`epoch`]; 0: not) the thread is busy: the poller took
    /// completions, or a receiver was woken with a message, within the last spin budget. Its
    /// receivers spin on with it, quiet or not ([`busy_here`]).
    busy_until: AtomicU64,
}

/// A receiver of this thread got a message at `now` after sleeping: the thread stays busy for
/// `budget` (zero: pure event mode, nothing spins).
pub(super) fn note_busy(now: Instant, budget: Duration) {
    POLLER.with(|p| p.note_busy(now, budget));
}

/// Turns that a receiver's lease on the CQ covers ([`Turns::hold`]).
const HOLD_TURNS: u32 = 3;

/// The times of a waiting receiver's (or a poller's) turns: how long its lease must cover.
#[derive(Default)]
pub(super) struct Turns(Option<Instant>);

impl Turns {
    /// A turn at `now`: the lease covers a few turns as long as the last one took. With
    /// hundreds of tasks on the thread, a turn may come round later than the spin budget, and
    /// a lease that lapsed in between would send the connection to CQ events while it is
    /// still polled.
    pub(super) fn hold(&mut self, now: Instant) -> Duration {
        let last = self.0.replace(now);
        last.map_or(Duration::ZERO, |t| {
            now.saturating_duration_since(t) * HOLD_TURNS
        })
    }
}

/// The clock `Poller::busy_until` counts from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn micros(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch()).as_micros()).unwrap_or(u64::MAX)
}

/// Whether a message reached this thread within the spin budget before `now` (the poller
/// took completions, or a receiver was woken with one): a receiver of the thread then spins
/// (and, with many, waits through the poller) even if its own connection has been quiet for
/// longer. Served in turn, hundreds of connections each get a message only every few
/// milliseconds, longer than their own budget: without this, every message would come through
/// a CQ event (arming, the pump thread, a wake-up across threads) while the thread is busy
/// anyway.
pub(super) fn busy_here(now: Instant) -> bool {
    POLLER.with(|p| p.busy_at(now))
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
    /// Whether the thread is busy at `now` ([`busy_here`]).
    fn busy_at(&self, now: Instant) -> bool {
        micros(now) < self.busy_until.load(Ordering::Relaxed)
    }

    /// A message reached the thread at `now`: busy for `budget` from then (none for a zero
    /// budget, pure event mode; a later note is never shortened by an earlier one).
    fn note_busy(&self, now: Instant, budget: Duration) {
        if !budget.is_zero() {
            self.busy_until
                .fetch_max(micros(now + budget), Ordering::Relaxed);
        }
    }

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
        let mut turns = Turns::default();
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
            let hold = turns.hold(now);
            let busy = self.busy_at(now);
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
                    self.note_busy(now, core.cfg.poll_spin);
                }
                if !core.renew_lease(now, busy, hold) {
                    // Spent: the driver has the CQ back and sleeps on its events.
                    slot.waiting.store(false, Ordering::Release);
                }
            }
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message noted on a thread keeps that thread busy for the budget, no longer, and only
    /// that thread; a zero budget (pure event mode) never makes it busy.
    #[test]
    fn a_thread_is_busy_for_the_budget_after_a_message() {
        let t0 = Instant::now();
        let budget = Duration::from_millis(10);
        assert!(!busy_here(t0));
        note_busy(t0, Duration::ZERO);
        assert!(!busy_here(t0), "event mode does not spin");
        note_busy(t0, budget);
        assert!(busy_here(t0 + Duration::from_millis(9)));
        assert!(!busy_here(t0 + Duration::from_millis(11)));
        let elsewhere = std::thread::spawn(move || busy_here(t0 + Duration::from_millis(1)));
        assert!(!elsewhere.join().expect("thread"), "per thread");
        // An earlier note does not shorten a later one.
        note_busy(t0 + Duration::from_millis(5), budget);
        note_busy(t0, budget);
        assert!(busy_here(t0 + Duration::from_millis(14)));
    }
}
