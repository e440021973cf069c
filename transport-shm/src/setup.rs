//! Connection set-up over a Unix socket: each side sends a hello and the memfd of the region
//! it writes (`SCM_RIGHTS`), and maps the peer's.
//!
//! Both sides send first, then receive, so neither waits on the other. A hello is 32 bytes,
//! its numbers little-endian:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `TSHM` |
//! | 4..6 | version (2) |
//! | 6..8 | zero |
//! | 8..12 | the sender's data ring: entries (a power of two) |
//! | 12..16 | the sender's return ring: entries (a power of two) |
//! | 16..20 | the sender's pool: slots (a power of two) |
//! | 20..24 | the sender's pool: bytes per slot (a multiple of 64) |
//! | 24..28 | the longest payload the sender sends inline ([`crate::msg`]) |
//! | 28..32 | zero |
//!
//! and comes with exactly one descriptor: a memfd sealed against shrinking, holding the
//! sender's region ([`SideLayout::bytes`]). The receiver checks the hello against
//! its own [`Limits`] before mapping anything, maps exactly the size the hello implies, and
//! closes every descriptor it does not keep. Whatever the peer sends, the set-up ends within
//! its time limit with the established connection or a typed [`SetupError`].

use crate::msg::MAX_INLINE_LIMIT;
use crate::pool::{PoolError, PoolLayout};
use crate::region::{Region, RegionError};
use crate::ring::{RingError, RingLayout};
use crate::side::{SideLayout, SideTooLarge};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The hello's first four bytes.
pub const MAGIC: [u8; 4] = *b"TSHM";
/// The set-up's version (3: a payload in a slot may start at an offset, [`crate::msg`]).
pub const VERSION: u16 = 3;
/// Bytes in a hello.
pub const HELLO_LEN: usize = 32;

/// What one side announces: the layout of the region it writes ([`SideLayout`]) and how it
/// sends payloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Entries in the ring this side sends messages on.
    pub ring_entries: u32,
    /// Entries in the ring this side returns the peer's slots on: at least the peer's slots
    /// (checked by the peer).
    pub return_entries: u32,
    /// Slots in this side's pool.
    pub pool_slots: u32,
    /// Bytes per slot.
    pub slot_bytes: u32,
    /// The longest payload this side sends inline.
    pub inline_limit: u32,
}

impl Hello {
    /// A hello with a data ring of `entries` and the smallest return ring and pool (two slots
    /// of 64 bytes), payloads up to 48 bytes inline: for tests of the set-up itself.
    pub fn ring(entries: u32) -> Hello {
        Hello {
            ring_entries: entries,
            return_entries: 2,
            pool_slots: 2,
            slot_bytes: 64,
            inline_limit: 48,
        }
    }

    /// The layout of the region this hello announces (`Err` when it is not one).
    pub fn layout(&self) -> Result<SideLayout, SetupError> {
        let data = RingLayout::new(self.ring_entries as usize)?;
        let returns = RingLayout::new(self.return_entries as usize)?;
        let pool = PoolLayout::new(self.pool_slots as usize, self.slot_bytes as usize)?;
        if self.inline_limit as usize > MAX_INLINE_LIMIT {
            return Err(SetupError::InlineTooLong(self.inline_limit));
        }
        Ok(SideLayout::new(data, returns, pool)?)
    }

    /// The hello's bytes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let fields = [
            self.ring_entries,
            self.return_entries,
            self.pool_slots,
            self.slot_bytes,
            self.inline_limit,
        ];
        for (i, f) in fields.iter().enumerate() {
            b[8 + 4 * i..12 + 4 * i].copy_from_slice(&f.to_le_bytes());
        }
        b
    }

    /// A hello from its bytes: the magic, the version and the zero fields checked.
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, SetupError> {
        if b[0..4] != MAGIC {
            return Err(SetupError::BadMagic([b[0], b[1], b[2], b[3]]));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(SetupError::BadVersion(version));
        }
        if b[6..8] != [0, 0] || b[28..32] != [0; 4] {
            return Err(SetupError::Reserved);
        }
        let field = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok(Hello {
            ring_entries: field(8),
            return_entries: field(12),
            pool_slots: field(16),
            slot_bytes: field(20),
            inline_limit: field(24),
        })
    }
}

/// What this side accepts from a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most entries each of a peer's rings may have (default 4 096: 256 KiB of ring).
    pub max_ring_entries: u32,
    /// The most bytes a peer's pool may have (default 64 MiB).
    pub max_pool_bytes: usize,
    /// How long the whole set-up may take (default 5 s).
    pub timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_ring_entries: 4096,
            max_pool_bytes: 64 << 20,
            timeout: Duration::from_secs(5),
        }
    }
}

/// Why a set-up failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The socket failed.
    #[error("set-up socket: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the socket before its hello was whole.
    #[error("the peer closed the socket after {0} of the hello's 16 bytes")]
    Closed(usize),
    /// The set-up took longer than [`Limits::timeout`].
    #[error("no complete hello from the peer within {0:?}")]
    TimedOut(Duration),
    /// Not this protocol.
    #[error("not a transport-shm hello (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// Another version of it.
    #[error("hello of version {0}, this side speaks 2")]
    BadVersion(u16),
    /// A field that must be zero is not.
    #[error("a reserved field of the hello is not zero")]
    Reserved,
    /// The peer's ring is larger than [`Limits::max_ring_entries`].
    #[error("the peer's ring has {got} entries, at most {max} are accepted")]
    RingTooLarge {
        /// What it asked.
        got: u32,
        /// The limit.
        max: u32,
    },
    /// A ring size that is not one (or this side's own hello is wrong).
    #[error("ring: {0}")]
    Ring(#[from] RingError),
    /// A pool layout that is not one.
    #[error("pool: {0}")]
    Pool(#[from] PoolError),
    /// Rings and pool together larger than a region may be.
    #[error("{0}")]
    TooLarge(#[from] SideTooLarge),
    /// The peer's pool is larger than [`Limits::max_pool_bytes`].
    #[error("the peer's pool has {got} bytes, at most {max} are accepted")]
    PoolTooLarge {
        /// What it asked.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// The peer's return ring cannot hold a return of every slot of this side's pool.
    #[error("the peer's return ring has {got} entries, this side's pool has {slots} slots")]
    ReturnRingTooSmall {
        /// Its entries.
        got: u32,
        /// This side's slots.
        slots: u32,
    },
    /// An inline limit above [`MAX_INLINE_LIMIT`].
    #[error("inline payloads of up to {0} bytes announced, at most 4096 are possible")]
    InlineTooLong(u32),
    /// The hello came without its region.
    #[error("the peer's hello came without a region descriptor")]
    NoRegion,
    /// More than one descriptor came (all closed).
    #[error("the peer sent {0} descriptors, one is expected (all closed)")]
    ExtraDescriptors(usize),
    /// The kernel cut the descriptors short (the peer sent more than fit).
    #[error("the peer's control message was truncated")]
    ControlTruncated,
    /// The region could not be made, or the peer's could not be mapped.
    #[error("region: {0}")]
    Region(#[from] RegionError),
}

/// Both regions, mapped, and the socket (whose closing tells that the peer is gone).
#[derive(Debug)]
pub struct Established {
    /// The region this side writes its ring in (the peer reads it).
    pub mine: Region,
    /// Its layout.
    pub my_layout: SideLayout,
    /// What this side announced.
    pub my_hello: Hello,
    /// The peer's region, which this side reads.
    pub theirs: Region,
    /// Its layout.
    pub their_layout: SideLayout,
    /// What the peer announced.
    pub their_hello: Hello,
    /// The set-up socket.
    pub stream: UnixStream,
}

/// Sets up a connection over `stream`: announces `mine` with its new region, then takes the
/// peer's hello and region, within `limits`.
pub async fn handshake(
    stream: UnixStream,
    mine: Hello,
    limits: &Limits,
) -> Result<Established, SetupError> {
    match tokio::time::timeout(limits.timeout, exchange(stream, mine, limits)).await {
        Ok(r) => r,
        Err(_) => Err(SetupError::TimedOut(limits.timeout)),
    }
}

async fn exchange(
    stream: UnixStream,
    mine: Hello,
    limits: &Limits,
) -> Result<Established, SetupError> {
    let my_layout = mine.layout()?;
    let (region, fd) = Region::create("transport-shm", my_layout.bytes())?;
    send_hello(&stream, &mine.encode(), &fd).await?;
    drop(fd);
    let (bytes, their_fd) = recv_hello(&stream).await?;
    let theirs = Hello::decode(&bytes)?;
    for got in [theirs.ring_entries, theirs.return_entries] {
        if got > limits.max_ring_entries {
            return Err(SetupError::RingTooLarge {
                got,
                max: limits.max_ring_entries,
            });
        }
    }
    let their_layout = theirs.layout()?;
    if their_layout.pool().bytes() > limits.max_pool_bytes {
        return Err(SetupError::PoolTooLarge {
            got: their_layout.pool().bytes(),
            max: limits.max_pool_bytes,
        });
    }
    if theirs.return_entries < mine.pool_slots {
        return Err(SetupError::ReturnRingTooSmall {
            got: theirs.return_entries,
            slots: mine.pool_slots,
        });
    }
    let their_fd = their_fd.ok_or(SetupError::NoRegion)?;
    let their_region = Region::map(their_fd.as_fd(), their_layout.bytes())?;
    Ok(Established {
        mine: region,
        my_layout,
        my_hello: mine,
        theirs: their_region,
        their_layout,
        their_hello: theirs,
        stream,
    })
}

async fn send_hello(stream: &UnixStream, hello: &[u8], fd: &OwnedFd) -> Result<(), SetupError> {
    let fds = [fd.as_raw_fd()];
    let mut sent = 0;
    while sent < hello.len() {
        let rest = &hello[sent..];
        // The descriptor goes with the first byte; a partial write sends the rest plainly.
        let with_fd = sent == 0;
        let n = stream
            .async_io(Interest::WRITABLE, || {
                let iov = [IoSlice::new(rest)];
                let cmsgs = [ControlMessage::ScmRights(&fds)];
                let cmsgs: &[ControlMessage<'_>] = if with_fd { &cmsgs } else { &[] };
                sendmsg::<()>(
                    stream.as_raw_fd(),
                    &iov,
                    cmsgs,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(std::io::Error::from)
            })
            .await?;
        sent += n;
    }
    Ok(())
}

/// The peer's hello and the descriptor that came with it (at most one: more fail the set-up,
/// all of them closed).
async fn recv_hello(stream: &UnixStream) -> Result<([u8; HELLO_LEN], Option<OwnedFd>), SetupError> {
    let mut hello = [0u8; HELLO_LEN];
    let mut got = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while got < HELLO_LEN {
        let (n, truncated) = stream
            .async_io(Interest::READABLE, || {
                let mut iov = [IoSliceMut::new(&mut hello[got..])];
                // Room for a few descriptors, so that extra ones are seen (and closed) rather
                // than cut short silently.
                let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 4]);
                let msg = recvmsg::<()>(
                    stream.as_raw_fd(),
                    &mut iov,
                    Some(&mut cmsg),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )
                .map_err(std::io::Error::from)?;
                let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
                if let Ok(cmsgs) = msg.cmsgs() {
                    for c in cmsgs {
                        if let ControlMessageOwned::ScmRights(received) = c {
                            for raw in received {
                                // SAFETY: the kernel just installed `raw` in this process for
                                // us; nothing else owns it.
                                fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
                            }
                        }
                    }
                }
                Ok((msg.bytes, truncated))
            })
            .await?;
        if truncated {
            return Err(SetupError::ControlTruncated);
        }
        if n == 0 {
            return Err(SetupError::Closed(got));
        }
        got += n;
    }
    if fds.len() > 1 {
        return Err(SetupError::ExtraDescriptors(fds.len()));
    }
    Ok((hello, fds.pop()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::{Consumer, Producer, ENTRY_BYTES};

    fn limits() -> Limits {
        Limits {
            timeout: Duration::from_secs(10),
            ..Limits::default()
        }
    }

    #[tokio::test]
    async fn two_sides_set_up_and_carry_entries_both_ways() {
        let (a, b) = UnixStream::pair().unwrap();
        let l = limits();
        let (a, b) = tokio::join!(
            handshake(a, Hello::ring(8), &l),
            handshake(b, Hello::ring(64), &l)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(
            (
                a.my_layout.data().entries(),
                a.their_layout.data().entries()
            ),
            (8, 64)
        );
        assert_eq!(
            (
                b.my_layout.data().entries(),
                b.their_layout.data().entries()
            ),
            (64, 8)
        );
        let mut a_tx = Producer::new(a.mine, a.my_layout.data()).unwrap();
        let mut b_rx = Consumer::new(b.theirs, b.their_layout.data()).unwrap();
        let mut b_tx = Producer::new(b.mine, b.my_layout.data()).unwrap();
        let mut a_rx = Consumer::new(a.theirs, a.their_layout.data()).unwrap();
        assert!(a_tx.try_push(&[1; ENTRY_BYTES]).unwrap());
        assert!(b_tx.try_push(&[2; ENTRY_BYTES]).unwrap());
        assert_eq!(b_rx.try_pop().unwrap(), Some([1; ENTRY_BYTES]));
        assert_eq!(a_rx.try_pop().unwrap(), Some([2; ENTRY_BYTES]));
    }

    #[test]
    fn hellos_round_trip_and_bad_ones_are_typed() {
        let h = Hello {
            ring_entries: 512,
            return_entries: 64,
            pool_slots: 32,
            slot_bytes: 1 << 16,
            inline_limit: 192,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert_eq!(h.layout().unwrap().pool().slot_bytes(), 1 << 16);
        let mut b = h.encode();
        b[0] = b'X';
        assert!(matches!(Hello::decode(&b), Err(SetupError::BadMagic(m)) if m == *b"XSHM"));
        let mut b = h.encode();
        b[4] = 1;
        assert!(matches!(Hello::decode(&b), Err(SetupError::BadVersion(1))));
        for i in [6, 7, 28, 31] {
            let mut b = h.encode();
            b[i] = 1;
            assert!(
                matches!(Hello::decode(&b), Err(SetupError::Reserved)),
                "{i}"
            );
        }
    }

    /// What this side's set-up returns when the raw peer on the other end of the socket
    /// does `peer` (with the socket's raw descriptor and the region it may send).
    async fn against(peer: impl FnOnce(&std::os::unix::net::UnixStream)) -> SetupError {
        let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        mine.set_nonblocking(true).unwrap();
        let mine = UnixStream::from_std(mine).unwrap();
        peer(&theirs);
        let l = Limits {
            timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let r = handshake(mine, Hello::ring(8), &l).await;
        drop(theirs);
        r.unwrap_err()
    }

    fn send_raw(s: &std::os::unix::net::UnixStream, bytes: &[u8], fds: &[std::os::fd::RawFd]) {
        let iov = [IoSlice::new(bytes)];
        let cmsg = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &cmsg };
        sendmsg::<()>(s.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap();
    }

    /// A sealed region as [`Hello::ring`] of `entries` announces it.
    fn sealed_ring(entries: u32) -> OwnedFd {
        let layout = Hello::ring(entries).layout().unwrap();
        Region::create("peer", layout.bytes()).unwrap().1
    }

    #[tokio::test]
    async fn a_hostile_peer_gets_typed_errors() {
        let hello = |n: u32| Hello::ring(n).encode();
        let e = against(|s| send_raw(s, b"GET / HTTP/1.1\r\nHost: localhost\r\n", &[])).await;
        assert!(matches!(e, SetupError::BadMagic(_)), "{e}");
        let e = against(|s| send_raw(s, &hello(8), &[])).await;
        assert!(matches!(e, SetupError::NoRegion), "{e}");
        let e = against(|s| send_raw(s, &hello(1 << 20), &[sealed_ring(8).as_raw_fd()])).await;
        assert!(
            matches!(
                e,
                SetupError::RingTooLarge {
                    got: 1_048_576,
                    max: 4096
                }
            ),
            "{e}"
        );
        let e = against(|s| send_raw(s, &hello(6), &[sealed_ring(8).as_raw_fd()])).await;
        assert!(matches!(e, SetupError::Ring(RingError::BadSize(6))), "{e}");
        // A ring that claims more entries than its region holds.
        let e = against(|s| send_raw(s, &hello(64), &[sealed_ring(8).as_raw_fd()])).await;
        assert!(
            matches!(e, SetupError::Region(RegionError::TooShort { .. })),
            "{e}"
        );
        // A pool above this side's limit, a return ring too small for this side's two slots,
        // an inline limit beyond what entries may carry, a pool that is not one.
        let e = against(|s| {
            let h = Hello {
                pool_slots: 512,
                slot_bytes: 1 << 20,
                ..Hello::ring(8)
            };
            send_raw(s, &h.encode(), &[sealed_ring(8).as_raw_fd()])
        })
        .await;
        assert!(
            matches!(e, SetupError::PoolTooLarge { got, max } if got == 512 << 20 && max == 64 << 20),
            "{e}"
        );
        let e = against(|s| {
            let h = Hello {
                return_entries: 1,
                ..Hello::ring(8)
            };
            send_raw(s, &h.encode(), &[sealed_ring(8).as_raw_fd()])
        })
        .await;
        assert!(matches!(e, SetupError::Ring(RingError::BadSize(1))), "{e}");
        let e = against(|s| {
            let h = Hello {
                inline_limit: 4097,
                ..Hello::ring(8)
            };
            send_raw(s, &h.encode(), &[sealed_ring(8).as_raw_fd()])
        })
        .await;
        assert!(matches!(e, SetupError::InlineTooLong(4097)), "{e}");
        let e = against(|s| {
            let h = Hello {
                slot_bytes: 100,
                ..Hello::ring(8)
            };
            send_raw(s, &h.encode(), &[sealed_ring(8).as_raw_fd()])
        })
        .await;
        assert!(matches!(e, SetupError::Pool(_)), "{e}");
        let (one, two) = (sealed_ring(8), sealed_ring(8));
        let e = against(|s| send_raw(s, &hello(8), &[one.as_raw_fd(), two.as_raw_fd()])).await;
        assert!(matches!(e, SetupError::ExtraDescriptors(2)), "{e}");
        // A memfd the peer could still shrink under the mapping.
        let unsealed = nix::sys::memfd::memfd_create(
            c"unsealed",
            nix::sys::memfd::MemFdCreateFlag::MFD_ALLOW_SEALING,
        )
        .unwrap();
        nix::unistd::ftruncate(&unsealed, 4096).unwrap();
        let e = against(|s| send_raw(s, &hello(8), &[unsealed.as_raw_fd()])).await;
        assert!(
            matches!(e, SetupError::Region(RegionError::NotSealed { .. })),
            "{e}"
        );
    }

    #[tokio::test]
    async fn a_return_ring_smaller_than_this_sides_pool_is_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let l = limits();
        let eight_slots = Hello {
            pool_slots: 8,
            ..Hello::ring(8)
        };
        let (a, b) = tokio::join!(
            handshake(a, eight_slots, &l),
            handshake(b, Hello::ring(8), &l)
        );
        let e = a.unwrap_err();
        assert!(
            matches!(e, SetupError::ReturnRingTooSmall { got: 2, slots: 8 }),
            "{e}"
        );
        // The other side holds two slots, which the first side's return ring can take.
        assert!(b.is_ok());
    }

    #[tokio::test]
    async fn a_peer_that_stalls_or_leaves_mid_hello_ends_the_set_up() {
        let hello = Hello::ring(8).encode();
        let e = against(|_| {}).await;
        assert!(matches!(e, SetupError::TimedOut(_)), "silent: {e}");
        let e = against(|s| send_raw(s, &hello[..5], &[sealed_ring(8).as_raw_fd()])).await;
        assert!(matches!(e, SetupError::TimedOut(_)), "half a hello: {e}");
        let e = against(|s| {
            send_raw(s, &hello[..5], &[]);
            s.shutdown(std::net::Shutdown::Write).unwrap();
        })
        .await;
        assert!(matches!(e, SetupError::Closed(5)), "closed: {e}");
    }
}
