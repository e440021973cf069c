//! Shared regions: a memfd that its creator sizes and seals, mapped by both processes.
//!
//! The creator makes the memfd ([`Region::create`]), sizes it, seals it against shrinking and
//! growing (`F_SEAL_SHRINK`, `F_SEAL_GROW`, then `F_SEAL_SEAL` so the seals stay), and maps it.
//! The other side maps the descriptor it received ([`Region::map`]) only if it is sealed
//! against shrinking and at least as long as this side's settings say: a peer that could
//! truncate the file under a mapping would make every access past the new end fault
//! (`SIGBUS`), a crash the peer could cause at will. The mapping's length comes from this
//! side's settings, never from the file, and is mapped once.
//!
//! A region is a slice of `AtomicU64`: the peer may write any word at any time, and atomic
//! loads and stores keep that defined (no torn word, no data race in Rust's sense).
//!
//! This module holds the crate's `unsafe` code: `mmap`, `munmap`, viewing the mapping as
//! atomics, and viewing a range of it as bytes ([`PeerBytes`], for payloads handed out without
//! a copy; `SlotBytes`, for send buffers in this side's own pool).

use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use std::ffi::CString;
use std::num::NonZeroUsize;
use std::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The largest region this crate maps: 1 GiB.
pub const MAX_REGION_BYTES: usize = 1 << 30;

/// Why a region cannot be made or mapped.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The size asked for is zero, not a multiple of 8, or over [`MAX_REGION_BYTES`].
    #[error("a region of {0} bytes: a multiple of 8 from 8 to 1 GiB is needed")]
    BadSize(usize),
    /// The peer's descriptor is not sealed against shrinking (or cannot be sealed: not a
    /// memfd), so the peer could truncate it under the mapping.
    #[error("the peer's region is not sealed against shrinking (seals {seals:#x})")]
    NotSealed {
        /// The seals found (`F_GET_SEALS`); -1 when the descriptor takes none.
        seals: i32,
    },
    /// The peer's descriptor is shorter than the region this side expects.
    #[error("the peer's region holds {got} bytes, {need} expected")]
    TooShort {
        /// Its length.
        got: u64,
        /// The length this side maps.
        need: usize,
    },
    /// A system call failed.
    #[error("{call}: {errno}")]
    Sys {
        /// Which.
        call: &'static str,
        /// Its error.
        errno: nix::errno::Errno,
    },
}

fn sys(call: &'static str) -> impl FnOnce(nix::errno::Errno) -> RegionError {
    move |errno| RegionError::Sys { call, errno }
}

/// A shared mapping, viewed as words; cheap to clone (the mapping is unmapped when the last
/// clone goes).
#[derive(Debug, Clone)]
pub struct Region(Arc<Mapping>);

#[derive(Debug)]
struct Mapping {
    ptr: NonNull<AtomicU64>,
    words: usize,
}

// SAFETY: the mapping is plain memory that lives until `Drop` unmaps it, and it is only ever
// reached through `&[AtomicU64]`, which is `Send` and `Sync`.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` and the length are those `mmap` returned and took; no reference into
        // the mapping outlives this value (every slice borrows from it).
        let _ = unsafe { munmap(self.ptr.cast(), self.words * 8) };
    }
}

impl Deref for Region {
    type Target = [AtomicU64];

    fn deref(&self) -> &[AtomicU64] {
        // SAFETY: `ptr` is page-aligned (so aligned for `AtomicU64`), valid for `words` words
        // for as long as the `Mapping` lives (which this borrow of `self` ensures), and the
        // memory is only accessed atomically, by this process and the peer alike.
        unsafe { std::slice::from_raw_parts(self.0.ptr.as_ptr(), self.0.words) }
    }
}

fn check_size(bytes: usize) -> Result<NonZeroUsize, RegionError> {
    match NonZeroUsize::new(bytes) {
        Some(n) if bytes % 8 == 0 && bytes <= MAX_REGION_BYTES => Ok(n),
        _ => Err(RegionError::BadSize(bytes)),
    }
}

impl Region {
    /// A new zeroed region of `bytes` (a multiple of 8, at most [`MAX_REGION_BYTES`]) in a
    /// memfd named `name` (for `/proc/PID/fd` and debugging), sealed against shrinking and
    /// growing, and mapped; with the descriptor to pass to the peer.
    pub fn create(name: &str, bytes: usize) -> Result<(Region, OwnedFd), RegionError> {
        let len = check_size(bytes)?;
        let name = CString::new(name.replace('\0', "")).expect("no NUL left");
        let fd = memfd_create(
            &name,
            MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
        )
        .map_err(sys("memfd_create"))?;
        nix::unistd::ftruncate(&fd, bytes as i64).map_err(sys("ftruncate"))?;
        let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(seals)).map_err(sys("F_ADD_SEALS"))?;
        let region = Region::map_len(fd.as_fd(), len)?;
        Ok((region, fd))
    }

    /// Maps `bytes` of the peer's region `fd`: refused unless `fd` is sealed against shrinking
    /// and holds at least `bytes`.
    pub fn map(fd: BorrowedFd<'_>, bytes: usize) -> Result<Region, RegionError> {
        let len = check_size(bytes)?;
        let seals = match fcntl(fd.as_raw_fd(), FcntlArg::F_GET_SEALS) {
            Ok(s) => s,
            Err(_) => return Err(RegionError::NotSealed { seals: -1 }),
        };
        if seals & SealFlag::F_SEAL_SHRINK.bits() == 0 {
            return Err(RegionError::NotSealed { seals });
        }
        let got = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(sys("fstat"))?
            .st_size as u64;
        if got < bytes as u64 {
            return Err(RegionError::TooShort { got, need: bytes });
        }
        Region::map_len(fd, len)
    }

    fn map_len(fd: BorrowedFd<'_>, len: NonZeroUsize) -> Result<Region, RegionError> {
        // SAFETY: a fresh shared mapping chosen by the kernel (no address given), so it
        // overlaps nothing of ours; the file is at least `len` long and cannot shrink (sealed),
        // so every page of it stays backed.
        let ptr = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd,
                0,
            )
        }
        .map_err(sys("mmap"))?;
        Ok(Region(Arc::new(Mapping {
            ptr: ptr.cast(),
            words: len.get() / 8,
        })))
    }

    /// Bytes mapped.
    pub fn bytes(&self) -> usize {
        self.0.words * 8
    }

    /// `len` bytes from `offset` of this mapping as a byte view that keeps the mapping alive;
    /// `None` when the range is not inside the mapping (overflow included).
    ///
    /// Meant for a region the **peer** writes and this process only reads (the peer's payload
    /// pool, see [`crate::pool::PoolReader`]); read [`PeerBytes`] for what such a view is.
    /// Crate-private: a view must never meet a store of this process to the same memory, and
    /// only the pool's reader, which never stores, makes views.
    pub(crate) fn peer_bytes(&self, offset: usize, len: usize) -> Option<PeerBytes> {
        let end = offset.checked_add(len)?;
        if end > self.bytes() {
            return None;
        }
        Some(PeerBytes {
            region: self.clone(),
            offset,
            len,
        })
    }
}

/// Some consecutive words of a region, as a slice of their own (a ring or a pool laid out
/// inside a connection's region); holds the mapping alive.
#[derive(Debug, Clone)]
pub struct Words {
    region: Region,
    start: usize,
    len: usize,
}

impl Region {
    /// Words `start..start + len` of this region: `None` when they are not all inside it.
    pub fn words(&self, start: usize, len: usize) -> Option<Words> {
        let end = start.checked_add(len)?;
        (end <= self.len()).then(|| Words {
            region: self.clone(),
            start,
            len,
        })
    }
}

impl Deref for Words {
    type Target = [AtomicU64];

    fn deref(&self) -> &[AtomicU64] {
        &self.region[self.start..self.start + self.len]
    }
}

/// A range of a mapping viewed as bytes ([`AsRef<[u8]>`]), holding the mapping alive: the owner
/// behind a payload's [`bytes::Bytes`] when it is handed out without a copy.
///
/// **The bytes are the peer's, and stay writable by it.** The process on the other side can
/// change them at any time, including while they are being read, so two reads of one byte may
/// differ. They are untrusted content in every sense: whoever reads them must treat them like
/// bytes just received from a socket that could also rewrite them (parse into a copy, never
/// validate in place and then use), and this crate never reads them for its own decisions
/// (indices, lengths and kinds come from ring entries copied out once). Every bit pattern is
/// a valid `u8`, the range is inside the mapping and the mapping lives as long as this value, so
/// nothing the peer does can make a read fault or go out of bounds.
///
/// This process must not write the same range (through this or another [`Region`] of the
/// same memory) while a view is alive: the pool's reader never does, and the pool's writer is
/// the peer, in another process.
#[derive(Debug, Clone)]
pub struct PeerBytes {
    region: Region,
    offset: usize,
    len: usize,
}

impl PeerBytes {
    /// Where the view starts in its region, in bytes.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl AsRef<[u8]> for PeerBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `offset + len <= bytes()` was checked when the view was made (no overflow),
        // so the range lies inside the mapping, which `self.region` keeps mapped for as long as
        // the returned borrow of `self` lives; `u8` needs no alignment and every bit pattern is
        // a valid `u8`. The memory is shared with the peer process, which may write it at any
        // time: that is outside what this process's compiler can see or rely on (no reference
        // in this process writes it; see the type's docs), and the bytes are only ever handed
        // on as untrusted content, never read back by this crate to decide anything.
        unsafe {
            std::slice::from_raw_parts(
                self.region.0.ptr.as_ptr().cast::<u8>().add(self.offset),
                self.len,
            )
        }
    }
}

/// A slot of this process's **own** pool as bytes to write and read: the memory behind an
/// application's send buffer ([`crate::pool::lend`]), `len` words from word `start` of `words`.
///
/// The pool makes one only for a slot it has taken off its free list for that buffer, and
/// neither writes nor reads the slot any other way until the buffer is dropped and the slot
/// is free again: within this process the view is the slot's one user. The peer maps the
/// same memory and could write it (a hostile peer may scribble on this side's region); that
/// changes only the bytes this side sends it, never anything this side decides.
pub(crate) struct SlotBytes<R> {
    words: R,
    start: usize,
    len: usize,
}

impl<R: Deref<Target = [AtomicU64]>> SlotBytes<R> {
    /// Words `start..start + len` of `words`; `None` unless all are inside.
    pub(crate) fn new(words: R, start: usize, len: usize) -> Option<SlotBytes<R>> {
        let end = start.checked_add(len)?;
        (end <= words.len()).then_some(SlotBytes { words, start, len })
    }

    fn ptr(&self) -> *mut u8 {
        self.words[self.start..self.start + self.len]
            .as_ptr()
            .cast::<u8>()
            .cast_mut()
    }

    /// The slot's bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: the words are inside `self.words` (checked by `new`), which keeps them
        // mapped while this borrow lives; `u8` needs no alignment and takes any bit pattern;
        // `AtomicU64` is an `UnsafeCell`, so bytes of it may be read through this pointer, and
        // nothing else in this process writes the slot while the view lives (the type's docs).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len * 8) }
    }

    /// The slot's bytes, to write.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; the `&mut self` borrow makes this the only reference
        // through the view, and no other code in this process reads or writes the slot while
        // the view lives, so the exclusive slice aliases nothing (writes through an
        // `UnsafeCell`'s memory are allowed).
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len * 8) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::{Consumer, Producer, RingLayout, ENTRY_BYTES};
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_of_one_region_carry_a_ring() {
        let layout = RingLayout::new(16).unwrap();
        let (mine, fd) = Region::create("ring", layout.bytes()).unwrap();
        let theirs = Region::map(fd.as_fd(), layout.bytes()).unwrap();
        assert_ne!(mine.as_ptr(), theirs.as_ptr(), "two mappings");
        assert_eq!(theirs.bytes(), layout.bytes());
        let mut tx = Producer::new(mine, layout).unwrap();
        let mut rx = Consumer::new(theirs, layout).unwrap();
        for n in 0..100u8 {
            assert!(tx.try_push(&[n; ENTRY_BYTES]).unwrap());
            assert_eq!(rx.try_pop().unwrap(), Some([n; ENTRY_BYTES]));
        }
    }

    #[test]
    fn a_new_region_is_zeroed_and_sealed_against_resizing() {
        let (r, fd) = Region::create("zeroed", 4096).unwrap();
        assert!(r.iter().all(|w| w.load(Ordering::Relaxed) == 0));
        assert!(nix::unistd::ftruncate(&fd, 8).is_err(), "shrunk");
        assert!(nix::unistd::ftruncate(&fd, 8192).is_err(), "grown");
        let seals = fcntl(
            fd.as_raw_fd(),
            FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_WRITE),
        );
        assert!(seals.is_err(), "the seals are sealed");
    }

    #[test]
    fn a_region_that_could_shrink_is_refused() {
        let fd = memfd_create(c"unsealed", MemFdCreateFlag::MFD_ALLOW_SEALING).unwrap();
        nix::unistd::ftruncate(&fd, 4096).unwrap();
        match Region::map(fd.as_fd(), 4096) {
            Err(RegionError::NotSealed { seals }) => assert_eq!(seals, 0),
            other => panic!("{other:?}"),
        }
        // Sealed only against growing: still refused.
        fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_GROW)).unwrap();
        assert!(matches!(
            Region::map(fd.as_fd(), 4096),
            Err(RegionError::NotSealed { .. })
        ));
        // A descriptor that takes no seals at all (a pipe) is refused the same way.
        let (read, _write) = nix::unistd::pipe().unwrap();
        assert!(matches!(
            Region::map(read.as_fd(), 4096),
            Err(RegionError::NotSealed { seals: -1 })
        ));
    }

    #[test]
    fn a_region_shorter_than_expected_is_refused() {
        let (_r, fd) = Region::create("short", 4096).unwrap();
        match Region::map(fd.as_fd(), 8192) {
            Err(RegionError::TooShort { got, need }) => assert_eq!((got, need), (4096, 8192)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn peer_bytes_see_the_other_mapping_and_stay_inside_the_region() {
        let (mine, fd) = Region::create("bytes", 4096).unwrap();
        let theirs = Region::map(fd.as_fd(), 4096).unwrap();
        mine[1].store(u64::from_ne_bytes(*b"abcdefgh"), Ordering::Relaxed);
        let view = theirs.peer_bytes(9, 3).unwrap();
        assert_eq!(view.as_ref(), b"bcd");
        assert_eq!(view.offset(), 9);
        assert_eq!(theirs.peer_bytes(4096, 0).unwrap().as_ref(), b"");
        for (offset, len) in [(4096, 1), (4000, 97), (1, usize::MAX), (usize::MAX, 1)] {
            assert!(theirs.peer_bytes(offset, len).is_none(), "{offset}+{len}");
        }
        // The view keeps the mapping alive after every `Region` is gone.
        drop((mine, theirs, fd));
        assert_eq!(view.as_ref(), b"bcd");
    }

    #[test]
    fn sizes_outside_the_limits_are_refused() {
        for bad in [0, 7, 4097, MAX_REGION_BYTES + 8] {
            assert!(matches!(
                Region::create("bad", bad),
                Err(RegionError::BadSize(b)) if b == bad
            ));
        }
    }
}
