//! How a half of a shared-memory connection waits for its peer: looks between turns of the
//! runtime, bursts of looks in a lockstep, yielding its thread when the peer shares its CPU,
//! and sleeping at once when none of that pays, learnt per half from how its waits ended.
//! Plain data: the connection ([`crate::conn`]) does the looking and the sleeping.

use std::time::{Duration, Instant};

use transport_core::Metrics;

/// Spins in a row that ran out before a half changes how it waits: from looking between
/// turns of the runtime to also yielding its thread, and from that to sleeping at once (but for
/// a probe every [`PROBE_EVERY`] waits).
const MISSES_BEFORE_SLEEPING: u32 = 4;
/// Every this many waits, a half that stopped spinning spins once more, to see whether the
/// peer now answers within the budget (it moved to another CPU, the load changed).
const PROBE_EVERY: u32 = 64;
/// How long a receiving half that looks between turns of the runtime looks again at once, in a
/// busy loop, before each turn, when it is in a lockstep with the peer ([`Lockstep`]): an answer
/// from a peer on another CPU (a round trip, about a microsecond) is then seen without a turn,
/// each of which costs a system call (tokio polls its driver, `epoll_wait`, before it runs a
/// yielded task again). Other tasks on the thread wait at most this long for theirs.
const BURST: Duration = Duration::from_micros(2);
/// Busy looks of a burst between two readings of the clock: reading it (`clock_gettime`,
/// in the vDSO) takes longer than a look, so reading it after every look more than doubled
/// the time from a message's arrival to the look that sees it (`perf record` of RPC calls
/// across CPUs: 40% of the samples in the clock and its arithmetic, 29% in the looks).
const LOOKS_PER_CLOCK: u32 = 8;

/// Whether a receiving half is in a lockstep with the peer: its side sent something since the
/// last message came, and has at most one more message unanswered than ever before (a ping,
/// one RPC call at a time, a server between requests). Then nothing but the peer's answer can
/// be due, and a burst of looks holds nothing back. Otherwise what the peer waits for may be
/// this thread's to send next: an RPC client's calls, woken by the replies it just read, or
/// pipelined, yield a turn of the runtime to write their requests together, and bursts on the
/// thread hold them back (`bench` RPC calls of 1 KiB, 16 in flight, bursting whenever spinning:
/// on average 3.4-3.8 calls in flight when a call started instead of 9.4, and fewer calls a
/// second). Such a pipeline still drains to one call out now and then (in about one call of
/// 12-15 there), and the burst that follows holds the other calls' write back for at most
/// [`BURST`]: 8.2-8.9 in flight.
///
/// "Than ever before": messages that are never answered (a mode chosen in a first message,
/// oneway calls) would otherwise count as unanswered for good. One that keeps coming (oneway
/// calls between the twoway ones) ends the bursts for the connection: it waits as it did
/// without them.
#[derive(Debug, Default)]
pub(crate) struct Lockstep {
    /// The fewest messages unanswered seen so far (`None`: none seen yet).
    base: Option<u64>,
    /// Messages this side had sent when the last message came.
    sent_then: u64,
}

impl Lockstep {
    /// A message came: what this side sent so far has had its answer, if any.
    pub(crate) fn came(&mut self, metrics: &Metrics) {
        self.sent_then = metrics.messages_sent.get();
    }

    pub(crate) fn check(&mut self, metrics: &Metrics) -> bool {
        let sent = metrics.messages_sent.get();
        let unanswered = sent.saturating_sub(metrics.messages_received.get());
        let base = self.base.get_or_insert(unanswered);
        *base = (*base).min(unanswered);
        sent != self.sent_then && unanswered <= *base + 1
    }
}

/// How a half waits before it sleeps ([`Spin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Looks between turns of the runtime (in a lockstep, again at once for [`BURST`] before
    /// each turn): pays when the peer runs on another CPU.
    Turns,
    /// Also yields its thread (`sched_yield`) between looks: pays when the peer shares this
    /// CPU and is runnable (a ping-pong on one CPU then goes back and forth without a system
    /// call to wake either side). In a lockstep it yields and looks again at once for
    /// [`BURST`] before each turn of the runtime, as [`Mode::Turns`] busy-looks: a turn costs
    /// an `epoll_wait`, which on one CPU was half the system calls of an RPC call (4.1 a call
    /// with a turn after every yield, 2.1 without).
    Yields,
    /// Sleeps at once: neither paid.
    Sleeps,
}

/// How a half waits before it sleeps, learnt from how its waits ended.
#[derive(Debug)]
pub(crate) struct Spin {
    budget: Duration,
    mode: Mode,
    misses: u32,
    waits: u32,
}

impl Spin {
    pub(crate) fn new(budget: Duration) -> Spin {
        Spin {
            budget,
            mode: Mode::Turns,
            misses: 0,
            waits: 0,
        }
    }

    /// The spinning of a wait that begins now.
    pub(crate) fn begin(&mut self) -> Spinning {
        self.waits = self.waits.wrapping_add(1);
        // Now and then a half that yields or sleeps tries looking between turns again: the peer
        // may have moved to another CPU, or the quiet that taught it may be over.
        let probe = self.mode != Mode::Turns && self.waits % PROBE_EVERY == 0;
        let mode = if probe { Mode::Turns } else { self.mode };
        // A probe only needs to see whether the peer answers at once: a fifth of the budget,
        // so that probing costs a half that cannot gain from it little.
        let budget = match mode {
            Mode::Sleeps => Duration::ZERO,
            _ if probe => self.budget / 5,
            _ => self.budget,
        };
        Spinning {
            budget,
            mode,
            probe,
            from: None,
            burst: match mode {
                Mode::Turns | Mode::Yields => BURST.min(budget),
                Mode::Sleeps => Duration::ZERO,
            },
            burst_from: None,
            unclocked: 0,
            spun: false,
            ended: false,
        }
    }

    /// How the wait `w` ended: `found` while spinning (a hit), or it is going to sleep.
    pub(crate) fn end(&mut self, w: &mut Spinning, found: bool) {
        if w.ended || !w.spun {
            return;
        }
        w.ended = true;
        if found {
            // What paid is kept (a probe that hit goes back to looking between turns).
            self.mode = w.mode;
            self.misses = 0;
            return;
        }
        if w.probe {
            return; // the mode stays what it was
        }
        self.misses = self.misses.saturating_add(1);
        if self.misses >= MISSES_BEFORE_SLEEPING {
            self.misses = 0;
            self.mode = match w.mode {
                Mode::Turns => Mode::Yields,
                Mode::Yields | Mode::Sleeps => Mode::Sleeps,
            };
        }
    }
}

/// One wait's spinning ([`Spin::begin`]).
#[derive(Debug)]
pub(crate) struct Spinning {
    budget: Duration,
    mode: Mode,
    /// A probe of [`Mode::Turns`] by a half that yields or sleeps.
    probe: bool,
    from: Option<Instant>,
    /// How long the busy looks before a turn of the runtime last ([`BURST`], at most the
    /// budget; zero for a half that sleeps at once).
    burst: Duration,
    /// When the busy looks since the last turn of the runtime began.
    burst_from: Option<Instant>,
    /// Busy looks since the clock was last read ([`LOOKS_PER_CLOCK`]).
    unclocked: u32,
    spun: bool,
    ended: bool,
}

/// What a spinning half does after a look that found nothing ([`Spinning::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Looks again at once (a busy loop, within [`BURST`]).
    Look,
    /// Looks again after a turn of the runtime (`tokio::task::yield_now`).
    Turn,
    /// The budget ran out: sleep.
    Sleep,
}

impl Spinning {
    /// What to do after a look that found nothing: look again at once, look after a turn of
    /// the runtime, or sleep (the budget has run out). In [`Mode::Turns`] a half in a
    /// `lockstep` with the peer ([`Lockstep`]) looks again at once for up to [`BURST`], then
    /// takes a turn (so other tasks, an RPC server writing its replies, run between bursts),
    /// and so on; otherwise it takes a turn after every look. In [`Mode::Yields`] its thread
    /// yields (`sched_yield`) before every look, in bursts or not.
    pub(crate) fn next(&mut self, lockstep: bool) -> Next {
        if self.budget.is_zero() || self.ended {
            return Next::Sleep;
        }
        if lockstep
            && self.mode == Mode::Turns
            && self.burst_from.is_some()
            && self.unclocked < LOOKS_PER_CLOCK
        {
            // Within a burst: look again without reading the clock, which takes longer than
            // a look.
            self.unclocked += 1;
            std::hint::spin_loop();
            return Next::Look;
        }
        self.unclocked = 0;
        let now = Instant::now();
        if now.duration_since(*self.from.get_or_insert(now)) >= self.budget {
            return Next::Sleep;
        }
        self.spun = true;
        if lockstep && now.duration_since(*self.burst_from.get_or_insert(now)) < self.burst {
            match self.mode {
                Mode::Yields => std::thread::yield_now(),
                Mode::Turns | Mode::Sleeps => std::hint::spin_loop(),
            }
            return Next::Look;
        }
        // The looks after the turn are a burst of their own.
        self.burst_from = None;
        if self.mode == Mode::Yields {
            std::thread::yield_now();
        }
        Next::Turn
    }
}

#[cfg(test)]
mod tests;
