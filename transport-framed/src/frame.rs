//! Sans-IO framing of messages on a byte stream (TCP, Unix sockets): one encoder
//! ([`FrameEncoder`]) and one decoder ([`FrameDecoder`]), used by every path that writes or
//! reads frames.
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
//! ```
//! use bytes::{Bytes, BytesMut};
//! use tokio_util::codec::{Decoder, Encoder};
//! use transport_framed::frame::{FrameDecoder, FrameEncoder};
//! use transport_core::{HeaderBytes, Message};
//!
//! let msg = Message::new(HeaderBytes::from(*b"hd"), Bytes::from_static(b"payload"));
//! // Zero-copy: the prefix and header inline, the payload as the caller's `Bytes`, for a
//! // vectored write.
//! let frame = FrameEncoder::new(1024).encode_frame(msg.clone())?;
//! assert_eq!(frame.head(), b"tx\x01\x02\x07\x00\x00\x00hd");
//! assert_eq!(frame.payload(), &msg.payload);
//!
//! // Or through tokio-util's `Encoder`, into a buffer (this copies the payload).
//! let mut wire = BytesMut::new();
//! FrameEncoder::new(1024).encode(msg.clone(), &mut wire)?;
//! assert_eq!(FrameDecoder::new(1024).decode(&mut wire)?, Some(msg));
//! # Ok::<(), transport_core::TransportError>(())
//! ```
//!
//! [`FrameDecoder`] validates the prefix before anything is buffered for the frame: wrong magic
//! or version and over-long headers are fatal [`TransportError::Malformed`] errors; a frame
//! whose header + payload exceeds the configured maximum yields a non-fatal
//! [`TransportError::MessageTooLarge`] carrying the frame's header, and its payload is then
//! skipped as it arrives, without being stored. A reader that wants a large frame in a buffer
//! of its own (the stream receiver does) takes it over from the decoder with
//! [`FrameDecoder::detach`] and turns the whole frame into a message with
//! [`FramePrefix::split_frame`]: the prefix is parsed in one place.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};
use transport_core::{HeaderBytes, Message, TransportError, MAX_HEADER_LEN};

/// Bytes before the header.
pub const PREFIX_LEN: usize = 8;
/// The first two bytes of every frame.
pub const STREAM_MAGIC: [u8; 2] = *b"tx";
/// The framing version this crate speaks.
pub const STREAM_VERSION: u8 = 1;
/// Longest prefix + header.
const MAX_HEAD_LEN: usize = PREFIX_LEN + MAX_HEADER_LEN;

/// The lengths a frame's 8-byte prefix announces.
///
/// Made by [`FramePrefix::new`] for writing (or by [`FrameEncoder`]), and handed out by
/// [`FrameDecoder`] (the only place that parses one) for a frame it accepted.
///
/// ```
/// use transport_framed::frame::FramePrefix;
///
/// let p = FramePrefix::new(24, 1000).expect("lengths the format can carry");
/// assert_eq!(p.to_bytes(), [b't', b'x', 1, 24, 0xe8, 0x03, 0, 0]);
/// assert_eq!((p.message_len(), p.frame_len()), (1024, 1032));
/// assert!(FramePrefix::new(65, 0).is_none(), "headers are at most 64 bytes");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FramePrefix {
    header_len: u8,
    payload_len: u32,
}

impl FramePrefix {
    /// The prefix of a frame with `header_len` header bytes and `payload_len` payload bytes;
    /// `None` when the format cannot carry them (a header above [`MAX_HEADER_LEN`], a payload
    /// above `u32::MAX`).
    pub fn new(header_len: usize, payload_len: usize) -> Option<FramePrefix> {
        if header_len > MAX_HEADER_LEN {
            return None;
        }
        Some(FramePrefix {
            header_len: header_len as u8,
            payload_len: u32::try_from(payload_len).ok()?,
        })
    }

    /// Validates the first [`PREFIX_LEN`] bytes of `bytes` (at least that many): magic,
    /// version, header length. Private: [`FrameDecoder`] is the one parser.
    fn parse(bytes: &[u8]) -> Result<FramePrefix, TransportError> {
        let Some(&[m0, m1, version, header_len, p0, p1, p2, p3]) = bytes.get(..PREFIX_LEN) else {
            return Err(TransportError::Malformed(
                "frame prefix shorter than 8 bytes",
            ));
        };
        if [m0, m1] != STREAM_MAGIC {
            return Err(TransportError::Malformed(
                "bad magic: the peer does not speak this framing",
            ));
        }
        if version != STREAM_VERSION {
            return Err(TransportError::Malformed("unsupported framing version"));
        }
        if header_len as usize > MAX_HEADER_LEN {
            return Err(TransportError::Malformed(
                "header length above MAX_HEADER_LEN",
            ));
        }
        Ok(FramePrefix {
            header_len,
            payload_len: u32::from_le_bytes([p0, p1, p2, p3]),
        })
    }

    /// The prefix's 8 bytes on the wire.
    pub fn to_bytes(self) -> [u8; PREFIX_LEN] {
        let p = self.payload_len.to_le_bytes();
        [
            STREAM_MAGIC[0],
            STREAM_MAGIC[1],
            STREAM_VERSION,
            self.header_len,
            p[0],
            p[1],
            p[2],
            p[3],
        ]
    }

    /// Header bytes announced.
    pub fn header_len(self) -> usize {
        self.header_len as usize
    }

    /// Payload bytes announced.
    pub fn payload_len(self) -> usize {
        self.payload_len as usize
    }

    /// Header + payload: what a maximum message size limits.
    pub fn message_len(self) -> u64 {
        u64::from(self.header_len) + u64::from(self.payload_len)
    }

    /// Prefix + header + payload: the whole frame's length on the wire. (Saturates on targets
    /// whose `usize` is 32 bits, where such a frame is over any limit anyway.)
    pub fn frame_len(self) -> usize {
        usize::try_from(PREFIX_LEN as u64 + self.message_len()).unwrap_or(usize::MAX)
    }

    /// Where the payload starts, counted from the frame's first byte.
    fn header_end(self) -> usize {
        PREFIX_LEN + self.header_len()
    }

    /// The header of the frame `frame` starts with (at least [`Self::header_end`] bytes).
    fn header(self, frame: &[u8]) -> HeaderBytes {
        HeaderBytes::new(&frame[PREFIX_LEN..self.header_end()]).unwrap_or_default()
    }

    /// The message in `frame`, a whole frame this prefix was parsed from (prefix included, as
    /// a reader that took the frame over with [`FrameDecoder::detach`] holds it): the header
    /// is copied inline, the payload is a slice of `frame` (no copy). Bytes after the frame's
    /// end are not part of the message. A `frame` shorter than [`Self::frame_len`] is
    /// [`TransportError::Truncated`].
    pub fn split_frame(self, frame: Bytes) -> Result<Message, TransportError> {
        let total = self.frame_len();
        if frame.len() < total {
            return Err(TransportError::Truncated {
                received: frame.len() as u64,
                expected: total as u64,
            });
        }
        Ok(Message {
            header: self.header(&frame),
            payload: frame.slice(self.header_end()..total),
        })
    }
}

/// The prefix of a frame carrying a header of `header_len` bytes and `payload_len` bytes of
/// payload: `FramePrefix::new(header_len, payload_len)` as bytes, for raw writers (tests, the
/// hostile-peer suite) that announce lengths without a message. Prefer
/// [`FrameEncoder::encode_frame`] for a whole message.
///
/// Callers validate the lengths first (see [`FrameEncoder::check`]): a header above
/// [`MAX_HEADER_LEN`] or a payload above `u32::MAX` is a bug (a debug assertion; release
/// builds write the low bits).
#[inline]
pub fn encode_prefix(header_len: usize, payload_len: usize) -> [u8; PREFIX_LEN] {
    debug_assert!(header_len <= MAX_HEADER_LEN && payload_len <= u32::MAX as usize);
    FramePrefix {
        header_len: header_len as u8,
        payload_len: payload_len as u32,
    }
    .to_bytes()
}

/// Checks a message against the sender's limit before anything is written:
/// `FrameEncoder::new(max_message_size).check(msg)`, for callers without an encoder.
#[inline]
pub fn check_send_size(msg: &Message, max_message_size: usize) -> Result<(), TransportError> {
    FrameEncoder::new(max_message_size).check(msg).map(drop)
}

/// One message's frame, ready for a vectored write: prefix and header inline, the payload the
/// caller's [`Bytes`] (never copied). Made by [`FrameEncoder::encode_frame`].
///
/// ```
/// # use bytes::Bytes;
/// # use transport_framed::frame::FrameEncoder;
/// # use transport_core::{HeaderBytes, Message};
/// let frame = FrameEncoder::new(1 << 20)
///     .encode_frame(Message::new(HeaderBytes::from([1, 2]), Bytes::from_static(b"abc")))?;
/// let [head, payload] = frame.parts();
/// assert_eq!((head.len(), payload), (10, &b"abc"[..]));
/// assert_eq!(frame.wire_len(), 13);
/// # Ok::<(), transport_core::TransportError>(())
/// ```
#[derive(Clone)]
pub struct EncodedFrame {
    head: [u8; MAX_HEAD_LEN],
    head_len: u8,
    payload: Bytes,
}

impl EncodedFrame {
    /// Prefix and header, contiguous.
    #[inline]
    pub fn head(&self) -> &[u8] {
        &self.head[..self.head_len as usize]
    }

    /// The payload, as the message carried it.
    #[inline]
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// The frame's bytes in wire order, in two parts: `[head, payload]`.
    #[inline]
    pub fn parts(&self) -> [&[u8]; 2] {
        [self.head(), &self.payload]
    }

    /// The frame's length on the wire.
    #[inline]
    pub fn wire_len(&self) -> usize {
        self.head_len as usize + self.payload.len()
    }
}

impl std::fmt::Debug for EncodedFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncodedFrame")
            .field("head", &self.head())
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// Encodes messages as frames, refusing messages over a maximum size; implements tokio-util's
/// [`Encoder`] (which copies the payload into the output buffer). The stream sender uses
/// [`FrameEncoder::encode_frame`] instead, which copies nothing.
///
/// ```
/// # use bytes::Bytes;
/// # use transport_framed::frame::FrameEncoder;
/// # use transport_core::{HeaderBytes, Message, TransportError};
/// let encoder = FrameEncoder::new(16);
/// let big = Message::new(HeaderBytes::EMPTY, Bytes::from(vec![0; 17]));
/// assert!(matches!(
///     encoder.encode_frame(big),
///     Err(TransportError::MessageTooLarge { len: 17, max: 16, .. })
/// ));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct FrameEncoder {
    max_message_size: usize,
}

impl FrameEncoder {
    /// An encoder for messages (header + payload) of at most `max_message_size` bytes.
    pub fn new(max_message_size: usize) -> FrameEncoder {
        FrameEncoder { max_message_size }
    }

    /// The configured maximum.
    pub fn max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// The prefix `msg` would be framed with, or [`TransportError::MessageTooLarge`] (with an
    /// empty header) when it is over the maximum or its payload over the format's `u32::MAX`.
    /// Lets a sender check a batch before it queues any of it.
    #[inline]
    pub fn check(&self, msg: &Message) -> Result<FramePrefix, TransportError> {
        let len = msg.len();
        let too_large = || TransportError::MessageTooLarge {
            len: len as u64,
            max: self.max_message_size as u64,
            header: HeaderBytes::EMPTY,
        };
        if len > self.max_message_size {
            return Err(too_large());
        }
        FramePrefix::new(msg.header.len(), msg.payload.len()).ok_or_else(too_large)
    }

    /// `msg`'s frame, for a vectored write: its payload is not copied.
    #[inline]
    pub fn encode_frame(&self, msg: Message) -> Result<EncodedFrame, TransportError> {
        let prefix = self.check(&msg)?;
        let mut head = [0u8; MAX_HEAD_LEN];
        head[..PREFIX_LEN].copy_from_slice(&prefix.to_bytes());
        let h = msg.header.as_slice();
        head[PREFIX_LEN..PREFIX_LEN + h.len()].copy_from_slice(h);
        Ok(EncodedFrame {
            head,
            head_len: prefix.header_end() as u8,
            payload: msg.payload,
        })
    }
}

impl Encoder<Message> for FrameEncoder {
    type Error = TransportError;

    /// Appends `msg`'s frame to `dst` (copying the payload); on error `dst` is unchanged.
    fn encode(&mut self, msg: Message, dst: &mut BytesMut) -> Result<(), TransportError> {
        let frame = self.encode_frame(msg)?;
        dst.reserve(frame.wire_len());
        for part in frame.parts() {
            dst.put_slice(part);
        }
        Ok(())
    }
}

/// Where the decoder is in the byte stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Between frames, or inside a prefix that has not all arrived.
    Prefix,
    /// An accepted frame, waiting for all of it.
    Frame(FramePrefix),
    /// A frame over the maximum, waiting for its header (kept for the error).
    Oversized(FramePrefix),
    /// Throwing away the payload of a rejected frame.
    Skip {
        /// Bytes still to throw away.
        left: u64,
        /// The rejected frame's length, prefix included.
        frame_len: u64,
    },
}

/// Decodes frames from a byte buffer, refusing frames over a maximum size; implements
/// tokio-util's [`Decoder`].
///
/// ```
/// use bytes::BytesMut;
/// use tokio_util::codec::Decoder;
/// use transport_framed::frame::{encode_prefix, FrameDecoder};
/// use transport_core::TransportError;
///
/// let mut d = FrameDecoder::new(1024);
/// let mut buf = BytesMut::from(&encode_prefix(2, 3)[..]);
/// assert!(d.decode(&mut buf)?.is_none(), "the prefix alone is not a message");
/// assert_eq!(d.pending_frame_len(), Some(13), "but it says how long the frame is");
/// buf.extend_from_slice(b"hdabc");
/// let m = d.decode(&mut buf)?.expect("a whole frame");
/// assert_eq!((m.header.as_slice(), &m.payload[..]), (&b"hd"[..], &b"abc"[..]));
///
/// // Over the maximum: a non-fatal error with the frame's header; the payload is skipped.
/// let mut buf = BytesMut::from(&encode_prefix(2, 5000)[..]);
/// buf.extend_from_slice(b"hd");
/// match d.decode(&mut buf) {
///     Err(e @ TransportError::MessageTooLarge { .. }) => assert!(!e.is_fatal()),
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), TransportError>(())
/// ```
#[derive(Debug, Clone)]
pub struct FrameDecoder {
    max_message_size: usize,
    state: State,
}

impl FrameDecoder {
    /// A decoder accepting messages (header + payload) of at most `max_message_size` bytes.
    pub fn new(max_message_size: usize) -> FrameDecoder {
        FrameDecoder {
            // An accepted frame's length, prefix included, must fit in memory.
            max_message_size: max_message_size.min(usize::MAX - PREFIX_LEN),
            state: State::Prefix,
        }
    }

    /// The configured maximum.
    pub fn max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// The prefix of the frame being assembled, once it has been validated and accepted
    /// (`None` between frames and for a frame over the maximum).
    pub fn pending_prefix(&self) -> Option<FramePrefix> {
        match self.state {
            State::Frame(p) => Some(p),
            _ => None,
        }
    }

    /// Length (prefix included) of the frame being assembled, once its prefix has been
    /// validated: a reader can allocate exactly this much.
    pub fn pending_frame_len(&self) -> Option<usize> {
        self.pending_prefix().map(FramePrefix::frame_len)
    }

    /// True while the decoder is between frames (nothing partial buffered or being skipped).
    pub fn is_idle(&self, src: &BytesMut) -> bool {
        self.state == State::Prefix && src.is_empty()
    }

    /// Bytes of the current frame received so far and the bytes it announced (0 while its
    /// prefix is incomplete), for [`TransportError::Truncated`] and
    /// [`TransportError::Stalled`].
    pub fn progress(&self, src: &BytesMut) -> (u64, u64) {
        let have = src.len() as u64;
        match self.state {
            State::Prefix => (have, 0),
            State::Frame(p) | State::Oversized(p) => (have, p.frame_len() as u64),
            State::Skip { left, frame_len } => (frame_len - left, frame_len),
        }
    }

    /// True when `src` holds the whole next frame, so that [`Decoder::decode`] returns it
    /// without more input. `false` when more bytes are needed, and for a prefix that is
    /// malformed or over the maximum (decoding those reports an error or skips instead).
    pub fn holds_frame(&self, src: &[u8]) -> bool {
        match self.state {
            State::Prefix => FramePrefix::parse(src).is_ok_and(|p| {
                p.message_len() <= self.max_message_size as u64 && src.len() >= p.frame_len()
            }),
            State::Frame(p) => src.len() >= p.frame_len(),
            State::Oversized(_) | State::Skip { .. } => false,
        }
    }

    /// Takes the frame being assembled (see [`Self::pending_prefix`]) out of the decoder, for
    /// a reader that reads the rest of it into a buffer of its own: moves the frame's bytes
    /// that `src` holds (its start, prefix included) into `dst`, and returns the frame's
    /// prefix. The decoder is then between frames; once `dst` holds
    /// [`FramePrefix::frame_len`] bytes, [`FramePrefix::split_frame`] makes the message.
    /// `None` (nothing moved) when no accepted frame is pending.
    pub fn detach(&mut self, src: &mut BytesMut, dst: &mut impl BufMut) -> Option<FramePrefix> {
        let prefix = self.pending_prefix()?;
        let n = src.len().min(prefix.frame_len());
        dst.put_slice(&src[..n]);
        src.advance(n);
        self.state = State::Prefix;
        Some(prefix)
    }
}

impl Decoder for FrameDecoder {
    type Item = Message;
    type Error = TransportError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Message>, TransportError> {
        loop {
            match self.state {
                State::Skip { left, frame_len } => {
                    let n = (src.len() as u64).min(left);
                    src.advance(n as usize);
                    if n < left {
                        self.state = State::Skip {
                            left: left - n,
                            frame_len,
                        };
                        return Ok(None);
                    }
                    self.state = State::Prefix;
                }
                State::Prefix => {
                    if src.len() < PREFIX_LEN {
                        return Ok(None);
                    }
                    let prefix = FramePrefix::parse(src)?;
                    self.state = if prefix.message_len() > self.max_message_size as u64 {
                        State::Oversized(prefix)
                    } else {
                        State::Frame(prefix)
                    };
                }
                State::Oversized(prefix) => {
                    // Keep the header (so the protocol above can answer), skip the payload
                    // unbuffered.
                    if src.len() < prefix.header_end() {
                        return Ok(None);
                    }
                    let header = prefix.header(src);
                    src.advance(prefix.header_end());
                    let now = src.len().min(prefix.payload_len());
                    src.advance(now);
                    let left = (prefix.payload_len() - now) as u64;
                    self.state = if left > 0 {
                        State::Skip {
                            left,
                            frame_len: PREFIX_LEN as u64 + prefix.message_len(),
                        }
                    } else {
                        State::Prefix
                    };
                    return Err(TransportError::MessageTooLarge {
                        len: prefix.message_len(),
                        max: self.max_message_size as u64,
                        header,
                    });
                }
                State::Frame(prefix) => {
                    if src.len() < prefix.frame_len() {
                        return Ok(None);
                    }
                    self.state = State::Prefix;
                    let header = prefix.header(src);
                    src.advance(prefix.header_end());
                    let payload = src.split_to(prefix.payload_len()).freeze();
                    return Ok(Some(Message { header, payload }));
                }
            }
        }
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

    fn msg(header: &[u8], payload: &'static [u8]) -> Message {
        Message::new(
            HeaderBytes::new(header).unwrap(),
            Bytes::from_static(payload),
        )
    }

    /// `holds_frame` is true exactly when `decode` would return a message without more
    /// input: never for a partial prefix or frame, nor for a frame over the maximum.
    #[test]
    fn holds_frame_only_when_a_whole_frame_is_buffered() {
        let wire = frame(b"hdr", b"payload");
        let mut d = FrameDecoder::new(1024);
        for n in 0..wire.len() {
            assert!(!d.holds_frame(&wire[..n]), "{n} of {} bytes", wire.len());
        }
        assert!(d.holds_frame(&wire));
        // Once the decoder has taken the prefix (a partial decode), the same holds.
        let mut buf = BytesMut::from(&wire[..PREFIX_LEN + 2]);
        assert!(d.decode(&mut buf).unwrap().is_none());
        assert!(!d.holds_frame(&buf));
        buf.extend_from_slice(&wire[PREFIX_LEN + 2..]);
        assert!(d.holds_frame(&buf));
        assert!(d.decode(&mut buf).unwrap().is_some());
        // Over the maximum: decoding reports it, it is not a message held.
        let big = frame(b"h", &[0u8; 2048]);
        assert!(!FrameDecoder::new(1024).holds_frame(&big));
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

    /// The encoder's frame is the documented layout, byte for byte, whichever way it is
    /// written: the zero-copy parts and tokio-util's `Encoder` agree.
    #[test]
    fn encoder_writes_the_documented_bytes_both_ways() {
        let m = msg(b"hdr", b"payload");
        let f = FrameEncoder::new(1024).encode_frame(m.clone()).unwrap();
        assert_eq!(f.head(), b"tx\x01\x03\x07\x00\x00\x00hdr");
        assert_eq!(
            f.payload().as_ptr(),
            m.payload.as_ptr(),
            "payload not copied"
        );
        assert_eq!(f.parts().concat(), frame(b"hdr", b"payload"));
        assert_eq!(f.wire_len(), PREFIX_LEN + 3 + 7);
        let mut dst = BytesMut::from(&b"before"[..]);
        FrameEncoder::new(1024).encode(m, &mut dst).unwrap();
        assert_eq!(&dst[..6], b"before");
        assert_eq!(&dst[6..], &frame(b"hdr", b"payload")[..]);
    }

    #[test]
    fn encoder_refuses_oversize_and_writes_nothing() {
        let mut e = FrameEncoder::new(9);
        let mut dst = BytesMut::new();
        let r = e.encode(msg(b"h", b"123456789"), &mut dst);
        assert!(matches!(
            r,
            Err(TransportError::MessageTooLarge {
                len: 10,
                max: 9,
                ..
            })
        ));
        assert!(dst.is_empty());
        assert!(e.encode(msg(b"h", b"12345678"), &mut dst).is_ok());
    }

    #[test]
    fn prefix_limits_are_the_format_limits() {
        assert!(FramePrefix::new(MAX_HEADER_LEN, u32::MAX as usize).is_some());
        assert!(FramePrefix::new(MAX_HEADER_LEN + 1, 0).is_none());
        assert!(FramePrefix::new(0, u32::MAX as usize + 1).is_none());
        let p = FramePrefix::new(3, 7).unwrap();
        assert_eq!(p.to_bytes(), encode_prefix(3, 7));
        assert_eq!(FramePrefix::parse(&p.to_bytes()).unwrap(), p);
        assert!(FramePrefix::parse(&p.to_bytes()[..7]).is_err());
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
        assert!(!d.is_idle(&buf), "still inside the rejected frame");
        let total = PREFIX_LEN as u64 + 2 + u32::MAX as u64;
        assert_eq!(d.progress(&buf), (PREFIX_LEN as u64 + 102, total));
        // While skipping, EOF is a truncation; the next frame after the skip decodes.
        assert!(matches!(
            d.clone().decode_eof(&mut buf),
            Err(TransportError::Truncated { received, expected })
                if received == PREFIX_LEN as u64 + 102 && expected == total
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

    /// A frame taken over with `detach` and finished elsewhere gives the same message as
    /// one the decoder assembles, and the decoder carries on with the next frame.
    #[test]
    fn a_detached_frame_is_finished_by_its_prefix() {
        let f = frame(b"hh", b"a large payload");
        let mut d = FrameDecoder::new(1024);
        let mut buf = BytesMut::from(&f[..12]);
        assert!(d.decode(&mut buf).unwrap().is_none());
        let mut own = Vec::with_capacity(f.len());
        let prefix = d.detach(&mut buf, &mut own).expect("a pending frame");
        assert_eq!((prefix.header_len(), prefix.frame_len()), (2, f.len()));
        assert!(
            buf.is_empty() && d.is_idle(&buf),
            "the decoder is between frames"
        );
        assert_eq!(d.detach(&mut buf, &mut own), None, "nothing left to take");
        own.extend_from_slice(&f[12..]);
        let m = prefix.split_frame(Bytes::from(own)).unwrap();
        assert_eq!(m, msg(b"hh", b"a large payload"));
        buf.extend_from_slice(&frame(b"n", b"next"));
        assert_eq!(d.decode(&mut buf).unwrap(), Some(msg(b"n", b"next")));
        // A frame cut short is a typed error, not a panic.
        let short = Bytes::copy_from_slice(&f[..f.len() - 1]);
        assert!(matches!(
            prefix.split_frame(short),
            Err(TransportError::Truncated { .. })
        ));
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
        assert_eq!(
            FrameEncoder::new(16).check(&m).unwrap(),
            FramePrefix::new(4, 12).unwrap()
        );
    }
}
