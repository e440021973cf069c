//! The per-message transport header (sans-IO: encode / decode only).
//!
//! Every SEND carries one 32-byte header, little-endian:
//!
//! ```text
//!  0  u8   kind      1 HELLO, 2 EAGER, 3 RTS, 4 FIN, 5 CREDIT, 6 CLOSE
//!  1  u8   hlen      length of the message header that follows (0..=64)
//!  2  u16  credits   receive buffers the sender has re-posted since its last grant
//!  4  u32  id        RTS, FIN: rendezvous id;      HELLO: receive buffers posted (queue depth)
//!  8  u64  len       EAGER, RTS: payload length;   HELLO: receive buffer size
//! 16  u64  addr      RTS: address of the payload;  HELLO: protocol version (low 32 bits)
//!                    and the RDMA READs the sender serves outstanding (high 32 bits)
//! 24  u32  rkey      RTS: remote key (a memory window bound to this connection's QP);
//!                    HELLO: rendezvous transfers the sender accepts outstanding
//! 28  u32  aux       HELLO: rendezvous bytes (KiB) the sender accepts outstanding; else 0
//! 32  ...  message header (hlen bytes), then for EAGER the payload
//! ```
//!
//! Decoding checks only what the bytes themselves say (lengths against the bytes received);
//! the engine checks every number against the connection's state and limits.

use transport_core::{HeaderBytes, MAX_HEADER_LEN};

use crate::error::ProtocolViolation;

/// Length of the transport header.
pub(crate) const TH_LEN: usize = 32;
/// Protocol version carried by HELLO. 2: HELLO announces the queue depth and the rendezvous
/// limits; rendezvous sources are memory windows. 3: HELLO also announces the RDMA READs the
/// sender's queue pair serves outstanding (its responder resources).
pub(crate) const VERSION: u64 = 3;

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

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Hello => "HELLO",
            Kind::Eager => "EAGER",
            Kind::Rts => "RTS",
            Kind::Fin => "FIN",
            Kind::Credit => "CREDIT",
            Kind::Close => "CLOSE",
        }
    }
}

/// A decoded transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Th {
    pub(crate) kind: Kind,
    pub(crate) credits: u16,
    pub(crate) id: u32,
    pub(crate) len: u64,
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
    pub(crate) aux: u32,
}

impl Th {
    pub(crate) fn new(kind: Kind) -> Th {
        Th {
            kind,
            credits: 0,
            id: 0,
            len: 0,
            addr: 0,
            rkey: 0,
            aux: 0,
        }
    }

    /// A HELLO: this side's receive queue (`depth` buffers of `buf_size` bytes), the
    /// rendezvous transfers (`count`, `kib` KiB) it accepts outstanding, and the RDMA READs
    /// (`reads`) its queue pair serves at once.
    pub(crate) fn hello(depth: u32, buf_size: u64, count: u32, kib: u32, reads: u32) -> Th {
        Th {
            id: depth,
            len: buf_size,
            addr: VERSION | (u64::from(reads) << 32),
            rkey: count,
            aux: kib,
            ..Th::new(Kind::Hello)
        }
    }

    /// A HELLO's protocol version (the low half of `addr`).
    pub(crate) fn hello_version(&self) -> u64 {
        self.addr & u64::from(u32::MAX)
    }

    /// The RDMA READs a HELLO's sender serves at once (the high half of `addr`).
    pub(crate) fn hello_reads(&self) -> u32 {
        (self.addr >> 32) as u32
    }

    /// Writes the header and `header` into `out` (at least `TH_LEN + header.len()` bytes);
    /// returns the bytes written.
    pub(crate) fn encode(&self, header: &HeaderBytes, out: &mut [u8]) -> usize {
        out[0] = self.kind as u8;
        out[1] = header.len() as u8;
        out[2..4].copy_from_slice(&self.credits.to_le_bytes());
        out[4..8].copy_from_slice(&self.id.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.addr.to_le_bytes());
        out[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        out[28..32].copy_from_slice(&self.aux.to_le_bytes());
        if out.len() >= TH_LEN + MAX_HEADER_LEN {
            // The whole padded array, in a few fixed-size moves (what follows the header is
            // overwritten by the payload or not sent).
            out[TH_LEN..TH_LEN + MAX_HEADER_LEN].copy_from_slice(header.padded());
        } else {
            out[TH_LEN..TH_LEN + header.len()].copy_from_slice(header.as_slice());
        }
        TH_LEN + header.len()
    }

    /// Writes the whole message (this header, `header`, `payload`) into `out`, which holds at
    /// least `TH_LEN + header.len() + payload.len()` bytes; returns the bytes written.
    pub(crate) fn encode_message(
        &self,
        header: &HeaderBytes,
        payload: &[u8],
        out: &mut [u8],
    ) -> usize {
        let n = self.encode(header, out);
        // An empty payload (a ping, a call without arguments) costs no call to `memcpy`.
        if !payload.is_empty() {
            out[n..n + payload.len()].copy_from_slice(payload);
        }
        n + payload.len()
    }

    /// Decodes a received message of `msg.len()` bytes: the header, the message header and the
    /// offset of the payload. Validates every length against the bytes actually received.
    pub(crate) fn decode(msg: &[u8]) -> Result<(Th, HeaderBytes, usize), ProtocolViolation> {
        if msg.len() < TH_LEN {
            return Err(ProtocolViolation::ShortMessage { len: msg.len() });
        }
        let kind = match msg[0] {
            1 => Kind::Hello,
            2 => Kind::Eager,
            3 => Kind::Rts,
            4 => Kind::Fin,
            5 => Kind::Credit,
            6 => Kind::Close,
            other => return Err(ProtocolViolation::UnknownKind(other)),
        };
        let hlen = msg[1];
        if hlen as usize > MAX_HEADER_LEN || TH_LEN + hlen as usize > msg.len() {
            return Err(ProtocolViolation::HeaderLength {
                hlen,
                len: msg.len(),
            });
        }
        let mut u64_at = [0u8; 8];
        let u32_at = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&msg[i..i + 4]);
            u32::from_le_bytes(b)
        };
        let id = u32_at(4);
        let rkey = u32_at(24);
        let aux = u32_at(28);
        u64_at.copy_from_slice(&msg[8..16]);
        let len = u64::from_le_bytes(u64_at);
        u64_at.copy_from_slice(&msg[16..24]);
        let addr = u64::from_le_bytes(u64_at);
        let th = Th {
            kind,
            credits: u16::from_le_bytes([msg[2], msg[3]]),
            id,
            len,
            addr,
            rkey,
            aux,
        };
        let body = TH_LEN + hlen as usize;
        let Some(header) = HeaderBytes::new(&msg[TH_LEN..body]) else {
            return Err(ProtocolViolation::HeaderLength {
                hlen,
                len: msg.len(),
            });
        };
        let carried = (msg.len() - body) as u64;
        if kind == Kind::Eager && carried != th.len {
            return Err(ProtocolViolation::EagerLength {
                announced: th.len,
                carried,
            });
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
        th.aux = 99;
        let h = HeaderBytes::new(b"rpc-header").unwrap();
        let mut buf = [0u8; 128];
        let n = th.encode(&h, &mut buf);
        assert_eq!(n, TH_LEN + 10);
        let (d, dh, off) = Th::decode(&buf[..n]).unwrap();
        assert_eq!(d, th);
        assert_eq!(dh.as_slice(), b"rpc-header");
        assert_eq!(off, n);
    }

    /// The header's copy is exact whether the buffer holds the whole padded array (a fixed
    /// copy) or only the header (a copy of its length), and the payload follows it.
    #[test]
    fn messages_encode_the_same_into_roomy_and_tight_buffers() {
        let mut th = Th::new(Kind::Eager);
        th.len = 3;
        let h = HeaderBytes::new(b"hdr").unwrap();
        let mut roomy = [0xaau8; 128];
        let mut tight = [0xaau8; TH_LEN + 6];
        let n = th.encode_message(&h, b"abc", &mut roomy);
        assert_eq!(th.encode_message(&h, b"abc", &mut tight), n);
        assert_eq!(n, TH_LEN + 6);
        assert_eq!(roomy[..n], tight[..]);
        let (_, dh, off) = Th::decode(&roomy[..n]).unwrap();
        assert_eq!((dh.as_slice(), &roomy[off..n]), (&b"hdr"[..], &b"abc"[..]));
        // No payload: nothing written after the header.
        th.len = 0;
        let mut buf = [0xaau8; 128];
        let n = th.encode_message(&h, b"", &mut buf);
        assert_eq!(n, TH_LEN + 3);
        assert_eq!(Th::decode(&buf[..n]).unwrap().1.as_slice(), b"hdr");
    }

    #[test]
    fn lengths_are_checked_against_the_bytes_received() {
        let mut th = Th::new(Kind::Eager);
        th.len = 5;
        let mut buf = [0u8; 128];
        let n = th.encode(&HeaderBytes::EMPTY, &mut buf);
        assert!(Th::decode(&buf[..n + 5]).is_ok());
        assert_eq!(
            Th::decode(&buf[..n + 4]),
            Err(ProtocolViolation::EagerLength {
                announced: 5,
                carried: 4
            })
        );
        assert_eq!(
            Th::decode(&buf[..10]),
            Err(ProtocolViolation::ShortMessage { len: 10 })
        );
        buf[0] = 99;
        assert_eq!(
            Th::decode(&buf[..n + 5]),
            Err(ProtocolViolation::UnknownKind(99))
        );
        buf[0] = 2;
        buf[1] = 65;
        assert!(matches!(
            Th::decode(&buf),
            Err(ProtocolViolation::HeaderLength { hlen: 65, .. })
        ));
        // A header length within 64 but beyond the bytes received.
        buf[1] = 10;
        assert!(matches!(
            Th::decode(&buf[..TH_LEN + 4]),
            Err(ProtocolViolation::HeaderLength { hlen: 10, .. })
        ));
    }
}
