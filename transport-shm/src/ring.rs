//! A single-producer single-consumer ring of 64-byte entries in a region shared with the peer.
//!
//! # Layout
//!
//! The region is a slice of 64-bit words (a mapping of shared memory on both sides; any slice
//! of `AtomicU64` in tests):
//!
//! | words | what | written by |
//! |---|---|---|
//! | 0 | `tail`: entries pushed so far | the producer |
//! | 1 | the producer's wait for room: odd while it waits | the producer |
//! | 8 | `head`: entries popped so far | the consumer |
//! | 9 | the consumer's sleep: odd while it sleeps | the consumer |
//! | 16.. | `entries` slots of [`ENTRY_WORDS`] words each | the producer |
//!
//! The two indices are a cache line apart, so each side writes a line of its own. A consumer
//! may store `head` only every few pops ([`Consumer::publish_every`]): its line then stays
//! shared in both caches while messages flow, and is written only as often as the producer
//! needs the room. Indices count up from 0 and are never reduced modulo the ring's size in
//! memory: slot `i % entries` holds entry `i`, and `tail - head` is the number of entries in
//! the ring (as far as the producer knows: at most that many).
//!
//! # Who trusts what
//!
//! Each side keeps its own index locally and only ever stores it; it never reads it back from
//! the region, where the peer could have changed it. The peer's index is loaded once per
//! refresh and must lie where an honest peer could have put it:
//!
//! - the consumer accepts a `tail` that did not go back and is at most `entries` ahead of its
//!   own `head`;
//! - the producer accepts a `head` that did not go back and is not ahead of its own `tail`.
//!
//! Anything else is [`RingError::Corrupt`], and the side that saw it stays failed. Slots are
//! found by masking, so no value of any word can make either side index outside the region;
//! an entry's bytes are copied out in one pass (relaxed atomic loads, no torn reads of a
//! word, no undefined behaviour if the peer writes meanwhile) and validated by whoever reads
//! them. Every operation is constant time and allocates nothing.
//!
//! # Ordering
//!
//! The producer writes an entry's words, then publishes `tail` with a release store; the
//! consumer loads `tail` with acquire, copies the entries, then publishes `head` with a release
//! store (so its reads are done before the producer may reuse the slots), which the producer
//! loads with acquire before writing over them.
//!
//! # Sleeping and waking
//!
//! A side that finds nothing to do (the consumer an empty ring, the producer a full one) may
//! sleep until the other acts, woken by a doorbell the two share outside the ring (a byte on
//! the set-up socket, an eventfd: the caller's choice). The ring says when to ring it, with a
//! word per side that counts its sleeps (odd while asleep):
//!
//! 1. The sleeper announces its sleep (stores an odd count), then looks once more
//!    ([`Consumer::prepare_sleep`], [`Producer::prepare_wait_room`]); it sleeps only if there
//!    is still nothing, and withdraws the announcement when it wakes ([`Consumer::woke`],
//!    [`Producer::room_woke`]).
//! 2. The other side, after publishing its index (a lazy consumer: when it stores `head`, and
//!    before it sleeps itself, [`Consumer::publish`]), reads the sleeper's word
//!    ([`Producer::should_wake`], [`Consumer::should_signal_room`]) and rings the doorbell
//!    when the sleeper announced a sleep it has not rung for yet: once per sleep, however
//!    many entries it pushes meanwhile.
//!
//! A sequentially consistent fence sits between each side's store and its load, so at least
//! one of the two sees the other's: either the sleeper's last look finds the entry (or the
//! room), or the other side sees the announcement and rings. No wake-up is lost. The peer's
//! word is only a hint: any value it writes there makes this side ring too often (one
//! doorbell per entry at worst) or not at all (the peer sleeps through its own fault); it can
//! never make this side index, allocate or wait.

use std::ops::Deref;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// Words in one entry.
pub const ENTRY_WORDS: usize = 8;
/// Bytes in one entry: a cache line.
pub const ENTRY_BYTES: usize = ENTRY_WORDS * 8;
/// The most entries a ring may have.
pub const MAX_ENTRIES: usize = 1 << 20;

/// Word of the producer's index.
const TAIL: usize = 0;
/// Word of the producer's count of waits for room (odd while it waits).
const WAIT_ROOM: usize = 1;
/// Word of the consumer's index.
const HEAD: usize = 8;
/// Word of the consumer's count of sleeps (odd while it sleeps).
const SLEEP: usize = 9;
/// First word of the first slot.
const SLOTS: usize = 16;

/// Why a ring cannot be built or used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The ring's size is not a power of two from 2 to [`MAX_ENTRIES`].
    #[error("a ring of {0} entries: a power of two from 2 to 2^20 is needed")]
    BadSize(usize),
    /// The region is smaller than the layout needs.
    #[error("a region of {got} words, the ring needs {need}")]
    RegionTooSmall {
        /// Words in the region.
        got: usize,
        /// Words the layout needs ([`RingLayout::words`]).
        need: usize,
    },
    /// The peer's index is where no honest peer could have put it.
    #[error("the peer's {index} is {value}, outside {low}..={high}: the ring is not used again")]
    Corrupt {
        /// Which index: `tail` (read by the consumer) or `head` (read by the producer).
        index: &'static str,
        /// What it read.
        value: u64,
        /// The least value it could accept.
        low: u64,
        /// The greatest value it could accept.
        high: u64,
    },
}

/// The size of a ring, and so of its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    entries: usize,
}

impl RingLayout {
    /// A ring of `entries` slots: a power of two from 2 to [`MAX_ENTRIES`].
    pub fn new(entries: usize) -> Result<RingLayout, RingError> {
        if !(2..=MAX_ENTRIES).contains(&entries) || !entries.is_power_of_two() {
            return Err(RingError::BadSize(entries));
        }
        Ok(RingLayout { entries })
    }

    /// Slots in the ring.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Words the region must hold.
    pub fn words(&self) -> usize {
        SLOTS + self.entries * ENTRY_WORDS
    }

    /// Bytes the region must hold.
    pub fn bytes(&self) -> usize {
        self.words() * 8
    }

    fn check<R: Deref<Target = [AtomicU64]>>(&self, region: &R) -> Result<(), RingError> {
        if region.len() < self.words() {
            return Err(RingError::RegionTooSmall {
                got: region.len(),
                need: self.words(),
            });
        }
        Ok(())
    }

    /// The words of entry `index`'s slot.
    fn slot<'r>(&self, region: &'r [AtomicU64], index: u64) -> &'r [AtomicU64] {
        // Masked: in bounds whatever `index` is (`check` saw the region's length).
        let start = SLOTS + (index as usize & (self.entries - 1)) * ENTRY_WORDS;
        &region[start..start + ENTRY_WORDS]
    }
}

/// The writing side of a ring.
#[derive(Debug)]
pub struct Producer<R> {
    region: R,
    layout: RingLayout,
    /// Entries pushed: the truth, never read back from the region.
    tail: u64,
    /// The peer's `head` when last read (validated).
    head: u64,
    /// This side's count of waits for room (odd while waiting), kept locally.
    waits: u64,
    /// The consumer's sleep count this side last rang the doorbell for.
    rang_for: u64,
    failed: Option<RingError>,
}

impl<R: Deref<Target = [AtomicU64]>> Producer<R> {
    /// The producer of a ring in `region`, which starts empty: stores `tail` = 0. The consumer
    /// starts at 0 too (a fresh memfd is zeroed).
    pub fn new(region: R, layout: RingLayout) -> Result<Producer<R>, RingError> {
        layout.check(&region)?;
        region[TAIL].store(0, Ordering::Release);
        region[WAIT_ROOM].store(0, Ordering::Release);
        Ok(Producer {
            region,
            layout,
            tail: 0,
            head: 0,
            waits: 0,
            rang_for: 0,
            failed: None,
        })
    }

    /// Pushes `entry`: `Ok(true)` once it is in the ring, `Ok(false)` when the ring is full
    /// (nothing written), or the error that failed this ring.
    pub fn try_push(&mut self, entry: &[u8; ENTRY_BYTES]) -> Result<bool, RingError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let entries = self.layout.entries as u64;
        if self.tail - self.head == entries && !self.refresh()? {
            return Ok(false);
        }
        let slot = self.layout.slot(&self.region, self.tail);
        for (word, bytes) in slot.iter().zip(entry.chunks_exact(8)) {
            let v = u64::from_ne_bytes(bytes.try_into().expect("8-byte chunks"));
            word.store(v, Ordering::Relaxed);
        }
        self.tail += 1;
        self.region[TAIL].store(self.tail, Ordering::Release);
        Ok(true)
    }

    /// Reads the consumer's `head` once and checks it: whether a slot is free now.
    fn refresh(&mut self) -> Result<bool, RingError> {
        let seen = self.region[HEAD].load(Ordering::Acquire);
        if seen < self.head || seen > self.tail {
            let e = RingError::Corrupt {
                index: "head",
                value: seen,
                low: self.head,
                high: self.tail,
            };
            self.failed = Some(e);
            return Err(e);
        }
        self.head = seen;
        Ok(self.tail - self.head < self.layout.entries as u64)
    }

    /// Entries pushed so far.
    pub fn pushed(&self) -> u64 {
        self.tail
    }

    /// Free slots as of the consumer's `head` read now (checked as in [`Producer::try_push`]).
    pub fn room(&mut self) -> Result<usize, RingError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        self.refresh()?;
        Ok(self.layout.entries - (self.tail - self.head) as usize)
    }

    /// After pushing: whether the consumer sleeps, announced a sleep this side has not rung
    /// for yet, and so must be woken (the caller rings the doorbell). True once per sleep.
    pub fn should_wake(&mut self) -> bool {
        // Orders this side's `tail` store before the load of the consumer's word (the
        // consumer orders its announcement before its last look the same way).
        fence(Ordering::SeqCst);
        let sleeps = self.region[SLEEP].load(Ordering::Relaxed);
        if sleeps % 2 == 1 && sleeps != self.rang_for {
            self.rang_for = sleeps;
            return true;
        }
        false
    }

    /// Before sleeping on a ring without room for `need` entries (a message's entries go in
    /// together): announces the wait for room, then looks once more. `Ok(true)`: still too
    /// full, sleep until the doorbell (the consumer that frees a slot next sees the
    /// announcement: [`Consumer::should_signal_room`]), then call [`Producer::room_woke`] and
    /// look again; `Ok(false)`: the room came meanwhile, do not sleep (the announcement is
    /// withdrawn).
    pub fn prepare_wait_room(&mut self, need: usize) -> Result<bool, RingError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.waits % 2 == 0 {
            self.waits += 1;
            self.region[WAIT_ROOM].store(self.waits, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        self.refresh()?;
        if self.layout.entries - (self.tail - self.head) as usize >= need {
            self.room_woke();
            return Ok(false);
        }
        Ok(true)
    }

    /// Withdraws the announcement of [`Producer::prepare_wait_room`]: after the doorbell (or
    /// a time limit), before pushing again.
    pub fn room_woke(&mut self) {
        if self.waits % 2 == 1 {
            self.waits += 1;
            self.region[WAIT_ROOM].store(self.waits, Ordering::Relaxed);
        }
    }
}

/// The reading side of a ring.
#[derive(Debug)]
pub struct Consumer<R> {
    region: R,
    layout: RingLayout,
    /// Entries popped: the truth, never read back from the region.
    head: u64,
    /// The peer's `tail` when last read (validated).
    tail: u64,
    /// This side's count of sleeps (odd while asleep), kept locally.
    sleeps: u64,
    /// The producer's wait count this side last rang the doorbell for.
    rang_for: u64,
    /// The `head` last stored in the region.
    published: u64,
    /// Pops after which `head` is stored ([`Consumer::publish_every`]).
    publish_every: u64,
    /// A `head` was stored since [`Consumer::should_signal_room`] last looked.
    unchecked: bool,
    failed: Option<RingError>,
}

impl<R: Deref<Target = [AtomicU64]>> Consumer<R> {
    /// The consumer of a ring in `region`, which starts empty: stores `head` = 0. It stores
    /// `head` after every pop (see [`Consumer::publish_every`]).
    pub fn new(region: R, layout: RingLayout) -> Result<Consumer<R>, RingError> {
        layout.check(&region)?;
        region[HEAD].store(0, Ordering::Release);
        region[SLEEP].store(0, Ordering::Release);
        Ok(Consumer {
            region,
            layout,
            head: 0,
            tail: 0,
            sleeps: 0,
            rang_for: 0,
            published: 0,
            publish_every: 1,
            unchecked: false,
            failed: None,
        })
    }

    /// Stores `head` only every `pops` pops (at least 1, at most a quarter of the ring), and
    /// when [`Consumer::publish`] is called (before sleeping). The producer
    /// then sees up to `pops - 1` fewer free slots than there are, and the cache line
    /// holding `head` (and this side's sleep word, which the producer reads after every push)
    /// is not written on every message: in a ping-pong across CPUs it stays in both caches
    /// instead of moving to this side and back for every message each way.
    pub fn publish_every(mut self, pops: usize) -> Consumer<R> {
        let most = (self.layout.entries / 4).max(1);
        self.publish_every = pops.clamp(1, most) as u64;
        self
    }

    /// The next entry, copied out of the ring (its slot is free again for the producer);
    /// `Ok(None)` when the ring is empty; or the error that failed this ring. The entry's
    /// bytes are whatever the peer wrote: validate them before use.
    pub fn try_pop(&mut self) -> Result<Option<[u8; ENTRY_BYTES]>, RingError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.head == self.tail && !self.refresh()? {
            return Ok(None);
        }
        let mut entry = [0u8; ENTRY_BYTES];
        let slot = self.layout.slot(&self.region, self.head);
        for (word, bytes) in slot.iter().zip(entry.chunks_exact_mut(8)) {
            bytes.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
        }
        self.head += 1;
        if self.head - self.published >= self.publish_every {
            self.store_head();
        }
        Ok(Some(entry))
    }

    fn store_head(&mut self) {
        self.region[HEAD].store(self.head, Ordering::Release);
        self.published = self.head;
        self.unchecked = true;
    }

    /// Stores `head` if pops since the last store have not been, and says whether the
    /// producer waits for room and must be woken ([`Consumer::should_signal_room`]). Call it
    /// before [`Consumer::prepare_sleep`] (a producer waiting for room this side withholds
    /// would otherwise wait as long as this side sleeps).
    pub fn publish(&mut self) -> bool {
        if self.published != self.head {
            self.store_head();
        }
        self.should_signal_room()
    }

    /// Reads the producer's `tail` once and checks it: whether an entry is there now.
    fn refresh(&mut self) -> Result<bool, RingError> {
        let seen = self.region[TAIL].load(Ordering::Acquire);
        let high = self.head + self.layout.entries as u64;
        if seen < self.tail || seen > high {
            let e = RingError::Corrupt {
                index: "tail",
                value: seen,
                low: self.tail,
                high,
            };
            self.failed = Some(e);
            return Err(e);
        }
        self.tail = seen;
        Ok(self.tail > self.head)
    }

    /// Entries popped so far.
    pub fn popped(&self) -> u64 {
        self.head
    }

    /// Before sleeping on an empty ring: announces the sleep, then looks once more.
    /// `Ok(true)`: still empty, sleep until the doorbell (the producer that pushes next sees
    /// the announcement: [`Producer::should_wake`]), then call [`Consumer::woke`];
    /// `Ok(false)`: an entry came meanwhile, do not sleep (the announcement is withdrawn).
    pub fn prepare_sleep(&mut self) -> Result<bool, RingError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.sleeps % 2 == 0 {
            self.sleeps += 1;
            self.region[SLEEP].store(self.sleeps, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
        if self.head != self.tail || self.refresh()? {
            self.woke();
            return Ok(false);
        }
        Ok(true)
    }

    /// Withdraws the announcement of [`Consumer::prepare_sleep`]: after the doorbell (or a
    /// time limit), before looking again.
    pub fn woke(&mut self) {
        if self.sleeps % 2 == 1 {
            self.sleeps += 1;
            self.region[SLEEP].store(self.sleeps, Ordering::Relaxed);
        }
    }

    /// After popping: whether the producer waits for room, announced a wait this side has
    /// not rung for yet, and so must be woken (the caller rings the doorbell). True once per
    /// wait; false at no cost while no `head` was stored since the last call (the producer
    /// cannot have seen more room meanwhile).
    pub fn should_signal_room(&mut self) -> bool {
        if !std::mem::take(&mut self.unchecked) {
            return false;
        }
        // Orders this side's `head` store before the load of the producer's word.
        fence(Ordering::SeqCst);
        let waits = self.region[WAIT_ROOM].load(Ordering::Relaxed);
        if waits % 2 == 1 && waits != self.rang_for {
            self.rang_for = waits;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn region(layout: RingLayout) -> Arc<[AtomicU64]> {
        (0..layout.words()).map(|_| AtomicU64::new(0)).collect()
    }

    type Shared = Arc<[AtomicU64]>;

    fn pair(entries: usize) -> (Producer<Shared>, Consumer<Shared>) {
        let layout = RingLayout::new(entries).unwrap();
        let r = region(layout);
        (
            Producer::new(r.clone(), layout).unwrap(),
            Consumer::new(r, layout).unwrap(),
        )
    }

    /// An entry that names its number in every word.
    fn entry(n: u64) -> [u8; ENTRY_BYTES] {
        let mut e = [0u8; ENTRY_BYTES];
        for (i, w) in e.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(n.wrapping_mul(31).wrapping_add(i as u64)).to_ne_bytes());
        }
        e
    }

    #[test]
    fn sizes_must_be_powers_of_two_within_bounds() {
        for bad in [0, 1, 3, 6, MAX_ENTRIES + 1, MAX_ENTRIES * 2] {
            assert_eq!(RingLayout::new(bad), Err(RingError::BadSize(bad)));
        }
        for good in [2, 4, 1024, MAX_ENTRIES] {
            let l = RingLayout::new(good).unwrap();
            assert_eq!(l.words(), 16 + good * 8);
            assert_eq!(l.bytes(), l.words() * 8);
        }
    }

    #[test]
    fn a_region_too_small_is_refused() {
        let layout = RingLayout::new(4).unwrap();
        let short: Arc<[AtomicU64]> = (0..layout.words() - 1).map(|_| AtomicU64::new(0)).collect();
        let want = RingError::RegionTooSmall {
            got: layout.words() - 1,
            need: layout.words(),
        };
        assert_eq!(Producer::new(short.clone(), layout).unwrap_err(), want);
        assert_eq!(Consumer::new(short, layout).unwrap_err(), want);
    }

    #[test]
    fn entries_arrive_in_order_across_many_wraps() {
        let (mut tx, mut rx) = pair(4);
        let mut next_in = 0;
        let mut next_out = 0;
        while next_out < 1000 {
            // Fill what fits, then drain part of it, so the indices wrap at every offset.
            while tx.try_push(&entry(next_in)).unwrap() {
                next_in += 1;
            }
            assert_eq!(next_in - next_out, 4, "a full ring holds all its slots");
            for _ in 0..1 + next_out % 4 {
                assert_eq!(rx.try_pop().unwrap(), Some(entry(next_out)));
                next_out += 1;
            }
        }
        while rx.try_pop().unwrap().is_some() {}
        assert_eq!(rx.popped(), tx.pushed());
        assert_eq!(tx.room().unwrap(), 4);
    }

    #[test]
    fn a_full_ring_refuses_without_writing_and_an_empty_one_gives_nothing() {
        let (mut tx, mut rx) = pair(2);
        assert_eq!(rx.try_pop().unwrap(), None);
        assert!(tx.try_push(&entry(0)).unwrap());
        assert!(tx.try_push(&entry(1)).unwrap());
        assert!(!tx.try_push(&entry(2)).unwrap());
        assert_eq!(tx.pushed(), 2);
        assert_eq!(rx.try_pop().unwrap(), Some(entry(0)));
        assert!(tx.try_push(&entry(2)).unwrap());
        assert_eq!(rx.try_pop().unwrap(), Some(entry(1)));
        assert_eq!(rx.try_pop().unwrap(), Some(entry(2)));
        assert_eq!(rx.try_pop().unwrap(), None);
    }

    /// The consumer's view of a `tail` the peer set to `value` (after 3 pushes, 1 pop; 8
    /// slots).
    fn consumer_after_tail(value: u64) -> (Result<Option<[u8; 64]>, RingError>, u64) {
        let layout = RingLayout::new(8).unwrap();
        let r = region(layout);
        let mut tx = Producer::new(r.clone(), layout).unwrap();
        let mut rx = Consumer::new(r.clone(), layout).unwrap();
        for n in 0..3 {
            tx.try_push(&entry(n)).unwrap();
        }
        rx.try_pop().unwrap();
        rx.try_pop().unwrap();
        rx.try_pop().unwrap();
        r[TAIL].store(value, Ordering::Release);
        (rx.try_pop(), rx.popped())
    }

    #[test]
    fn a_tail_that_goes_back_or_past_the_ring_fails_the_consumer() {
        // head = 3 = the last tail seen; the ring holds 8: a tail in 3..=11 is possible.
        for bad in [0, 2, 12, 1 << 40, u64::MAX] {
            let (got, popped) = consumer_after_tail(bad);
            let e = got.unwrap_err();
            assert!(
                matches!(e, RingError::Corrupt { index: "tail", value, low: 3, high: 11 } if value == bad),
                "{bad}: {e:?}"
            );
            assert_eq!(popped, 3, "nothing taken past a corrupt tail");
        }
        // A possible tail is taken at its word: what the slots hold is the peer's business.
        let (got, _) = consumer_after_tail(11);
        assert!(got.unwrap().is_some());
        let (got, _) = consumer_after_tail(3);
        assert_eq!(got.unwrap(), None);
    }

    #[test]
    fn a_head_that_goes_back_or_past_the_tail_fails_the_producer() {
        for bad in [0u64, 1, 3, 5, u64::MAX] {
            let layout = RingLayout::new(2).unwrap();
            let r = region(layout);
            let mut tx = Producer::new(r.clone(), layout).unwrap();
            let mut rx = Consumer::new(r.clone(), layout).unwrap();
            tx.try_push(&entry(0)).unwrap();
            tx.try_push(&entry(1)).unwrap();
            rx.try_pop().unwrap();
            assert!(tx.try_push(&entry(2)).unwrap(), "head 1 seen");
            // Full again (tail 3, head 1 seen): the next push reads head. 1..=3 is possible.
            r[HEAD].store(bad, Ordering::Release);
            let got = tx.try_push(&entry(3));
            if (1..=3).contains(&bad) {
                assert!(got.is_ok(), "{bad}: {got:?}");
                continue;
            }
            let e = got.unwrap_err();
            assert!(
                matches!(e, RingError::Corrupt { index: "head", value, low: 1, high: 3 } if value == bad),
                "{bad}: {e:?}"
            );
            assert_eq!(tx.pushed(), 3, "nothing written past a corrupt head");
            assert_eq!(tx.try_push(&entry(3)), Err(e), "the failure sticks");
            assert_eq!(tx.room(), Err(e));
        }
    }

    #[test]
    fn a_failed_consumer_stays_failed_whatever_the_peer_does_next() {
        let layout = RingLayout::new(4).unwrap();
        let r = region(layout);
        let mut rx = Consumer::new(r.clone(), layout).unwrap();
        r[TAIL].store(100, Ordering::Release);
        let e = rx.try_pop().unwrap_err();
        r[TAIL].store(1, Ordering::Release); // "honest" again
        assert_eq!(rx.try_pop(), Err(e));
        assert_eq!(rx.popped(), 0);
    }

    #[test]
    fn two_threads_pass_every_entry_in_order() {
        const N: u64 = 200_000;
        let (mut tx, mut rx) = pair(64);
        // Every wait is bounded: a stuck ring fails the test instead of hanging it.
        let deadline = Instant::now() + Duration::from_secs(60);
        let producer = std::thread::spawn(move || {
            let mut n = 0;
            while n < N {
                if tx.try_push(&entry(n)).unwrap() {
                    n += 1;
                } else {
                    assert!(Instant::now() < deadline, "producer stuck at {n}");
                    std::thread::yield_now();
                }
            }
        });
        let mut n = 0;
        while n < N {
            match rx.try_pop().unwrap() {
                Some(e) => {
                    assert_eq!(e, entry(n), "entry {n}");
                    n += 1;
                }
                None => {
                    assert!(Instant::now() < deadline, "consumer stuck at {n}");
                    std::thread::yield_now();
                }
            }
        }
        producer.join().unwrap();
        assert_eq!(rx.try_pop().unwrap(), None);
    }

    #[test]
    fn a_sleeping_consumer_is_rung_for_once_per_sleep_and_never_while_awake() {
        let (mut tx, mut rx) = pair(4);
        // Awake: pushes ring nothing.
        assert!(tx.try_push(&entry(0)).unwrap());
        assert!(!tx.should_wake());
        // An entry there: the announcement is withdrawn at once, and nothing is rung.
        assert!(!rx.prepare_sleep().unwrap());
        assert!(tx.try_push(&entry(1)).unwrap());
        assert!(!tx.should_wake(), "a withdrawn sleep is not rung for");
        rx.try_pop().unwrap();
        rx.try_pop().unwrap();
        // Empty: it sleeps; the next push rings once, the ones after it do not.
        assert!(rx.prepare_sleep().unwrap());
        assert!(tx.try_push(&entry(2)).unwrap());
        assert!(tx.should_wake());
        assert!(tx.try_push(&entry(3)).unwrap());
        assert!(!tx.should_wake(), "one doorbell per sleep");
        rx.woke();
        assert_eq!(rx.try_pop().unwrap(), Some(entry(2)));
        assert_eq!(rx.try_pop().unwrap(), Some(entry(3)));
        // A second sleep is a new one: rung for again.
        assert!(rx.prepare_sleep().unwrap());
        assert!(tx.try_push(&entry(4)).unwrap());
        assert!(tx.should_wake(), "a new sleep is rung for");
    }

    #[test]
    fn a_producer_waiting_for_room_is_rung_for_once_per_wait() {
        let (mut tx, mut rx) = pair(2);
        assert!(tx.try_push(&entry(0)).unwrap());
        // Room left: no wait.
        assert!(!tx.prepare_wait_room(1).unwrap());
        assert!(tx.try_push(&entry(1)).unwrap());
        assert!(!tx.try_push(&entry(2)).unwrap(), "full");
        assert!(!rx.should_signal_room(), "nobody waits");
        assert!(tx.prepare_wait_room(1).unwrap());
        rx.try_pop().unwrap();
        assert!(rx.should_signal_room());
        rx.try_pop().unwrap();
        assert!(!rx.should_signal_room(), "one doorbell per wait");
        tx.room_woke();
        assert!(tx.try_push(&entry(2)).unwrap());
    }

    /// A doorbell between two threads, as the set-up socket is between two processes: a
    /// signal that waits at most `limit` (a lost wake-up fails the test instead of hanging it).
    struct Bell(std::sync::mpsc::Receiver<()>, Duration);

    impl Bell {
        fn wait(&self, who: &str, n: u64) {
            if let Err(e) = self.0.recv_timeout(self.1) {
                panic!("{who} slept through at {n}: {e} (a lost wake-up)");
            }
        }
    }

    #[test]
    fn a_lazy_consumer_stores_head_every_few_pops_and_before_it_sleeps() {
        let (mut tx, rx) = pair(16);
        let mut rx = rx.publish_every(4);
        for n in 0..16 {
            assert!(tx.try_push(&entry(n)).unwrap());
        }
        assert!(tx.prepare_wait_room(1).unwrap(), "full: the producer waits");
        for n in 0..3 {
            assert_eq!(rx.try_pop().unwrap(), Some(entry(n)));
            assert!(!rx.should_signal_room(), "head not stored yet");
        }
        assert_eq!(tx.room().unwrap(), 0, "three pops withheld");
        rx.try_pop().unwrap();
        assert!(
            rx.should_signal_room(),
            "the fourth pop stores head: the waiter is rung"
        );
        assert_eq!(tx.room().unwrap(), 4);
        tx.room_woke();
        // Pops short of the step are stored by `publish` (before a sleep), which rings for a
        // producer waiting meanwhile.
        rx.try_pop().unwrap();
        assert!(tx.try_push(&entry(16)).unwrap());
        assert_eq!(tx.room().unwrap(), 3, "one pop withheld");
        assert!(!rx.publish(), "nobody waits yet");
        assert_eq!(tx.room().unwrap(), 4);
        for n in 17..21 {
            assert!(tx.try_push(&entry(n)).unwrap());
        }
        assert!(tx.prepare_wait_room(1).unwrap());
        rx.try_pop().unwrap();
        assert!(rx.publish(), "the pop stored at once: the waiter is rung");
        assert!(!rx.publish(), "nothing new: no second doorbell");
        // The step is at most a quarter of the ring, at least one pop.
        assert_eq!(pair(16).1.publish_every(100).publish_every, 4);
        assert_eq!(pair(2).1.publish_every(100).publish_every, 1);
        assert_eq!(pair(16).1.publish_every(0).publish_every, 1);
    }

    #[test]
    fn two_threads_that_sleep_when_idle_lose_no_wake_up() {
        // A small ring: the producer often finds it full and waits for room too.
        sleepers_lose_no_wake_up(4, 1);
    }

    #[test]
    fn two_threads_that_sleep_when_idle_lose_no_wake_up_with_a_lazy_head() {
        sleepers_lose_no_wake_up(16, 4);
    }

    fn sleepers_lose_no_wake_up(entries: usize, publish_every: usize) {
        const N: u64 = 100_000;
        let limit = Duration::from_secs(20);
        let (mut tx, rx) = pair(entries);
        let mut rx = rx.publish_every(publish_every);
        let (data_tx, data_rx) = std::sync::mpsc::channel::<()>();
        let (room_tx, room_rx) = std::sync::mpsc::channel::<()>();
        let (data_bell, room_bell) = (Bell(data_rx, limit), Bell(room_rx, limit));
        let producer = std::thread::spawn(move || {
            let (mut n, mut rung, mut waits) = (0, 0u64, 0u64);
            while n < N {
                if tx.try_push(&entry(n)).unwrap() {
                    n += 1;
                    if tx.should_wake() {
                        rung += 1;
                        let _ = data_tx.send(());
                    }
                } else if tx.prepare_wait_room(1).unwrap() {
                    waits += 1;
                    room_bell.wait("the producer", n);
                    tx.room_woke();
                }
            }
            (rung, waits)
        });
        let (mut n, mut sleeps, mut announced) = (0, 0u64, 0u64);
        while n < N {
            match rx.try_pop().unwrap() {
                Some(e) => {
                    assert_eq!(e, entry(n), "entry {n}");
                    n += 1;
                    if rx.should_signal_room() {
                        let _ = room_tx.send(());
                    }
                }
                None => {
                    if rx.publish() {
                        let _ = room_tx.send(());
                    }
                    // Each call announces a new sleep (the last one was withdrawn or woken).
                    announced += 1;
                    if rx.prepare_sleep().unwrap() {
                        sleeps += 1;
                        data_bell.wait("the consumer", n);
                        rx.woke();
                    }
                }
            }
        }
        let (rung, waits) = producer.join().unwrap();
        assert_eq!(rx.try_pop().unwrap(), None);
        // At most one doorbell per announced sleep (one announced and then withdrawn, because
        // an entry came meanwhile, may have been rung for too: its doorbell only wakes early).
        assert!(
            rung <= announced,
            "rang {rung} times for {announced} sleeps announced"
        );
        assert!(
            sleeps > 0 || waits > 0,
            "the test never slept: it tested nothing"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push,
        Pop,
        /// The consumer announces a sleep (and withdraws it when the ring is not empty).
        Sleep,
        /// The consumer wakes.
        Woke,
        /// The producer announces a wait for room.
        WaitRoom,
        /// The producer's wait ends.
        RoomWoke,
        /// The peer writes `value` into word `word` (any word of the region).
        Scribble {
            word: usize,
            value: u64,
        },
    }

    fn op(words: usize) -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Push),
            4 => Just(Op::Pop),
            1 => Just(Op::Sleep),
            1 => Just(Op::Woke),
            1 => Just(Op::WaitRoom),
            1 => Just(Op::RoomWoke),
            1 => (0..words, prop_oneof![any::<u64>(), 0u64..64]).prop_map(|(word, value)| Op::Scribble { word, value }),
        ]
    }

    proptest! {
        /// Whatever the peer writes wherever, each side returns entries, "empty/full" or a
        /// typed error that then sticks; it never panics (overflow included), never counts
        /// past what it may, and without scribbles over the indices delivers exactly what was
        /// pushed, in order.
        #[test]
        fn a_scribbling_peer_gets_typed_errors_never_panics(
            ops in proptest::collection::vec(op(16 + 4 * 8), 1..200)
        ) {
            let layout = RingLayout::new(4).unwrap();
            let r = region(layout);
            let mut tx = Producer::new(r.clone(), layout).unwrap();
            let mut rx = Consumer::new(r.clone(), layout).unwrap();
            let (mut tx_err, mut rx_err) = (None, None);
            let mut indices_touched = false;
            // Whether the peer wrote the sleep or wait words, and what each side announced.
            let mut flags_touched = false;
            // The model: each side's announcement, and whether the other side rang for it.
            let (mut asleep, mut sleep_rung) = (false, false);
            let (mut waiting, mut wait_rung) = (false, false);
            let mut expected = std::collections::VecDeque::new();
            let mut n = 0u64;
            for op in ops {
                match op {
                    Op::Push => match tx.try_push(&entry(n)) {
                        Ok(true) => {
                            expected.push_back(entry(n));
                            n += 1;
                            // Rung for exactly once per announced sleep, while the words are
                            // the two sides' own.
                            let wake = tx.should_wake();
                            if !flags_touched {
                                prop_assert_eq!(wake, asleep && !sleep_rung, "doorbell for a sleep");
                            }
                            sleep_rung |= wake;
                        }
                        Ok(false) => prop_assert!(indices_touched || expected.len() == 4),
                        Err(e) => {
                            prop_assert!(indices_touched, "an honest ring failed: {e}");
                            prop_assert!(tx_err.is_none_or(|p| p == e), "the error changed");
                            tx_err = Some(e);
                        }
                    },
                    Op::Pop => match rx.try_pop() {
                        Ok(Some(e)) => {
                            let room = rx.should_signal_room();
                            if !flags_touched {
                                prop_assert_eq!(room, waiting && !wait_rung, "doorbell for a wait");
                            }
                            wait_rung |= room;
                            let want = expected.pop_front();
                            if !indices_touched {
                                prop_assert_eq!(Some(e), want);
                            }
                        }
                        Ok(None) => prop_assert!(indices_touched || expected.is_empty()),
                        Err(e) => {
                            prop_assert!(indices_touched, "an honest ring failed: {e}");
                            prop_assert!(rx_err.is_none_or(|p| p == e), "the error changed");
                            rx_err = Some(e);
                        }
                    },
                    Op::Sleep => match rx.prepare_sleep() {
                        // `asleep`: announced and not yet rung for (a push rings it once).
                        Ok(sleeping) => {
                            prop_assert!(indices_touched || sleeping == expected.is_empty());
                            // A sleep announced anew is not rung for yet; one still announced
                            // stays as it was.
                            if sleeping && !asleep {
                                sleep_rung = false;
                            }
                            asleep = sleeping;
                        }
                        Err(e) => {
                            prop_assert!(indices_touched, "an honest ring failed: {e}");
                            rx_err = Some(e);
                            // Announced before the look that failed: the model stops here.
                            flags_touched = true;
                        }
                    },
                    Op::Woke => { rx.woke(); asleep = false; }
                    Op::WaitRoom => match tx.prepare_wait_room(1) {
                        Ok(w) => {
                            prop_assert!(indices_touched || w == (expected.len() == 4));
                            if w && !waiting {
                                wait_rung = false;
                            }
                            waiting = w;
                        }
                        Err(e) => {
                            prop_assert!(indices_touched, "an honest ring failed: {e}");
                            tx_err = Some(e);
                            flags_touched = true;
                        }
                    },
                    Op::RoomWoke => { tx.room_woke(); waiting = false; }
                    Op::Scribble { word, value } => {
                        flags_touched |= word == SLEEP || word == WAIT_ROOM;
                        indices_touched |= word == TAIL || word == HEAD;
                        if word >= SLOTS {
                            // The entry in that slot is the peer's now: stop comparing it.
                            indices_touched = true;
                        }
                        r[word].store(value, Ordering::Relaxed);
                    }
                }
                // Whatever happened, neither side counts past what the ring allows.
                prop_assert!(rx.popped() <= tx.pushed() || indices_touched);
                prop_assert!(tx.pushed() - rx.popped().min(tx.pushed()) <= 4 || indices_touched);
                if let Some(e) = tx_err { prop_assert_eq!(tx.try_push(&entry(0)), Err(e)); }
                if let Some(e) = rx_err { prop_assert_eq!(rx.try_pop(), Err(e)); }
            }
        }
    }
}
