//! Messages and the buffers they are made of.
//!
//! A message is a small header (at most [`MAX_HEADER_LEN`] bytes, stored inline: no
//! allocation) and a payload ([`Bytes`]). Payloads are reference-counted views: a backend can
//! hand out received payloads that point into its receive buffers (returned to the pool when the
//! last view drops) and can recognise send payloads that live in memory it owns (registered with
//! the NIC, on verbs), so that neither direction copies.

use bytes::{buf::UninitSlice, BufMut, Bytes, BytesMut};
use std::fmt;

/// Largest message header a transport carries, in bytes.
pub const MAX_HEADER_LEN: usize = 64;

/// A message header: up to [`MAX_HEADER_LEN`] bytes stored inline.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HeaderBytes {
    len: u8,
    buf: [u8; MAX_HEADER_LEN],
}

impl HeaderBytes {
    /// An empty header.
    pub const EMPTY: HeaderBytes = HeaderBytes {
        len: 0,
        buf: [0; MAX_HEADER_LEN],
    };

    /// Copies `bytes` into a header; `None` when longer than [`MAX_HEADER_LEN`].
    #[inline]
    pub fn new(bytes: &[u8]) -> Option<HeaderBytes> {
        if bytes.len() > MAX_HEADER_LEN {
            return None;
        }
        let mut h = HeaderBytes::EMPTY;
        h.buf[..bytes.len()].copy_from_slice(bytes);
        h.len = bytes.len() as u8;
        Some(h)
    }

    /// The header's bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }

    /// The header's bytes followed by zeros up to [`MAX_HEADER_LEN`]. A backend that has room
    /// for the whole array copies it with a few fixed-size moves, where a copy of
    /// [`HeaderBytes::len`] bytes is a call to `memcpy`.
    #[inline]
    pub fn padded(&self) -> &[u8; MAX_HEADER_LEN] {
        &self.buf
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True for a zero-length header.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Default for HeaderBytes {
    fn default() -> Self {
        HeaderBytes::EMPTY
    }
}

impl fmt::Debug for HeaderBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HeaderBytes({:02x?})", self.as_slice())
    }
}

impl<const N: usize> From<[u8; N]> for HeaderBytes {
    /// A header from a fixed-size array; `N > MAX_HEADER_LEN` is a compile-time error.
    fn from(a: [u8; N]) -> Self {
        const { assert!(N <= MAX_HEADER_LEN, "header longer than MAX_HEADER_LEN") };
        let mut h = HeaderBytes::EMPTY;
        h.buf[..N].copy_from_slice(&a);
        h.len = N as u8;
        h
    }
}

/// One message: a header and a payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Message {
    /// Protocol header (for RPC: `transport_rpc::RpcHeader`).
    pub header: HeaderBytes,
    /// Payload bytes.
    pub payload: Bytes,
}

impl Message {
    /// A message from a header and a payload.
    #[inline]
    pub fn new(header: HeaderBytes, payload: Bytes) -> Message {
        Message { header, payload }
    }

    /// Header plus payload length: what counts against a max message size.
    #[inline]
    pub fn len(&self) -> usize {
        self.header.len() + self.payload.len()
    }

    /// True when header and payload are both empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Memory a backend owns and lends out as a send buffer (registered memory, on verbs).
///
/// The region is fixed-size and initialised; [`SendBuffer`] tracks how much of it is filled.
/// When the buffer is frozen the region moves into the [`Bytes`] owner, so the backend gets
/// it back (to its pool) only when every view of the payload has been dropped — including the
/// views held by in-flight work requests.
pub trait BackendRegion: Send + Sync + 'static {
    /// The whole region.
    fn as_slice(&self) -> &[u8];
    /// The whole region, writable.
    fn as_mut_slice(&mut self) -> &mut [u8];
}

enum Repr {
    Heap(BytesMut),
    Backend {
        region: Box<dyn BackendRegion>,
        len: usize,
    },
}

/// A buffer to build a payload in, from [`crate::BufferPool::alloc`].
///
/// On socket backends it is plain heap memory; on verbs it is a slice of a registered slab, so
/// that sending it needs neither a copy nor a registration. Write into it with the
/// [`BufMut`] methods (`put_slice`, `put_u32_le`, ...), then [`SendBuffer::freeze`] it into
/// the message payload.
///
/// ```
/// use bytes::BufMut;
/// use transport_core::SendBuffer;
/// let mut buf = SendBuffer::heap(16);
/// buf.put_slice(b"hello");
/// let payload = buf.freeze();
/// assert_eq!(&payload[..], b"hello");
/// ```
pub struct SendBuffer {
    repr: Repr,
}

impl SendBuffer {
    /// A heap buffer with room for `capacity` bytes (it grows if more are written).
    pub fn heap(capacity: usize) -> SendBuffer {
        SendBuffer {
            repr: Repr::Heap(BytesMut::with_capacity(capacity)),
        }
    }

    /// A buffer over backend-owned memory (fixed capacity).
    pub fn from_region(region: Box<dyn BackendRegion>) -> SendBuffer {
        SendBuffer {
            repr: Repr::Backend { region, len: 0 },
        }
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Heap(b) => b.len(),
            Repr::Backend { len, .. } => *len,
        }
    }

    /// True when nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many bytes fit without growing (backend buffers never grow).
    pub fn capacity(&self) -> usize {
        match &self.repr {
            Repr::Heap(b) => b.capacity(),
            Repr::Backend { region, .. } => region.as_slice().len(),
        }
    }

    /// True when the memory belongs to the backend (zero-copy send).
    pub fn is_backend_memory(&self) -> bool {
        matches!(self.repr, Repr::Backend { .. })
    }

    /// The bytes written so far.
    pub fn filled(&self) -> &[u8] {
        match &self.repr {
            Repr::Heap(b) => b,
            Repr::Backend { region, len } => &region.as_slice()[..*len],
        }
    }

    /// Extends the filled part by `n` bytes and returns them for writing (`fill(n)` then
    /// write, for APIs that want a `&mut [u8]`). Returns `None` if a backend buffer has no room.
    pub fn fill(&mut self, n: usize) -> Option<&mut [u8]> {
        match &mut self.repr {
            Repr::Heap(b) => {
                let start = b.len();
                b.resize(start + n, 0);
                Some(&mut b[start..])
            }
            Repr::Backend { region, len } => {
                let start = *len;
                let end = start.checked_add(n)?;
                let slice = region.as_mut_slice();
                if end > slice.len() {
                    return None;
                }
                *len = end;
                Some(&mut slice[start..end])
            }
        }
    }

    /// Turns the filled part into an immutable payload, without copying.
    pub fn freeze(self) -> Bytes {
        match self.repr {
            Repr::Heap(b) => b.freeze(),
            Repr::Backend { region, len } => Bytes::from_owner(FrozenRegion { region, len }),
        }
    }
}

impl fmt::Debug for SendBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendBuffer")
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .field("backend_memory", &self.is_backend_memory())
            .finish()
    }
}

struct FrozenRegion {
    region: Box<dyn BackendRegion>,
    len: usize,
}

impl AsRef<[u8]> for FrozenRegion {
    fn as_ref(&self) -> &[u8] {
        &self.region.as_slice()[..self.len]
    }
}

// SAFETY: `chunk_mut` hands out only the unfilled tail of memory this buffer owns exclusively,
// and `advance_mut` checks that the filled length never exceeds the region (backend) or the
// initialised capacity reported by `BytesMut` (heap), so no uninitialised byte becomes readable.
unsafe impl BufMut for SendBuffer {
    fn remaining_mut(&self) -> usize {
        match &self.repr {
            Repr::Heap(b) => b.remaining_mut(),
            Repr::Backend { region, len } => region.as_slice().len() - *len,
        }
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        match &mut self.repr {
            // SAFETY: the caller guarantees `cnt` bytes of `chunk_mut` were initialised, which is
            // exactly `BytesMut::advance_mut`'s contract.
            Repr::Heap(b) => unsafe { b.advance_mut(cnt) },
            Repr::Backend { region, len } => {
                let cap = region.as_slice().len();
                assert!(
                    cnt <= cap - *len,
                    "advance_mut past the end of a backend send buffer"
                );
                *len += cnt;
            }
        }
    }

    fn chunk_mut(&mut self) -> &mut UninitSlice {
        match &mut self.repr {
            Repr::Heap(b) => b.chunk_mut(),
            Repr::Backend { region, len } => {
                let start = *len;
                UninitSlice::new(&mut region.as_mut_slice()[start..])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_is_padded_with_zeros() {
        let h = HeaderBytes::new(b"abc").unwrap();
        assert_eq!(&h.padded()[..3], b"abc");
        assert!(h.padded()[3..].iter().all(|&b| b == 0));
        let full = HeaderBytes::from([7u8; MAX_HEADER_LEN]);
        assert_eq!(full.padded(), &[7u8; MAX_HEADER_LEN]);
    }

    struct Region(Vec<u8>);
    impl BackendRegion for Region {
        fn as_slice(&self) -> &[u8] {
            &self.0
        }
        fn as_mut_slice(&mut self) -> &mut [u8] {
            &mut self.0
        }
    }

    #[test]
    fn header_bounds() {
        assert!(HeaderBytes::new(&[0; MAX_HEADER_LEN]).is_some());
        assert!(HeaderBytes::new(&[0; MAX_HEADER_LEN + 1]).is_none());
        let h = HeaderBytes::from([1u8, 2, 3]);
        assert_eq!(h.as_slice(), &[1, 2, 3]);
        assert_eq!(h.len(), 3);
    }

    #[test]
    fn backend_buffer_is_fixed_and_zero_copy() {
        let mut b = SendBuffer::from_region(Box::new(Region(vec![0; 8])));
        assert!(b.is_backend_memory());
        b.put_slice(b"abcd");
        assert_eq!(b.remaining_mut(), 4);
        assert!(b.fill(5).is_none(), "backend buffers never grow");
        b.fill(4).unwrap().copy_from_slice(b"efgh");
        let ptr = b.filled().as_ptr();
        let frozen = b.freeze();
        assert_eq!(&frozen[..], b"abcdefgh");
        assert_eq!(frozen.as_ptr(), ptr, "freeze must not copy");
    }

    #[test]
    fn heap_buffer_grows() {
        let mut b = SendBuffer::heap(2);
        b.put_slice(b"0123456789");
        assert_eq!(b.len(), 10);
        assert_eq!(&b.freeze()[..], b"0123456789");
    }
}
