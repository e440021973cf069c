//! The RPC header: a sans-IO codec, validated before anything is allocated.
//!
//! ```text
//!  0        2         3      4        6          8           12              20             24
//!  +--------+---------+------+--------+----------+-----------+---------------+--------------+
//!  | magic  | version | kind | flags  | reserved | method id | request id    | payload len  |
//!  | "RP"   |  (1)    | (u8) | (u16)  |   (0)    |  (u32)    |   (u64)       |   (u32)      |
//!  +--------+---------+------+--------+----------+-----------+---------------+--------------+
//! ```
//! All integers little-endian. The header travels as the transport message header; its payload
//! length must equal the message's payload length.

use thiserror::Error;

/// Encoded header length in bytes.
pub const RPC_HEADER_LEN: usize = 24;
/// The first two bytes of every RPC header.
pub const RPC_MAGIC: [u8; 2] = *b"RP";
/// The protocol version this crate speaks.
pub const RPC_VERSION: u8 = 1;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// A call expecting a response.
    Request = 1,
    /// The successful result of a request.
    Response = 2,
    /// A call without a response.
    Oneway = 3,
    /// The failed result of a request: payload = code (u32 LE) + UTF-8 message.
    Error = 4,
    /// The client gave up on a request (deadline or cancellation): the server may stop work.
    Cancel = 5,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Oneway,
            4 => Kind::Error,
            5 => Kind::Cancel,
            _ => return None,
        })
    }
}

/// A decoded RPC header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RpcHeader {
    /// Message kind.
    pub kind: Kind,
    /// Flags; none are defined yet, so 0 (unknown flags are rejected).
    pub flags: u16,
    /// Method id, chosen by the application.
    pub method: u32,
    /// Request id: matches a response to its request; unique among a client's calls in flight.
    pub request_id: u64,
    /// Payload length in bytes.
    pub payload_len: u32,
}

/// Why bytes are not a valid RPC header.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// Fewer than [`RPC_HEADER_LEN`] bytes.
    #[error("RPC header truncated: {0} of {RPC_HEADER_LEN} bytes")]
    Truncated(usize),
    /// Not an RPC header.
    #[error("bad RPC magic {0:02x?}")]
    BadMagic([u8; 2]),
    /// A protocol version this crate does not speak.
    #[error("unsupported RPC version {0}")]
    UnsupportedVersion(u8),
    /// Unknown message kind.
    #[error("unknown RPC message kind {0}")]
    UnknownKind(u8),
    /// Flags or reserved bits set that this version does not define.
    #[error("undefined RPC flags or reserved bits set: {0:#06x}")]
    ReservedBits(u32),
    /// The payload length in the header disagrees with the message.
    #[error("RPC header announces {announced} payload bytes, message carries {actual}")]
    LengthMismatch {
        /// From the header.
        announced: u32,
        /// In the message.
        actual: usize,
    },
    /// The payload is larger than the configured maximum.
    #[error("RPC payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge {
        /// From the header.
        len: u64,
        /// The configured maximum.
        max: u64,
    },
}

impl RpcHeader {
    /// A header of `kind` for `method` / `request_id` with a payload of `payload_len` bytes.
    #[inline]
    pub fn new(kind: Kind, method: u32, request_id: u64, payload_len: usize) -> RpcHeader {
        RpcHeader {
            kind,
            flags: 0,
            method,
            request_id,
            payload_len: payload_len as u32,
        }
    }

    /// The wire form.
    #[inline]
    pub fn encode(&self) -> [u8; RPC_HEADER_LEN] {
        let mut b = [0u8; RPC_HEADER_LEN];
        b[0..2].copy_from_slice(&RPC_MAGIC);
        b[2] = RPC_VERSION;
        b[3] = self.kind as u8;
        b[4..6].copy_from_slice(&self.flags.to_le_bytes());
        // 6..8 reserved, zero
        b[8..12].copy_from_slice(&self.method.to_le_bytes());
        b[12..20].copy_from_slice(&self.request_id.to_le_bytes());
        b[20..24].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }

    /// Parses and validates a header (magic, version, kind, reserved bits). Does not allocate.
    #[inline]
    pub fn decode(b: &[u8]) -> Result<RpcHeader, HeaderError> {
        if b.len() < RPC_HEADER_LEN {
            return Err(HeaderError::Truncated(b.len()));
        }
        if b[0..2] != RPC_MAGIC {
            return Err(HeaderError::BadMagic([b[0], b[1]]));
        }
        if b[2] != RPC_VERSION {
            return Err(HeaderError::UnsupportedVersion(b[2]));
        }
        let kind = Kind::from_u8(b[3]).ok_or(HeaderError::UnknownKind(b[3]))?;
        let flags = u16::from_le_bytes([b[4], b[5]]);
        let reserved = u16::from_le_bytes([b[6], b[7]]);
        if flags != 0 || reserved != 0 {
            return Err(HeaderError::ReservedBits(
                ((reserved as u32) << 16) | flags as u32,
            ));
        }
        Ok(RpcHeader {
            kind,
            flags,
            method: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
            request_id: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
            payload_len: u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")),
        })
    }

    /// Checks the announced payload length against the limit, before anything is allocated.
    #[inline]
    pub fn check_limit(&self, max_payload: usize) -> Result<(), HeaderError> {
        if self.payload_len as usize > max_payload {
            return Err(HeaderError::PayloadTooLarge {
                len: self.payload_len as u64,
                max: max_payload as u64,
            });
        }
        Ok(())
    }

    /// Checks the announced payload length against the payload actually received.
    #[inline]
    pub fn check_payload(&self, actual: usize) -> Result<(), HeaderError> {
        if self.payload_len as usize != actual {
            return Err(HeaderError::LengthMismatch {
                announced: self.payload_len,
                actual,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        for kind in [
            Kind::Request,
            Kind::Response,
            Kind::Oneway,
            Kind::Error,
            Kind::Cancel,
        ] {
            let h = RpcHeader::new(kind, 0xdead_beef, u64::MAX - 3, 500_000);
            assert_eq!(RpcHeader::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn rejects_bad_input() {
        let good = RpcHeader::new(Kind::Request, 1, 2, 3).encode();
        assert_eq!(
            RpcHeader::decode(&good[..23]),
            Err(HeaderError::Truncated(23))
        );
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            RpcHeader::decode(&b),
            Err(HeaderError::BadMagic(_))
        ));
        let mut b = good;
        b[2] = 2;
        assert_eq!(
            RpcHeader::decode(&b),
            Err(HeaderError::UnsupportedVersion(2))
        );
        let mut b = good;
        b[3] = 0;
        assert_eq!(RpcHeader::decode(&b), Err(HeaderError::UnknownKind(0)));
        let mut b = good;
        b[7] = 1;
        assert!(matches!(
            RpcHeader::decode(&b),
            Err(HeaderError::ReservedBits(_))
        ));
    }

    #[test]
    fn limits() {
        let h = RpcHeader::new(Kind::Request, 1, 2, 100);
        assert!(h.check_limit(100).is_ok());
        assert_eq!(
            h.check_limit(99),
            Err(HeaderError::PayloadTooLarge { len: 100, max: 99 })
        );
        assert!(h.check_payload(100).is_ok());
        assert!(h.check_payload(99).is_err());
    }
}
