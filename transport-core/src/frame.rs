//! Sans-IO framing of messages on a byte stream (TCP, Unix sockets).
//!
//! Every message travels as an 8-byte prefix, its header, then its payload:
//!
//! ```text
//!  0      2         3            4                8            8+H
//!  +------+---------+------------+----------------+------------+-----------------+
//!  | "tx" | version | header len | payload len    | header     | payload         |
//!  |      |   (1)   |  H (u8)    | P (u32 LE)     | (H bytes)  | (P bytes)       |
//!  +------+---------+------------+----------------+------------+-----------------+
//! ```
//!
//! [`FrameDecoder`] validates the prefix before anything is buffered for the frame: wrong magic
//! or version and over-long headers are fatal [`TransportError::Malformed`] errors; a frame
//! whose header + payload exceeds the configured maximum yields a non-fatal
//! [`TransportError::MessageTooLarge`] carrying the frame's header, and its payload is then
//! skipped as it arrives, without being stored.

use crate::{HeaderBytes, Message, TransportError, MAX_HEADER_LEN};
use bytes::{Buf, BytesMut};
use tokio_util::codec::Decoder;

/// Bytes before the header.
pub const PREFIX_LEN: usize = 8;
/// The first two bytes of every frame.
pub const STREAM_MAGIC: [u8; 2] = *b"tx";
/// The framing version this crate speaks.
pub const STREAM_VERSION: u8 = 1;

/// The prefix of a frame carrying a header of `header_len` bytes and `payload_len` bytes of payload.
///
/// Callers validate the lengths first (see [`check_send_size`]).
#[inline]
pub fn encode_prefix(header_len: usize, payload_len: usize) -> [u8; PREFIX_LEN] {
    debug_assert!(header_len <= MAX_HEADER_LEN && payload_len <= u32::MAX as usize);
    let p = (payload_len as u32).to_le_bytes();
    [
        STREAM_MAGIC[0],
        STREAM_MAGIC[1],
        STREAM_VERSION,
        header_len as u8,
        p[0],
        p[1],
        p[2],
        p[3],
    ]
}

/// Checks a message against the sender's limit before anything is written.
#[inline]
pub fn check_send_size(msg: &Message, max_message_size: usize) -> Result<(), TransportError> {
    let len = msg.len();
    if len > max_message_size || msg.payload.len() > u32::MAX as usize {
        return Err(TransportError::MessageTooLarge {
            len: len as u64,
            max: max_message_size as u64,
            header: HeaderBytes::EMPTY,
        });
    }
    Ok(())
}

/// Decodes frames from a byte buffer; implements tokio-util's [`Decoder`].
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    max_message_size: usize,
    /// Payload bytes of a rejected frame still to be thrown away.
    skip: u64,
    /// Total length (prefix included) of the frame being assembled, once its prefix is known.
    pending: Option<usize>,
}

impl FrameDecoder {
    /// A decoder accepting messages (header + payload) of at most `max_message_size` bytes.
    pub fn new(max_message_size: usize) -> FrameDecoder {
        FrameDecoder {
            max_message_size,
            skip: 0,
            pending: None,
        }
    }

    /// The configured maximum.
    pub fn max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// Length (prefix included) of the frame being assembled, once its prefix has been
    /// validated: a reader can allocate exactly this much.
    pub fn pending_frame_len(&self) -> Option<usize> {
        self.pending
    }

    /// True while the decoder is between frames (nothing partial buffered or being skipped).
    pub fn is_idle(&self, src: &BytesMut) -> bool {
        self.skip == 0 && src.is_empty()
    }

    /// Bytes of the current frame received so far and the bytes it announced (0 if unknown),
    /// for [`TransportError::Truncated`].
    pub fn progress(&self, src: &BytesMut) -> (u64, u64) {
        (src.len() as u64, self.pending.unwrap_or(0) as u64)
    }
}

impl Decoder for FrameDecoder {
    type Item = Message;
    type Error = TransportError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Message>, TransportError> {
        if self.skip > 0 {
            let n = (src.len() as u64).min(self.skip);
            src.advance(n as usize);
            self.skip -= n;
            if self.skip > 0 {
                return Ok(None);
            }
        }
        if src.len() < PREFIX_LEN {
            return Ok(None);
        }
        if src[0..2] != STREAM_MAGIC {
            return Err(TransportError::Malformed(
                "bad magic: the peer does not speak this framing",
            ));
        }
        if src[2] != STREAM_VERSION {
            return Err(TransportError::Malformed("unsupported framing version"));
        }
        let header_len = src[3] as usize;
        if header_len > MAX_HEADER_LEN {
            return Err(TransportError::Malformed(
                "header length above MAX_HEADER_LEN",
            ));
        }
        let payload_len = u32::from_le_bytes([src[4], src[5], src[6], src[7]]) as usize;
        let msg_len = header_len + payload_len;
        let header_end = PREFIX_LEN + header_len;
        if msg_len > self.max_message_size {
            // Keep the header (so the protocol above can answer), skip the payload unbuffered.
            if src.len() < header_end {
                return Ok(None);
            }
            let header = HeaderBytes::new(&src[PREFIX_LEN..header_end]).unwrap_or_default();
            src.advance(header_end);
            self.pending = None;
            let now = src.len().min(payload_len);
            src.advance(now);
            self.skip = (payload_len - now) as u64;
            return Err(TransportError::MessageTooLarge {
                len: msg_len as u64,
                max: self.max_message_size as u64,
                header,
            });
        }
        let total = PREFIX_LEN + msg_len;
        if src.len() < total {
            self.pending = Some(total);
            return Ok(None);
        }
        self.pending = None;
        let header = HeaderBytes::new(&src[PREFIX_LEN..header_end]).unwrap_or_default();
        src.advance(header_end);
        let payload = src.split_to(payload_len).freeze();
        Ok(Some(Message { header, payload }))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Message>, TransportError> {
        match self.decode(src)? {
            Some(m) => Ok(Some(m)),
            None if self.is_idle(src) => Ok(None),
            None => {
                let (received, expected) = self.progress(src);
                Err(TransportError::Truncated { received, expected })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, Bytes};

    fn frame(header: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut v = encode_prefix(header.len(), payload.len()).to_vec();
        v.extend_from_slice(header);
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn round_trip_byte_by_byte() {
        let mut wire = frame(b"hdr", b"payload");
        wire.extend(frame(b"", b""));
        let mut d = FrameDecoder::new(1024);
        let mut buf = BytesMut::new();
        let mut out = vec![];
        for b in wire {
            buf.put_u8(b);
            while let Some(m) = d.decode(&mut buf).unwrap() {
                out.push(m);
            }
        }
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].header.as_slice(), b"hdr");
        assert_eq!(out[0].payload, Bytes::from_static(b"payload"));
        assert!(out[1].is_empty());
        assert!(d.decode_eof(&mut buf).unwrap().is_none());
    }

    #[test]
    fn bad_magic_and_version_are_fatal() {
        let mut d = FrameDecoder::new(1024);
        let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]);
        let e = d.decode(&mut buf).unwrap_err();
        assert!(matches!(e, TransportError::Malformed(_)) && e.is_fatal());
        let mut f = frame(b"h", b"p");
        f[2] = 9;
        let e = FrameDecoder::new(1024)
            .decode(&mut BytesMut::from(&f[..]))
            .unwrap_err();
        assert!(matches!(e, TransportError::Malformed(m) if m.contains("version")));
    }

    #[test]
    fn oversized_header_is_rejected() {
        let mut f = encode_prefix(0, 0);
        f[3] = (MAX_HEADER_LEN + 1) as u8;
        let e = FrameDecoder::new(1 << 20)
            .decode(&mut BytesMut::from(&f[..]))
            .unwrap_err();
        assert!(matches!(e, TransportError::Malformed(_)));
    }

    #[test]
    fn oversized_frame_is_skipped_without_buffering() {
        let mut d = FrameDecoder::new(16);
        // Prefix + header of a 4 GiB frame, then a bit of its payload.
        let mut wire = encode_prefix(2, u32::MAX as usize).to_vec();
        wire.extend_from_slice(b"hd");
        wire.extend_from_slice(&[7u8; 100]);
        let mut buf = BytesMut::from(&wire[..]);
        match d.decode(&mut buf) {
            Err(TransportError::MessageTooLarge { len, max, header }) => {
                assert_eq!(len, u32::MAX as u64 + 2);
                assert_eq!(max, 16);
                assert_eq!(header.as_slice(), b"hd");
            }
            other => panic!("expected MessageTooLarge, got {other:?}"),
        }
        assert!(buf.is_empty(), "the payload seen so far is dropped");
        assert_eq!(d.pending_frame_len(), None, "nothing is reserved for it");
        // While skipping, EOF is a truncation; the next frame after the skip decodes.
        assert!(matches!(
            d.clone().decode_eof(&mut buf),
            Err(TransportError::Truncated { .. })
        ));
        let mut d2 = FrameDecoder::new(16);
        let mut wire = encode_prefix(0, 20).to_vec();
        wire.extend_from_slice(&[1u8; 20]);
        wire.extend(frame(b"ok", b"x"));
        let mut buf = BytesMut::from(&wire[..]);
        assert!(d2.decode(&mut buf).is_err());
        let m = d2.decode(&mut buf).unwrap().unwrap();
        assert_eq!(m.header.as_slice(), b"ok");
    }

    #[test]
    fn truncated_at_eof() {
        let f = frame(b"h", b"payload");
        let mut d = FrameDecoder::new(1024);
        let mut buf = BytesMut::from(&f[..f.len() - 3]);
        assert!(d.decode(&mut buf).unwrap().is_none());
        assert_eq!(d.pending_frame_len(), Some(f.len()));
        match d.decode_eof(&mut buf) {
            Err(TransportError::Truncated { received, expected }) => {
                assert_eq!(received, (f.len() - 3) as u64);
                assert_eq!(expected, f.len() as u64);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn send_size_check() {
        let m = Message::new(HeaderBytes::from([0u8; 4]), Bytes::from(vec![0; 12]));
        assert!(check_send_size(&m, 16).is_ok());
        assert!(matches!(
            check_send_size(&m, 15),
            Err(TransportError::MessageTooLarge {
                len: 16,
                max: 15,
                ..
            })
        ));
    }
}
