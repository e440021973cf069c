//! What one side's region holds: the ring it sends messages on, the ring it returns the
//! peer's payload slots on, and its own payload pool.
//!
//! Each side of a connection creates one region (one memfd) and writes it; the peer maps it
//! and reads it (and writes only the consumer's words of the two rings). Back to back, each
//! part starting on a cache line:
//!
//! | part | what | written by |
//! |---|---|---|
//! | data ring | messages to the peer ([`crate::msg`] entries) | this side (the peer's head and sleep words) |
//! | return ring | slots of the *peer's* pool this side is done with | this side (the peer's head and sleep words) |
//! | pool | payloads of messages to the peer ([`crate::pool`]) | this side |
//!
//! The return ring holds at least as many entries as the peer's pool has slots (each slot is
//! returned at most once before it is lent again), so returning never waits for room.
//!
//! # Example
//!
//! ```
//! use transport_shm::pool::PoolLayout;
//! use transport_shm::region::Region;
//! use transport_shm::ring::RingLayout;
//! use transport_shm::side::SideLayout;
//!
//! let side = SideLayout::new(RingLayout::new(256)?, RingLayout::new(64)?, PoolLayout::new(32, 65536)?)?;
//! let (region, _fd) = Region::create("side", side.bytes())?;
//! let parts = side.parts(&region).expect("the region holds the layout");
//! assert_eq!(parts.pool.len() * 8, 32 * 65536);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::pool::PoolLayout;
use crate::region::{Region, Words, MAX_REGION_BYTES};
use crate::ring::RingLayout;

/// The layout of one side's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SideLayout {
    data: RingLayout,
    returns: RingLayout,
    pool: PoolLayout,
}

/// A layout whose parts do not fit in one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a region of {bytes} bytes (rings and pool), at most {max} are allowed")]
pub struct SideTooLarge {
    /// What the parts need together.
    pub bytes: u128,
    /// [`MAX_REGION_BYTES`].
    pub max: usize,
}

/// The parts of a side's region, each a slice of its own.
#[derive(Debug, Clone)]
pub struct Parts {
    /// The data ring's words.
    pub data: Words,
    /// The return ring's words.
    pub returns: Words,
    /// The pool's words.
    pub pool: Words,
}

impl SideLayout {
    /// A side with these parts: refused when together they exceed [`MAX_REGION_BYTES`].
    pub fn new(
        data: RingLayout,
        returns: RingLayout,
        pool: PoolLayout,
    ) -> Result<SideLayout, SideTooLarge> {
        let bytes = data.bytes() as u128 + returns.bytes() as u128 + pool.bytes() as u128;
        if bytes > MAX_REGION_BYTES as u128 {
            return Err(SideTooLarge {
                bytes,
                max: MAX_REGION_BYTES,
            });
        }
        Ok(SideLayout {
            data,
            returns,
            pool,
        })
    }

    /// The data ring's layout.
    pub fn data(&self) -> RingLayout {
        self.data
    }

    /// The return ring's layout.
    pub fn returns(&self) -> RingLayout {
        self.returns
    }

    /// The pool's layout.
    pub fn pool(&self) -> PoolLayout {
        self.pool
    }

    /// Bytes the region holds (a multiple of 64: each part is).
    pub fn bytes(&self) -> usize {
        self.data.bytes() + self.returns.bytes() + self.pool.bytes()
    }

    /// Where the pool starts, in bytes.
    pub fn pool_offset(&self) -> usize {
        self.data.bytes() + self.returns.bytes()
    }

    /// The parts of `region` (`None` when it is smaller than [`SideLayout::bytes`]).
    pub fn parts(&self, region: &Region) -> Option<Parts> {
        let data_words = self.data.words();
        let returns_words = self.returns.words();
        Some(Parts {
            data: region.words(0, data_words)?,
            returns: region.words(data_words, returns_words)?,
            pool: region.words(data_words + returns_words, self.pool.bytes() / 8)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{PoolReader, PoolWriter};
    use crate::ring::{Consumer, Producer};
    use std::os::fd::AsFd;

    #[test]
    fn parts_lie_back_to_back_inside_the_region_and_work_across_mappings() {
        let side = SideLayout::new(
            RingLayout::new(4).unwrap(),
            RingLayout::new(2).unwrap(),
            PoolLayout::new(2, 64).unwrap(),
        )
        .unwrap();
        assert_eq!(side.bytes(), (16 + 32) * 8 + (16 + 16) * 8 + 128);
        assert_eq!(side.pool_offset(), (16 + 32) * 8 + (16 + 16) * 8);
        let (mine, fd) = Region::create("side", side.bytes()).unwrap();
        let theirs = Region::map(fd.as_fd(), side.bytes()).unwrap();
        let (m, t) = (side.parts(&mine).unwrap(), side.parts(&theirs).unwrap());
        let mut data_tx = Producer::new(m.data, side.data()).unwrap();
        let mut data_rx = Consumer::new(t.data, side.data()).unwrap();
        let mut ret_tx = Producer::new(m.returns, side.returns()).unwrap();
        let mut ret_rx = Consumer::new(t.returns, side.returns()).unwrap();
        let mut pool_tx = PoolWriter::new(m.pool, side.pool()).unwrap();
        let mut pool_rx =
            PoolReader::new_at(theirs.clone(), side.pool_offset(), side.pool()).unwrap();
        // Each part carries its own traffic, none overwrites another.
        let slot = pool_tx.alloc().unwrap();
        pool_tx.write(slot, b"payload").unwrap();
        assert!(data_tx.try_push(&[1; 64]).unwrap());
        assert!(ret_tx.try_push(&[2; 64]).unwrap());
        assert_eq!(data_rx.try_pop().unwrap(), Some([1; 64]));
        assert_eq!(ret_rx.try_pop().unwrap(), Some([2; 64]));
        assert_eq!(&pool_rx.take(slot, 0, 7).unwrap()[..], b"payload");
        // A region too small for the layout has no parts.
        let (small, _fd) = Region::create("small", side.bytes() - 64).unwrap();
        assert!(side.parts(&small).is_none());
    }

    #[test]
    fn a_side_larger_than_a_region_may_be_is_refused() {
        let big = PoolLayout::new(1 << 14, 1 << 16).unwrap(); // 1 GiB: the pool alone
        let e = SideLayout::new(
            RingLayout::new(2).unwrap(),
            RingLayout::new(2).unwrap(),
            big,
        )
        .unwrap_err();
        assert_eq!(e.max, MAX_REGION_BYTES);
        assert!(e.bytes > MAX_REGION_BYTES as u128);
    }
}
