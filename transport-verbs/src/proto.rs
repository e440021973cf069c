//! The per-message transport header (sans-IO: encode / decode only).
//!
//! Every SEND carries one 32-byte header, little-endian:
//!
//! ```text
//!  0  u8   kind      1 HELLO, 2 EAGER, 3 RTS, 4 FIN, 5 CREDIT, 6 CLOSE
//!  1  u8   hlen      length of the message header that follows (0..=64)
//!  2  u16  credits   receive buffers the sender has re-posted since its last grant
//!  4  u32  id        rendezvous id (RTS, FIN)
//!  8  u64  len       EAGER / RTS: payload length; HELLO: receive buffer size
//! 16  u64  addr      RTS: address of the payload in the sender's memory; HELLO: version
//! 24  u32  rkey      RTS: remote key of that memory
//! 28  u32  reserved
//! 32  ...  message header (hlen bytes), then for EAGER the payload
//! ```

use transport_core::{HeaderBytes, MAX_HEADER_LEN};

/// Length of the transport header.
pub(crate) const TH_LEN: usize = 32;
/// Protocol version carried by HELLO.
pub(crate) const VERSION: u64 = 1;

/// Message kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    Hello = 1,
    Eager = 2,
    Rts = 3,
    Fin = 4,
    Credit = 5,
    Close = 6,
}

/// A decoded transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Th {
    pub(crate) kind: Kind,
    pub(crate) hlen: u8,
    pub(crate) credits: u16,
    pub(crate) id: u32,
    pub(crate) len: u64,
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
}

impl Th {
    pub(crate) fn new(kind: Kind) -> Th {
        Th {
            kind,
            hlen: 0,
            credits: 0,
            id: 0,
            len: 0,
            addr: 0,
            rkey: 0,
        }
    }

    /// Writes the header and `header` into `out`; returns the bytes written.
    pub(crate) fn encode(&self, header: &HeaderBytes, out: &mut [u8]) -> usize {
        out[0] = self.kind as u8;
        out[1] = header.len() as u8;
        out[2..4].copy_from_slice(&self.credits.to_le_bytes());
        out[4..8].copy_from_slice(&self.id.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.addr.to_le_bytes());
        out[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        out[28..32].copy_from_slice(&[0; 4]);
        out[TH_LEN..TH_LEN + header.len()].copy_from_slice(header.as_slice());
        TH_LEN + header.len()
    }

    /// Decodes a received message of `msg.len()` bytes: the header, the message header and the
    /// offset of the payload. Validates every length against the bytes actually received.
    pub(crate) fn decode(msg: &[u8]) -> Result<(Th, HeaderBytes, usize), &'static str> {
        if msg.len() < TH_LEN {
            return Err("verbs message shorter than its transport header");
        }
        let kind = match msg[0] {
            1 => Kind::Hello,
            2 => Kind::Eager,
            3 => Kind::Rts,
            4 => Kind::Fin,
            5 => Kind::Credit,
            6 => Kind::Close,
            _ => return Err("unknown verbs message kind"),
        };
        let hlen = msg[1];
        if hlen as usize > MAX_HEADER_LEN || TH_LEN + hlen as usize > msg.len() {
            return Err("verbs message header length out of bounds");
        }
        let u64_at = |i: usize| u64::from_le_bytes(msg[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(msg[i..i + 4].try_into().expect("4 bytes"));
        let th = Th {
            kind,
            hlen,
            credits: u16::from_le_bytes([msg[2], msg[3]]),
            id: u32_at(4),
            len: u64_at(8),
            addr: u64_at(16),
            rkey: u32_at(24),
        };
        let body = TH_LEN + hlen as usize;
        let header = HeaderBytes::new(&msg[TH_LEN..body]).expect("bounded above");
        if kind == Kind::Eager && (msg.len() - body) as u64 != th.len {
            return Err("verbs eager message length does not match its header");
        }
        Ok((th, header, body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut th = Th::new(Kind::Rts);
        th.credits = 7;
        th.id = 42;
        th.len = 1 << 24;
        th.addr = 0xdead_beef_0000;
        th.rkey = 0x1234;
        let h = HeaderBytes::new(b"rpc-header").unwrap();
        let mut buf = [0u8; 128];
        let n = th.encode(&h, &mut buf);
        assert_eq!(n, TH_LEN + 10);
        let (d, dh, off) = Th::decode(&buf[..n]).unwrap();
        assert_eq!(d.kind, Kind::Rts);
        assert_eq!(d.credits, 7);
        assert_eq!(d.id, 42);
        assert_eq!(d.len, 1 << 24);
        assert_eq!(d.addr, 0xdead_beef_0000);
        assert_eq!(d.rkey, 0x1234);
        assert_eq!(dh.as_slice(), b"rpc-header");
        assert_eq!(off, n);
    }

    #[test]
    fn eager_length_is_checked() {
        let mut th = Th::new(Kind::Eager);
        th.len = 5;
        let mut buf = [0u8; 64];
        let n = th.encode(&HeaderBytes::EMPTY, &mut buf);
        assert!(Th::decode(&buf[..n + 5]).is_ok());
        assert!(Th::decode(&buf[..n + 4]).is_err());
        assert!(Th::decode(&buf[..10]).is_err());
        buf[0] = 99;
        assert!(Th::decode(&buf[..n + 5]).is_err());
        buf[0] = 2;
        buf[1] = 65;
        assert!(Th::decode(&buf).is_err());
    }
}
