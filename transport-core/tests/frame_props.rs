//! Property tests of the frame decoder, the stream receiver and the RPC header codec: arbitrary
//! bytes never panic, decoded messages never exceed the configured maximum, the decoder never asks
//! for more memory than one maximal frame, and valid frames survive any split into reads.
//!
//! (This is the "`cargo fuzz` target or proptest suite": cargo-fuzz needs a nightly
//! toolchain, which the CI machines do not have.)

use std::io::Cursor;
use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use proptest::prelude::*;
use tokio_util::codec::Decoder;
use transport_core::frame::{
    encode_prefix, FrameDecoder, PREFIX_LEN, STREAM_MAGIC, STREAM_VERSION,
};
use transport_core::rpc::{HeaderError, Kind, RpcHeader, RPC_HEADER_LEN};
use transport_core::stream::{StreamConfig, StreamReceiver};
use transport_core::{MessageReceiver, Metrics, TransportError, MAX_HEADER_LEN};

/// A small maximum so that the oversize paths are exercised often.
const MAX: usize = 4096;

/// A piece of wire input: either noise or a frame prefix announcing arbitrary lengths, followed
/// by some bytes.
#[derive(Debug, Clone)]
enum Piece {
    Noise(Vec<u8>),
    Prefix {
        header_len: u8,
        payload_len: u32,
        body: Vec<u8>,
    },
    Valid {
        header: Vec<u8>,
        payload: Vec<u8>,
    },
}

fn piece() -> impl Strategy<Value = Piece> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64).prop_map(Piece::Noise),
        (
            any::<u8>(),
            prop_oneof![0u32..(2 * MAX as u32), any::<u32>()],
            prop::collection::vec(any::<u8>(), 0..256)
        )
            .prop_map(|(header_len, payload_len, body)| Piece::Prefix {
                header_len,
                payload_len,
                body
            }),
        (
            prop::collection::vec(any::<u8>(), 0..=MAX_HEADER_LEN),
            prop::collection::vec(any::<u8>(), 0..512)
        )
            .prop_map(|(header, payload)| Piece::Valid { header, payload }),
    ]
}

fn wire(pieces: &[Piece]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in pieces {
        match p {
            Piece::Noise(b) => out.extend_from_slice(b),
            Piece::Prefix {
                header_len,
                payload_len,
                body,
            } => {
                out.extend_from_slice(&STREAM_MAGIC);
                out.push(STREAM_VERSION);
                out.push(*header_len);
                out.extend_from_slice(&payload_len.to_le_bytes());
                out.extend_from_slice(body);
            }
            Piece::Valid { header, payload } => {
                out.extend_from_slice(&encode_prefix(header.len(), payload.len()));
                out.extend_from_slice(header);
                out.extend_from_slice(payload);
            }
        }
    }
    out
}

/// Splits `data` into chunks whose sizes cycle through `cuts` (each at least 1).
fn chunks<'a>(data: &'a [u8], cuts: &'a [usize]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut rest = data;
    let mut i = 0;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let n = cuts[i % cuts.len()].clamp(1, rest.len());
        i += 1;
        let (a, b) = rest.split_at(n);
        rest = b;
        Some(a)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary input in arbitrary reads: no panic, no message above the maximum, the decoder
    /// never announces a pending frame larger than one maximal frame, and a fatal error is final.
    #[test]
    fn decoder_survives_arbitrary_input(
        pieces in prop::collection::vec(piece(), 0..12),
        cuts in prop::collection::vec(1usize..300, 1..8),
    ) {
        let data = wire(&pieces);
        let mut d = FrameDecoder::new(MAX);
        let mut buf = BytesMut::new();
        'feed: for chunk in chunks(&data, &cuts) {
            buf.put_slice(chunk);
            loop {
                match d.decode(&mut buf) {
                    Ok(Some(m)) => {
                        prop_assert!(m.header.len() + m.payload.len() <= MAX);
                        prop_assert!(m.header.len() <= MAX_HEADER_LEN);
                    }
                    Ok(None) => break,
                    Err(TransportError::MessageTooLarge { len, max, .. }) => {
                        prop_assert!(len > MAX as u64);
                        prop_assert_eq!(max, MAX as u64);
                    }
                    Err(e) => {
                        prop_assert!(e.is_fatal(), "non-fatal error {e:?}");
                        break 'feed;
                    }
                }
            }
            if let Some(total) = d.pending_frame_len() {
                prop_assert!(total <= PREFIX_LEN + MAX, "pending {total}");
            }
        }
    }

    /// Valid frames, split at arbitrary points, decode to exactly what was sent, in order; an
    /// oversize frame in between is reported and skipped without disturbing the frames after it.
    #[test]
    fn valid_frames_survive_any_split(
        frames in prop::collection::vec(
            (prop::collection::vec(any::<u8>(), 0..=MAX_HEADER_LEN),
             prop::collection::vec(any::<u8>(), 0..1024),
             prop::bool::weighted(0.2)),
            1..10),
        cuts in prop::collection::vec(1usize..2000, 1..8),
    ) {
        let mut data = Vec::new();
        let mut expected = Vec::new();
        for (header, payload, oversize) in &frames {
            if *oversize {
                // Announce more than MAX, then actually send that many bytes.
                let big = MAX + 1 + payload.len();
                data.extend_from_slice(&encode_prefix(header.len(), big));
                data.extend_from_slice(header);
                data.resize(data.len() + big, 0xAB);
                expected.push(None);
            } else {
                data.extend_from_slice(&encode_prefix(header.len(), payload.len()));
                data.extend_from_slice(header);
                data.extend_from_slice(payload);
                expected.push(Some((header.clone(), payload.clone())));
            }
        }
        let mut d = FrameDecoder::new(MAX);
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for chunk in chunks(&data, &cuts) {
            buf.put_slice(chunk);
            loop {
                match d.decode(&mut buf) {
                    Ok(Some(m)) => got.push(Some((m.header.as_slice().to_vec(), m.payload.to_vec()))),
                    Ok(None) => break,
                    Err(TransportError::MessageTooLarge { .. }) => got.push(None),
                    Err(e) => prop_assert!(false, "unexpected error {e:?}"),
                }
            }
        }
        let tail = d.decode_eof(&mut buf);
        prop_assert!(matches!(tail, Ok(None)), "trailing state {tail:?}");
        prop_assert_eq!(got, expected);
    }

    /// The stream receiver reading arbitrary bytes never panics, never buffers more than one
    /// maximal frame (plus its read buffer), and ends with a message, a typed error or end of
    /// stream — never a hang.
    #[test]
    fn stream_receiver_bounds_its_allocation(pieces in prop::collection::vec(piece(), 0..12)) {
        let data = wire(&pieces);
        let config = StreamConfig { max_message_size: MAX, read_buffer_size: 512, ..StreamConfig::default() };
        let bound = (PREFIX_LEN + MAX).max(2 * (config.read_buffer_size + PREFIX_LEN + MAX_HEADER_LEN));
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(async {
            let mut rx = StreamReceiver::new(Cursor::new(data), Arc::new(Metrics::default()), &config);
            for _ in 0..1000 {
                let r = rx.recv().await;
                prop_assert!(rx.buffer_capacity() <= bound, "capacity {}", rx.buffer_capacity());
                match r {
                    Ok(Some(m)) => prop_assert!(m.header.len() + m.payload.len() <= MAX),
                    Ok(None) => return Ok(()),
                    Err(e) if !e.is_fatal() => {}
                    Err(_) => return Ok(()),
                }
            }
            prop_assert!(false, "receiver neither ended nor failed");
            Ok(())
        })?;
    }

    /// The RPC header decoder accepts arbitrary bytes without panicking, and whatever it accepts
    /// re-encodes to the same bytes.
    #[test]
    fn rpc_header_decode_is_total(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
        match RpcHeader::decode(&bytes) {
            Ok(h) => prop_assert_eq!(&h.encode()[..], &bytes[..RPC_HEADER_LEN]),
            Err(HeaderError::Truncated(n)) => prop_assert!(n < RPC_HEADER_LEN),
            Err(_) => {}
        }
    }

    /// Every header round-trips.
    #[test]
    fn rpc_header_round_trips(
        kind in prop_oneof![Just(Kind::Request), Just(Kind::Response), Just(Kind::Oneway),
                            Just(Kind::Error), Just(Kind::Cancel)],
        method: u32, id: u64, len: u32,
    ) {
        let h = RpcHeader::new(kind, method, id, len as usize);
        prop_assert_eq!(RpcHeader::decode(&h.encode()), Ok(h));
    }
}
