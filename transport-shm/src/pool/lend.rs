//! Send buffers in free slots of this side's pool: a payload the application writes there is
//! sent by naming its slot, without a copy.
//!
//! [`SlotLender`] is the sending half's [`BufferPool`] ([`transport_core::MessageSender::buffer_pool`]):
//! `alloc` takes a free slot off the pool's free list and hands it out as a [`SendBuffer`]
//! over the shared memory (`SlotBuffer`). Frozen, the buffer becomes the payload's
//! [`bytes::Bytes`]; when the sending half sends a payload that lies in such a slot, it names
//! the slot (and the offset of the payload in it) in the ring entry and keeps one view of the
//! payload until the peer returns the slot ([`super::PoolWriter::send_lent`]). The slot joins
//! the free list again only when the last view is dropped: the application's, and the one each
//! outstanding send keeps. So the bytes a peer reads never change while it may read them
//! (unless the peer itself writes them: it maps this side's region).
//!
//! A buffer is heap memory instead (sending it costs one copy, as a heap payload does) when the
//! payload is short enough to travel inline, longer than a slot, or when the application
//! already holds all slots but a reserve (a quarter, at least one), which stays for copies so
//! that buffers the application keeps cannot stop its other sends.
//!
//! ```
//! use bytes::BufMut;
//! use transport_core::BufferPool;
//! use transport_shm::pool::{PoolLayout, PoolWriter};
//! use transport_shm::region::Region;
//!
//! let layout = PoolLayout::new(4, 4096)?;
//! let (mine, _fd) = Region::create("pool", layout.bytes())?;
//! let writer = PoolWriter::new(mine, layout)?;
//! let lender = writer.lender(1024);
//! let mut buf = lender.alloc(3000);
//! assert!(buf.is_backend_memory(), "a slot of the pool");
//! buf.put_slice(&[7; 3000]);
//! let payload = buf.freeze();
//! assert_eq!(writer.lent_slot(&payload).map(|(_, offset)| offset), Some(0));
//! assert!(!lender.alloc(100).is_backend_memory(), "short payloads travel inline");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use super::{lock, PoolLayout, SharedFree};
use crate::region::SlotBytes;
use std::fmt;
use std::ops::Deref;
use std::sync::atomic::AtomicU64;
use transport_core::{BackendRegion, BufferPool, SendBuffer};

/// The [`BufferPool`] of a pool's free slots ([`super::PoolWriter::lender`]).
pub struct SlotLender<R> {
    region: R,
    layout: PoolLayout,
    free: SharedFree,
    /// Payloads up to this long travel inline: heap buffers serve them.
    min_len: usize,
    /// Slots the application may hold at once.
    max_app: usize,
}

impl<R> fmt::Debug for SlotLender<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotLender")
            .field("layout", &self.layout)
            .field("min_len", &self.min_len)
            .field("max_app", &self.max_app)
            .finish_non_exhaustive()
    }
}

impl<R> SlotLender<R> {
    pub(super) fn new(
        region: R,
        layout: PoolLayout,
        free: SharedFree,
        min_len: usize,
        max_app: usize,
    ) -> SlotLender<R> {
        SlotLender {
            region,
            layout,
            free,
            min_len,
            max_app,
        }
    }

    /// Slots held by the application's buffers now.
    pub fn held(&self) -> usize {
        lock(&self.free).app_count
    }
}

impl<R: Deref<Target = [AtomicU64]> + Clone + Send + Sync + 'static> BufferPool for SlotLender<R> {
    /// A free slot of the pool when `capacity` is above the inline limit and at most a slot,
    /// and the application holds fewer slots than it may; heap memory otherwise.
    fn alloc(&self, capacity: usize) -> SendBuffer {
        if capacity > self.min_len && capacity <= self.layout.slot_bytes() {
            let mut free = lock(&self.free);
            if free.app_count < self.max_app {
                if let Some(slot) = free.ids.pop() {
                    free.app[slot as usize] = true;
                    free.app_count += 1;
                    drop(free);
                    let words = self.layout.slot_bytes() / 8;
                    let bytes = SlotBytes::new(self.region.clone(), slot as usize * words, words)
                        .expect("the writer checked that its region holds the pool");
                    return SendBuffer::from_region(Box::new(SlotBuffer {
                        bytes,
                        slot,
                        free: self.free.clone(),
                    }));
                }
            }
        }
        SendBuffer::heap(capacity)
    }
}

/// A free slot lent to the application as a send buffer; back on the free list when dropped
/// (when the last view of the frozen payload is: the sending half keeps one per slot while
/// the peer may read it).
struct SlotBuffer<R> {
    bytes: SlotBytes<R>,
    slot: u32,
    free: SharedFree,
}

impl<R: Deref<Target = [AtomicU64]> + Send + Sync + 'static> BackendRegion for SlotBuffer<R> {
    fn as_slice(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.bytes.as_mut_slice()
    }
}

impl<R> Drop for SlotBuffer<R> {
    fn drop(&mut self) {
        let mut free = lock(&self.free);
        free.app[self.slot as usize] = false;
        free.app_count -= 1;
        // At most `slots` ids are ever in the list: no allocation.
        free.ids.push(self.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PoolError, PoolWriter, SlotId};
    use super::*;
    use crate::region::Region;
    use bytes::{BufMut, Bytes};

    fn writer(slots: usize) -> PoolWriter<Region> {
        let layout = PoolLayout::new(slots, 256).unwrap();
        let (mine, _fd) = Region::create("lend", layout.bytes()).unwrap();
        PoolWriter::new(mine, layout).unwrap()
    }

    fn filled(lender: &SlotLender<Region>, len: usize) -> Bytes {
        let mut b = lender.alloc(len);
        assert!(b.is_backend_memory());
        b.put_bytes(0x5a, len);
        b.freeze()
    }

    #[test]
    fn a_buffer_is_found_at_its_slot_and_offset_and_other_memory_is_not() {
        let tx = writer(4);
        let lender = tx.lender(64);
        let a = filled(&lender, 200);
        let b = filled(&lender, 200);
        let (sa, sb) = (tx.lent_slot(&a).unwrap(), tx.lent_slot(&b).unwrap());
        assert_ne!(sa.0, sb.0);
        assert_eq!((sa.1, sb.1), (0, 0));
        assert_eq!(tx.lent_slot(&a.slice(17..150)), Some((sa.0, 17)));
        assert_eq!(tx.lent_slot(&a.slice(17..17)), None, "empty");
        assert_eq!(tx.lent_slot(&Bytes::from(vec![1; 200])), None, "heap");
        // Memory of another pool is not this one's.
        let other = writer(4);
        assert_eq!(other.lent_slot(&a), None);
    }

    #[test]
    fn a_sent_buffer_is_freed_only_when_returned_and_dropped() {
        let mut tx = writer(4);
        let lender = tx.lender(64);
        let a = filled(&lender, 100);
        let (slot, _) = tx.lent_slot(&a).unwrap();
        assert_eq!((tx.available(), lender.held()), (3, 1));
        tx.send_lent(slot, &a).unwrap();
        tx.send_lent(slot, &a.slice(1..)).unwrap();
        assert_eq!(tx.lent(), 2);
        drop(a);
        // Two sends out: the buffer lives on in the writer.
        assert_eq!((tx.available(), lender.held()), (2, 1));
        tx.release(slot).unwrap();
        assert_eq!(lender.held(), 1, "one send still out");
        tx.release(slot).unwrap();
        assert_eq!((tx.available(), lender.held(), tx.lent()), (4, 0, 0));
        // A third return of it is the peer's mistake.
        assert_eq!(tx.release(slot), Err(PoolError::NeverLent(slot)));
    }

    #[test]
    fn no_more_sends_are_outstanding_than_slots() {
        let mut tx = writer(2);
        let lender = tx.lender(64);
        let a = filled(&lender, 100);
        let (slot, _) = tx.lent_slot(&a).unwrap();
        tx.send_lent(slot, &a).unwrap();
        assert!(tx.can_send_lent());
        tx.send_lent(slot, &a).unwrap();
        assert!(!tx.can_send_lent());
        assert_eq!(tx.alloc(), None, "no copy either");
        assert_eq!(tx.send_lent(slot, &a), Err(PoolError::NotAllocated(slot)));
        tx.release(slot).unwrap();
        assert!(tx.can_send_lent());
    }

    #[test]
    fn the_application_may_hold_all_slots_but_a_reserve() {
        for (slots, lendable) in [(1, 0), (2, 1), (4, 3), (8, 6), (16, 12)] {
            let tx = writer(slots);
            let lender = tx.lender(64);
            let held: Vec<_> = (0..slots).map(|_| lender.alloc(100)).collect();
            let n = held.iter().filter(|b| b.is_backend_memory()).count();
            assert_eq!(n, lendable, "{slots} slots");
            assert_eq!(tx.available(), slots - lendable);
        }
    }

    #[test]
    fn a_buffer_dropped_unsent_or_after_the_writer_is_gone_frees_its_slot() {
        let tx = writer(4);
        let lender = tx.lender(64);
        drop(lender.alloc(100));
        assert_eq!(tx.available(), 4);
        let kept = filled(&lender, 100);
        drop(tx);
        assert_eq!(
            &kept[..],
            &[0x5a; 100][..],
            "the mapping outlives the writer"
        );
        drop(kept);
        assert_eq!(lender.held(), 0);
    }

    #[test]
    fn a_copy_slot_and_a_buffer_slot_keep_their_own_accounts() {
        let mut tx = writer(4);
        let lender = tx.lender(64);
        let copy = tx.alloc().unwrap();
        let a = filled(&lender, 100);
        let (slot, _) = tx.lent_slot(&a).unwrap();
        assert_ne!(copy, slot);
        tx.send_lent(slot, &a).unwrap();
        drop(a);
        tx.release(slot).unwrap();
        // The buffer's slot is free again and may be taken for a copy, and returned as one.
        let again: Vec<SlotId> = std::iter::from_fn(|| tx.alloc()).collect();
        assert!(again.contains(&slot));
        tx.release(slot).unwrap();
        tx.release(copy).unwrap();
        assert_eq!(tx.release(copy), Err(PoolError::ReturnedTwice(copy)));
    }
}
