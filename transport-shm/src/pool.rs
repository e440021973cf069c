//! A pool of fixed-size payload slots in a region the sender writes and the receiver maps.
//!
//! A payload too large to travel inline in ring entries ([`crate::msg`]) goes in a slot of the
//! sender's pool: the sender takes a free slot ([`PoolWriter::alloc`]), writes the payload into
//! it ([`PoolWriter::write`]) and sends a ring entry naming the slot and the length (or the
//! application wrote it there already, in a send buffer of [`PoolWriter::lender`]: no copy,
//! see [`lend`]); the
//! receiver checks the pair against the layout it knows and hands the payload out as
//! [`Bytes`] over its mapping, without a copy ([`PoolReader::take`]); when the last clone of
//! that `Bytes` is dropped the slot joins the receiver's return queue
//! ([`PoolReader::pop_returns`]), which the transport sends back as ring entries, and the
//! sender takes it back ([`PoolWriter::release`]).
//!
//! # Layout
//!
//! The region holds `slots` slots of `slot_bytes` each, back to back: slot `i` is bytes
//! `i * slot_bytes .. (i + 1) * slot_bytes` ([`PoolLayout`]). Nothing else is in shared memory:
//! no header, no free list, no counters.
//!
//! # Who trusts what
//!
//! - The **sender** keeps the free list and each slot's state locally, never in the region.
//!   A slot id returned by the peer is checked (in range, lent, not already returned) before
//!   anything changes; a bad one is a typed [`PoolError`] that sticks: the pool lends nothing
//!   more.
//! - The **receiver** checks a `(slot, offset, len)` triple from a ring entry against its own
//!   [`PoolLayout`] (slot in range, the payload within the slot, no overflow) before forming
//!   any range, and holds at most as many payloads as the pool has slots (an honest sender
//!   has at most that many sends outstanding), which bounds its return queue. A bad triple is
//!   a typed error that sticks.
//! - The payload bytes themselves stay writable by the peer while the application holds them
//!   (see [`crate::region::PeerBytes`]): they are untrusted content, and this crate never reads
//!   them to decide anything.
//!
//! # Ordering
//!
//! The sender writes a payload with relaxed atomic stores before it pushes the ring entry that
//! names the slot (whose `tail` store is a release); the receiver reads the entry after its
//! acquire load of `tail`, and only then reads the payload. The receiver returns a slot only
//! after every view of it is dropped, and the sender reuses it only after the return entry
//! arrived through the other ring (the same release/acquire pair).
//!
//! # Example
//!
//! ```
//! use std::os::fd::AsFd;
//! use transport_shm::pool::{PoolLayout, PoolReader, PoolWriter};
//! use transport_shm::region::Region;
//!
//! let layout = PoolLayout::new(4, 256)?;
//! // The sender creates the pool's memfd; the receiver maps the descriptor it was sent.
//! let (mine, fd) = Region::create("pool", layout.bytes())?;
//! let theirs = Region::map(fd.as_fd(), layout.bytes())?;
//! let mut tx = PoolWriter::new(mine, layout)?;
//! let mut rx = PoolReader::new(theirs, layout)?;
//!
//! let slot = tx.alloc().expect("a free slot");
//! tx.write(slot, b"a payload")?;
//! // ... a ring entry carries (slot, 9) to the receiver ...
//! let payload = rx.take(slot, 0, 9)?;
//! assert_eq!(&payload[..], b"a payload");
//! drop(payload); // the last view: the slot is queued for return
//! let mut back = [slot; 4];
//! assert_eq!(rx.pop_returns(&mut back), 1);
//! // ... a ring entry carries the return to the sender ...
//! tx.release(back[0])?;
//! assert_eq!(tx.available(), 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::region::{PeerBytes, Region, MAX_REGION_BYTES};
use bytes::Bytes;
use std::collections::VecDeque;
use std::fmt;
use std::ops::{Deref, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub mod lend;

/// Slot sizes are multiples of this (a cache line).
pub const SLOT_ALIGN: usize = 64;

/// The number of a slot in a pool.
///
/// Made by [`PoolWriter::alloc`] on the sending side; on the receiving side it is whatever a
/// ring entry said, and means nothing until [`PoolReader::take`] or [`PoolWriter::release`]
/// has checked it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(u32);

impl SlotId {
    /// The slot numbered `raw` (not checked against any pool).
    pub const fn new(raw: u32) -> SlotId {
        SlotId(raw)
    }

    /// Its number.
    pub const fn get(self) -> u32 {
        self.0
    }

    fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {}", self.0)
    }
}

/// Why a pool cannot be built or used.
///
/// The variants marked *peer* come from what the peer sent; they fail the side that saw them
/// for good (every later call returns the same error), as [`crate::ring::RingError::Corrupt`]
/// does. The others are this side's own mistakes and change nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The slot count is not a power of two (at least 1).
    #[error("a pool of {0} slots: a power of two is needed")]
    BadSlotCount(usize),
    /// The slot size is not a non-zero multiple of [`SLOT_ALIGN`].
    #[error("slots of {0} bytes: a non-zero multiple of 64 is needed")]
    BadSlotSize(usize),
    /// The pool would be larger than [`MAX_REGION_BYTES`].
    #[error("{slots} slots of {slot_bytes} bytes: more than the 1 GiB a region may have")]
    TooLarge {
        /// Slots asked for.
        slots: usize,
        /// Bytes per slot asked for.
        slot_bytes: usize,
    },
    /// The region is smaller than the layout needs.
    #[error("a region of {got} bytes, the pool needs {need}")]
    RegionTooSmall {
        /// Bytes in the region.
        got: usize,
        /// Bytes the layout needs ([`PoolLayout::bytes`]).
        need: usize,
    },
    /// This side wrote to a slot it does not hold ([`PoolWriter::write`]).
    #[error("{0} is not allocated to this side: nothing written")]
    NotAllocated(SlotId),
    /// This side's payload does not fit in a slot ([`PoolWriter::write`]).
    #[error("a payload of {len} bytes does not fit in a slot of {slot_bytes}")]
    TooLong {
        /// The payload's length.
        len: usize,
        /// Bytes per slot.
        slot_bytes: usize,
    },
    /// *Peer*: a slot id past the end of the pool.
    #[error("the peer named slot {slot} of a pool of {slots}: the pool is not used again")]
    SlotOutOfRange {
        /// The id it sent.
        slot: u32,
        /// Slots in the pool.
        slots: usize,
    },
    /// *Peer*: a payload length past the end of a slot.
    #[error("the peer sent {len} bytes in a slot of {slot_bytes}: the pool is not used again")]
    LenTooLong {
        /// The length it sent.
        len: u32,
        /// Bytes per slot.
        slot_bytes: usize,
    },
    /// *Peer*: a payload that starts inside a slot but ends past it.
    #[error("the peer sent {len} bytes at offset {offset} of a slot of {slot_bytes}: the pool is not used again")]
    PastSlotEnd {
        /// The offset it sent.
        offset: u32,
        /// The length it sent.
        len: u32,
        /// Bytes per slot.
        slot_bytes: usize,
    },
    /// *Peer*: the receiver returned a slot the sender never lent.
    #[error("the peer returned {0}, which was never lent: the pool is not used again")]
    NeverLent(SlotId),
    /// *Peer*: the receiver returned a slot that was already back.
    #[error("the peer returned {0} twice: the pool is not used again")]
    ReturnedTwice(SlotId),
    /// *Peer*: the sender named a slot while as many of its payloads as its pool has slots
    /// were held here (not yet returned), which an honest sender never does.
    #[error("the peer sent {0} while a pool's worth of its payloads were held: the pool is not used again")]
    TooManyHeld(SlotId),
}

/// The shape of a pool: how many slots, of how many bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLayout {
    slots: usize,
    slot_bytes: usize,
}

impl PoolLayout {
    /// A pool of `slots` slots (a power of two) of `slot_bytes` each (a non-zero multiple of
    /// [`SLOT_ALIGN`]), at most [`MAX_REGION_BYTES`] in all.
    ///
    /// ```
    /// use transport_shm::pool::{PoolError, PoolLayout};
    /// assert_eq!(PoolLayout::new(64, 4096)?.bytes(), 256 * 1024);
    /// assert_eq!(PoolLayout::new(3, 4096), Err(PoolError::BadSlotCount(3)));
    /// assert_eq!(PoolLayout::new(64, 100), Err(PoolError::BadSlotSize(100)));
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn new(slots: usize, slot_bytes: usize) -> Result<PoolLayout, PoolError> {
        if !slots.is_power_of_two() {
            return Err(PoolError::BadSlotCount(slots));
        }
        if slot_bytes == 0 || slot_bytes % SLOT_ALIGN != 0 {
            return Err(PoolError::BadSlotSize(slot_bytes));
        }
        match slots.checked_mul(slot_bytes) {
            Some(total) if total <= MAX_REGION_BYTES => Ok(PoolLayout { slots, slot_bytes }),
            _ => Err(PoolError::TooLarge { slots, slot_bytes }),
        }
    }

    /// Slots in the pool (at most 2^24, so an id fits in a `u32`).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes the region must hold.
    pub fn bytes(&self) -> usize {
        self.slots * self.slot_bytes
    }

    /// The byte range of a payload of `len` bytes at `offset` in `slot`, after checking all
    /// three against this layout (a [`PoolError::SlotOutOfRange`], [`PoolError::LenTooLong`]
    /// or [`PoolError::PastSlotEnd`] otherwise). Pure: this is the check [`PoolReader::take`]
    /// makes, for values read from the peer.
    ///
    /// ```
    /// use transport_shm::pool::{PoolError, PoolLayout, SlotId};
    /// let layout = PoolLayout::new(4, 128)?;
    /// assert_eq!(layout.payload_range(SlotId::new(2), 0, 5)?, 256..261);
    /// assert_eq!(layout.payload_range(SlotId::new(2), 123, 5)?, 379..384);
    /// assert!(matches!(layout.payload_range(SlotId::new(4), 0, 5), Err(PoolError::SlotOutOfRange { .. })));
    /// assert!(matches!(layout.payload_range(SlotId::new(0), 0, 129), Err(PoolError::LenTooLong { .. })));
    /// assert!(matches!(layout.payload_range(SlotId::new(0), 124, 5), Err(PoolError::PastSlotEnd { .. })));
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn payload_range(
        &self,
        slot: SlotId,
        offset: u32,
        len: u32,
    ) -> Result<Range<usize>, PoolError> {
        if slot.index() >= self.slots {
            return Err(PoolError::SlotOutOfRange {
                slot: slot.get(),
                slots: self.slots,
            });
        }
        // `offset` and `len` fit in usize (at least 32 bits here), each is at most a slot
        // (< 2^30) once checked, and the slot's start plus a slot is at most the pool
        // (<= 2^30): no sum below can overflow.
        if len as usize > self.slot_bytes {
            return Err(PoolError::LenTooLong {
                len,
                slot_bytes: self.slot_bytes,
            });
        }
        if offset as usize > self.slot_bytes - len as usize {
            return Err(PoolError::PastSlotEnd {
                offset,
                len,
                slot_bytes: self.slot_bytes,
            });
        }
        let start = slot.index() * self.slot_bytes + offset as usize;
        Ok(start..start + len as usize)
    }
}

/// A slot's state, as the sender knows it, for the copies it makes into slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// Free, and never lent: a return of it is [`PoolError::NeverLent`].
    Fresh,
    /// Lent: allocated by this side, then sent; a return of it frees it.
    Lent,
    /// Free again after a return: another return of it is [`PoolError::ReturnedTwice`].
    Returned,
}

/// The slots free to lend, shared by the writer and the application's send buffers
/// ([`lend`]), which may give theirs back on any thread.
#[derive(Debug)]
struct Free {
    /// Free slot ids, the most recently freed last (reused first: still in cache).
    ids: Vec<u32>,
    /// Per slot: held by an application's send buffer.
    app: Vec<bool>,
    /// How many are.
    app_count: usize,
}

type SharedFree = Arc<Mutex<Free>>;

fn lock(free: &Mutex<Free>) -> std::sync::MutexGuard<'_, Free> {
    // Every critical section is a push, a pop or a flag: a panic elsewhere while the lock
    // was held cannot leave it half-changed.
    free.lock().unwrap_or_else(|e| e.into_inner())
}

/// The sending side of a pool: lends slots, writes payloads into them, takes them back.
///
/// A payload reaches the peer in a slot in one of two ways: copied into a slot taken here
/// ([`PoolWriter::alloc`], [`PoolWriter::write`]), or already in one, written there by the
/// application through a send buffer of [`PoolWriter::lender`] ([`PoolWriter::lent_slot`],
/// [`PoolWriter::send_lent`]: no copy). Either way a send is *outstanding* until the peer
/// returns the slot, and at most `slots` sends are outstanding at once, which bounds what
/// the peer holds and returns (an application's buffer may be sent again before its first
/// send came back: each send is returned once).
///
/// The free list is shared with the application's buffers (a lock held for a push or a pop);
/// each slot's state lives here, in this process, never in the region, which only holds the
/// payload bytes. Every operation is constant time (a write is linear in its payload) and
/// allocates nothing; the state takes a few bytes per slot, allocated once by
/// [`PoolWriter::new`].
#[derive(Debug)]
pub struct PoolWriter<R> {
    region: R,
    layout: PoolLayout,
    free: SharedFree,
    state: Vec<SlotState>,
    /// Per slot: sends of an application's buffer in it that the peer has not returned.
    out: Vec<u32>,
    /// Per slot with sends out: a view of the application's buffer, which keeps the slot
    /// from being freed (and written again) before the peer returned it.
    keep: Vec<Option<Bytes>>,
    /// Sends whose slot the peer has not returned (copies and application buffers).
    outstanding: usize,
    failed: Option<PoolError>,
}

impl<R: Deref<Target = [AtomicU64]>> PoolWriter<R> {
    /// The sender's side of a pool in `region` (its own region, which the peer maps), every slot
    /// free.
    pub fn new(region: R, layout: PoolLayout) -> Result<PoolWriter<R>, PoolError> {
        let got = region.len().saturating_mul(8);
        if got < layout.bytes() {
            return Err(PoolError::RegionTooSmall {
                got,
                need: layout.bytes(),
            });
        }
        // Slot 0 on top: a fresh pool lends 0, 1, 2, ...
        let ids = (0..layout.slots as u32).rev().collect();
        Ok(PoolWriter {
            region,
            layout,
            free: Arc::new(Mutex::new(Free {
                ids,
                app: vec![false; layout.slots],
                app_count: 0,
            })),
            state: vec![SlotState::Fresh; layout.slots],
            out: vec![0; layout.slots],
            keep: vec![None; layout.slots],
            outstanding: 0,
            failed: None,
        })
    }

    /// A free slot, now lent for a copy; `None` when no slot is free, `slots` sends are
    /// outstanding (wait for returns) or the pool failed ([`PoolWriter::failed`]).
    pub fn alloc(&mut self) -> Option<SlotId> {
        if self.failed.is_some() || self.outstanding >= self.layout.slots {
            return None;
        }
        let slot = lock(&self.free).ids.pop()?;
        self.state[slot as usize] = SlotState::Lent;
        self.outstanding += 1;
        Some(SlotId(slot))
    }

    /// Writes `payload` at the start of `slot`, which this side must hold (from
    /// [`PoolWriter::alloc`], not yet released). The bytes after the payload up to the next
    /// multiple of 8 become zero; the rest of the slot is left as it was.
    pub fn write(&mut self, slot: SlotId, payload: &[u8]) -> Result<(), PoolError> {
        if self.state.get(slot.index()) != Some(&SlotState::Lent) {
            return Err(PoolError::NotAllocated(slot));
        }
        if payload.len() > self.layout.slot_bytes {
            return Err(PoolError::TooLong {
                len: payload.len(),
                slot_bytes: self.layout.slot_bytes,
            });
        }
        let start = slot.index() * self.layout.slot_bytes / 8;
        let words = &self.region[start..start + self.layout.slot_bytes / 8];
        let mut chunks = payload.chunks_exact(8);
        for (word, chunk) in words.iter().zip(&mut chunks) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            word.store(u64::from_ne_bytes(b), Ordering::Relaxed);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            words[payload.len() / 8].store(u64::from_ne_bytes(b), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Where `payload` lies when it is (a part of) an application's send buffer from this
    /// pool's [`PoolWriter::lender`]: its slot and its offset in the slot. `None` for any
    /// other memory (it is then copied).
    pub fn lent_slot(&self, payload: &[u8]) -> Option<(SlotId, u32)> {
        let base = self.region.as_ptr() as usize;
        let at = (payload.as_ptr() as usize).checked_sub(base)?;
        if payload.is_empty() || at >= self.layout.bytes() {
            return None;
        }
        let (slot, offset) = (at / self.layout.slot_bytes, at % self.layout.slot_bytes);
        if offset + payload.len() > self.layout.slot_bytes || !lock(&self.free).app[slot] {
            return None;
        }
        // Below a slot count of at most 2^24 and a slot of at most 1 GiB.
        Some((SlotId(slot as u32), offset as u32))
    }

    /// Whether another send may be outstanding now (fewer than `slots` are, and the pool has
    /// not failed): what a send of an application's buffer waits for.
    pub fn can_send_lent(&self) -> bool {
        self.failed.is_none() && self.outstanding < self.layout.slots
    }

    /// Records a send of `payload`, an application's buffer in `slot` (from
    /// [`PoolWriter::lent_slot`]): outstanding until the peer returns it, and the buffer is
    /// kept from being freed until then. Refused (nothing changes) unless
    /// [`PoolWriter::can_send_lent`].
    pub fn send_lent(&mut self, slot: SlotId, payload: &Bytes) -> Result<(), PoolError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        if self.outstanding >= self.layout.slots || slot.index() >= self.layout.slots {
            return Err(PoolError::NotAllocated(slot));
        }
        let i = slot.index();
        self.out[i] += 1;
        self.outstanding += 1;
        if self.keep[i].is_none() {
            self.keep[i] = Some(payload.clone());
        }
        Ok(())
    }

    /// Takes back `slot`, which the peer returned: it must be in the pool and have a send
    /// outstanding. Anything else means the peer is corrupt: a *peer* [`PoolError`] that fails
    /// the pool for good.
    pub fn release(&mut self, slot: SlotId) -> Result<(), PoolError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let i = slot.index();
        if self.out.get(i).is_some_and(|n| *n > 0) {
            self.out[i] -= 1;
            self.outstanding -= 1;
            if self.out[i] == 0 {
                // The application's buffer may be freed now (dropped here if this was the last
                // view: its slot then joins the free list; no lock is held here).
                drop(self.keep[i].take());
            }
            return Ok(());
        }
        let e = match self.state.get(i) {
            Some(SlotState::Lent) => {
                self.state[i] = SlotState::Returned;
                self.outstanding -= 1;
                // At most `slots` ids are ever in the list (each slot leaves it before it can
                // come back), and its capacity is `slots`: no allocation.
                lock(&self.free).ids.push(slot.get());
                return Ok(());
            }
            Some(SlotState::Fresh) => PoolError::NeverLent(slot),
            Some(SlotState::Returned) => PoolError::ReturnedTwice(slot),
            None => PoolError::SlotOutOfRange {
                slot: slot.get(),
                slots: self.layout.slots,
            },
        };
        self.failed = Some(e);
        Err(e)
    }

    /// Slots free to lend for a copy now (0 once the pool failed).
    pub fn available(&self) -> usize {
        if self.failed.is_some() {
            0
        } else {
            lock(&self.free)
                .ids
                .len()
                .min(self.layout.slots - self.outstanding)
        }
    }

    /// Sends outstanding: slots lent for copies, and sends of application buffers, that the
    /// peer has not returned.
    pub fn lent(&self) -> usize {
        self.outstanding
    }

    /// The pool's layout.
    pub fn layout(&self) -> PoolLayout {
        self.layout
    }

    /// The error that failed the pool, if one did.
    pub fn failed(&self) -> Option<PoolError> {
        self.failed
    }
}

impl<R: Deref<Target = [AtomicU64]> + Clone + Send + Sync + 'static> PoolWriter<R> {
    /// A [`transport_core::BufferPool`] whose buffers are free slots of this pool, for
    /// payloads longer than `min_len` (shorter ones travel inline: heap buffers serve them),
    /// so that sending one costs no copy. It lends at most all slots but a quarter (at least
    /// one) at once: the rest stay for the copies of other payloads, so that buffers an
    /// application keeps cannot stop its other sends.
    pub fn lender(&self, min_len: usize) -> lend::SlotLender<R> {
        let reserve = (self.layout.slots / 4).max(1);
        lend::SlotLender::new(
            self.region.clone(),
            self.layout,
            self.free.clone(),
            min_len,
            self.layout.slots.saturating_sub(reserve),
        )
    }
}

/// Slots whose last view was dropped, waiting to be sent back. Shared between the reader and
/// the owners of the views it handed out (which may be dropped on any thread).
type ReturnQueue = Arc<Mutex<Back>>;

/// What [`ReturnQueue`] guards.
#[derive(Debug)]
struct Back {
    /// Slots whose last view was dropped, oldest first.
    queue: VecDeque<SlotId>,
    /// Payloads handed out whose return has not been popped yet: the application holds a
    /// view, or the slot waits in `queue`. At most `slots` (a slot may be named by several at
    /// once: an application's buffer sent again before its first send came back).
    held: usize,
}

fn lock_back(q: &Mutex<Back>) -> std::sync::MutexGuard<'_, Back> {
    // A panic elsewhere while the lock was held cannot leave the queue half-changed (a push,
    // a pop or a count is the whole critical section): go on with it.
    q.lock().unwrap_or_else(|e| e.into_inner())
}

/// A handle on a [`PoolReader`]'s return queue, for whoever sends the returns back (on any
/// thread, also after the reader is gone): [`PoolReader::returns`].
#[derive(Debug, Clone)]
pub struct Returns(ReturnQueue);

impl Returns {
    /// Moves up to `out.len()` slots whose views are all dropped into `out`, oldest first, and
    /// returns how many. They are no longer held: the caller must send them back to the peer
    /// (as ring entries, [`crate::msg::encode_returns`]).
    pub fn pop(&self, out: &mut [SlotId]) -> usize {
        let mut back = lock_back(&self.0);
        let mut n = 0;
        for o in out.iter_mut() {
            let Some(slot) = back.queue.pop_front() else {
                break;
            };
            back.held -= 1;
            *o = slot;
            n += 1;
        }
        n
    }

    /// Slots waiting in the queue.
    pub fn pending(&self) -> usize {
        lock_back(&self.0).queue.len()
    }
}

/// The owner behind a payload's [`Bytes`]: the bytes in the peer's pool, kept mapped, and the
/// slot to return when the last view goes.
struct Loan {
    bytes: PeerBytes,
    slot: SlotId,
    returns: ReturnQueue,
    hook: Option<ReturnHook>,
}

/// Called after a slot joined the return queue ([`PoolReader::on_return`]).
pub type ReturnHook = Arc<dyn Fn() + Send + Sync>;

impl AsRef<[u8]> for Loan {
    fn as_ref(&self) -> &[u8] {
        self.bytes.as_ref()
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        // The reader holds at most `slots` payloads at once, so the queue's capacity
        // (`slots`) is never exceeded: no allocation here.
        lock_back(&self.returns).queue.push_back(self.slot);
        if let Some(hook) = &self.hook {
            hook();
        }
    }
}

/// The receiving side of a pool: the peer's pool, mapped, from which payloads are handed out
/// as [`Bytes`] without a copy.
///
/// **The bytes handed out stay writable by the peer** for as long as they are held (see
/// [`PeerBytes`]): they are untrusted content, to be parsed into a copy by whoever reads them,
/// and this crate never reads them to decide anything.
pub struct PoolReader {
    region: Region,
    /// Where the pool starts in `region`, in bytes.
    base: usize,
    layout: PoolLayout,
    /// The return queue and the count of payloads held ([`Back`]).
    returns: ReturnQueue,
    hook: Option<ReturnHook>,
    failed: Option<PoolError>,
}

impl fmt::Debug for PoolReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolReader")
            .field("layout", &self.layout)
            .field("held", &self.held())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for Loan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Loan")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

impl PoolReader {
    /// Calls `hook` (on whatever thread drops it) each time the last view of a payload is
    /// dropped and its slot joins the return queue: the transport's cue to send returns.
    pub fn on_return(&mut self, hook: ReturnHook) {
        self.hook = Some(hook);
    }

    /// The receiver's side of the peer's pool, mapped as `region` (from
    /// [`Region::map`] of the descriptor the peer sent, at [`PoolLayout::bytes`] of this side's
    /// expected layout). This process must only read that region.
    pub fn new(region: Region, layout: PoolLayout) -> Result<PoolReader, PoolError> {
        PoolReader::new_at(region, 0, layout)
    }

    /// [`PoolReader::new`] for a pool that starts `base` bytes into `region` (after the rings
    /// of a connection's region, [`crate::side::SideLayout`]).
    pub fn new_at(
        region: Region,
        base: usize,
        layout: PoolLayout,
    ) -> Result<PoolReader, PoolError> {
        let need = base.saturating_add(layout.bytes());
        if region.bytes() < need {
            return Err(PoolError::RegionTooSmall {
                got: region.bytes(),
                need,
            });
        }
        Ok(PoolReader {
            region,
            base,
            layout,
            returns: Arc::new(Mutex::new(Back {
                queue: VecDeque::with_capacity(layout.slots),
                held: 0,
            })),
            hook: None,
            failed: None,
        })
    }

    /// The payload of `len` bytes at `offset` in `slot`, as a ring entry from the peer named
    /// them, as [`Bytes`] over the mapping (no copy; the mapping stays alive while any clone
    /// does). When the last clone is dropped, `slot` joins the return queue
    /// ([`PoolReader::pop_returns`]).
    ///
    /// The three are checked first ([`PoolLayout::payload_range`]), and fewer than `slots`
    /// payloads may be held already; anything else is a *peer* [`PoolError`] that fails the
    /// reader for good.
    ///
    /// The `Bytes` are the peer's memory: it can change them at any time. Treat them as
    /// untrusted and unstable (copy before validating what matters).
    pub fn take(&mut self, slot: SlotId, offset: u32, len: u32) -> Result<Bytes, PoolError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let range = match self.layout.payload_range(slot, offset, len) {
            Ok(r) => r,
            Err(e) => return Err(self.fail(e)),
        };
        let Some(bytes) = self.region.peer_bytes(self.base + range.start, range.len()) else {
            // `new` checked that the region holds the whole layout: cannot happen.
            return Err(self.fail(PoolError::RegionTooSmall {
                got: self.region.bytes(),
                need: range.end,
            }));
        };
        let counted = {
            let mut back = lock_back(&self.returns);
            let room = back.held < self.layout.slots;
            back.held += usize::from(room);
            room
        };
        if !counted {
            return Err(self.fail(PoolError::TooManyHeld(slot)));
        }
        Ok(Bytes::from_owner(Loan {
            bytes,
            slot,
            returns: self.returns.clone(),
            hook: self.hook.clone(),
        }))
    }

    fn fail(&mut self, e: PoolError) -> PoolError {
        self.failed = Some(e);
        e
    }

    /// Moves up to `out.len()` slots whose views are all dropped into `out`, oldest first, and
    /// returns how many ([`Returns::pop`]).
    pub fn pop_returns(&mut self, out: &mut [SlotId]) -> usize {
        Returns(self.returns.clone()).pop(out)
    }

    /// A handle on the return queue, to send returns back from any thread (for example from
    /// the [`PoolReader::on_return`] hook, as the transport does).
    pub fn returns(&self) -> Returns {
        Returns(self.returns.clone())
    }

    /// Slots waiting in the return queue.
    pub fn pending_returns(&self) -> usize {
        lock_back(&self.returns).queue.len()
    }

    /// Payloads handed out and not yet popped from the return queue.
    pub fn held(&self) -> usize {
        lock_back(&self.returns).held
    }

    /// The pool's layout.
    pub fn layout(&self) -> PoolLayout {
        self.layout
    }

    /// The error that failed the reader, if one did.
    pub fn failed(&self) -> Option<PoolError> {
        self.failed
    }
}

#[cfg(test)]
mod tests;
