//! Property tests of the frame codec (the one [`FrameEncoder`] / [`FrameDecoder`] pair) and the
//! stream receiver (the RPC header codec's are in transport-rpc's tests): arbitrary bytes never panic, decoded messages never exceed the
//! configured maximum, the decoder never asks for more memory than one maximal frame, encoded frames
//! decode to what was encoded under any split into reads (also when a reader takes a frame over
//! part-way, as the stream receiver does with large frames), and the stream sender and receiver
//! carry any messages through any write sizes.
//!
//! (This is the "`cargo fuzz` target or proptest suite": cargo-fuzz needs a nightly
//! toolchain, which the CI machines do not have.)

use std::io::Cursor;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use tokio_util::codec::{Decoder, Encoder};
use transport_core::{
    HeaderBytes, Message, MessageReceiver, MessageSender, Metrics, TransportError, MAX_HEADER_LEN,
};
use transport_framed::frame::{
    FrameDecoder, FrameEncoder, FramePrefix, PREFIX_LEN, STREAM_MAGIC, STREAM_VERSION,
};
use transport_framed::{StreamConfig, StreamReceiver, StreamSender};

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
                let mut frame = BytesMut::new();
                FrameEncoder::new(usize::MAX)
                    .encode(message(header, payload), &mut frame)
                    .expect("a valid frame");
                out.extend_from_slice(&frame);
            }
        }
    }
    out
}

fn message(header: &[u8], payload: &[u8]) -> Message {
    Message::new(
        HeaderBytes::new(header).expect("a short header"),
        Bytes::copy_from_slice(payload),
    )
}

/// Arbitrary messages whose header + payload are within [`MAX`].
fn messages() -> impl Strategy<Value = Vec<Message>> {
    prop::collection::vec(
        (
            prop::collection::vec(any::<u8>(), 0..=MAX_HEADER_LEN),
            prop::collection::vec(any::<u8>(), 0..(MAX - MAX_HEADER_LEN)),
        )
            .prop_map(|(h, p)| message(&h, &p)),
        1..10,
    )
}

/// The frames of `msgs` as the encoder writes them: every other one through tokio-util's
/// `Encoder`, half from the zero-copy parts a vectored write sends.
fn encode_all(msgs: &[Message]) -> Vec<u8> {
    let mut encoder = FrameEncoder::new(MAX);
    let mut out = BytesMut::new();
    for (i, m) in msgs.iter().enumerate() {
        if i % 2 == 0 {
            encoder.encode(m.clone(), &mut out).expect("within MAX");
        } else {
            let frame = encoder.encode_frame(m.clone()).expect("within MAX");
            assert_same_memory(frame.payload(), &m.payload);
            for part in frame.parts() {
                out.put_slice(part);
            }
        }
    }
    out.to_vec()
}

/// The zero-copy frame carries the message's own payload (the same memory).
fn assert_same_memory(framed: &Bytes, original: &Bytes) {
    assert_eq!(framed.as_ptr(), original.as_ptr(), "the payload was copied");
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
        let mut data = BytesMut::new();
        let mut expected = Vec::new();
        for (header, payload, oversize) in &frames {
            if *oversize {
                // Announce more than MAX, then actually send that many bytes (encoded by an
                // encoder with a larger limit).
                let big = vec![0xAB; MAX + 1 + payload.len()];
                FrameEncoder::new(usize::MAX)
                    .encode(message(header, &big), &mut data)
                    .expect("a valid frame");
                expected.push(None);
            } else {
                FrameEncoder::new(MAX)
                    .encode(message(header, payload), &mut data)
                    .expect("within MAX");
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
        let config = StreamConfig::default().with_max_message_size(MAX).with_read_buffer_size(512);
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

    /// Encode then decode through the one pair, split at arbitrary points: exactly the
    /// messages that were encoded, in order, and nothing left over.
    #[test]
    fn encoded_messages_decode_to_themselves_under_any_split(
        msgs in messages(),
        cuts in prop::collection::vec(1usize..3000, 1..8),
    ) {
        let data = encode_all(&msgs);
        let mut d = FrameDecoder::new(MAX);
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for chunk in chunks(&data, &cuts) {
            buf.put_slice(chunk);
            while let Some(m) = d.decode(&mut buf).map_err(|e| TestCaseError::fail(e.to_string()))? {
                got.push(m);
            }
        }
        prop_assert!(matches!(d.decode_eof(&mut buf), Ok(None)));
        prop_assert_eq!(got, msgs);
    }

    /// A reader that takes a frame over from the decoder part-way ([`FrameDecoder::detach`],
    /// what the stream receiver does with a large frame) and finishes it with the prefix the
    /// decoder parsed gets the same message as the decoder would have made, and the decoder
    /// carries on with the frames after it.
    #[test]
    fn a_frame_taken_over_part_way_decodes_the_same(
        msgs in messages(),
        which in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
    ) {
        let data = encode_all(&msgs);
        let which = which.index(msgs.len());
        let frames: Vec<usize> = msgs.iter().map(|m| PREFIX_LEN + m.len()).collect();
        let start: usize = frames[..which].iter().sum();
        // Feed up to somewhere inside frame `which`, past its prefix.
        let cut = start + PREFIX_LEN + at.index(frames[which] - PREFIX_LEN + 1);
        let mut d = FrameDecoder::new(MAX);
        let mut buf = BytesMut::from(&data[..cut]);
        let mut got = Vec::new();
        while let Some(m) = d.decode(&mut buf).map_err(|e| TestCaseError::fail(e.to_string()))? {
            got.push(m);
        }
        if got.len() == which {
            let prefix = d.pending_prefix().expect("frame `which` is pending");
            prop_assert_eq!(prefix, FramePrefix::new(msgs[which].header.len(), msgs[which].payload.len()).unwrap());
            let mut own = Vec::new();
            prop_assert_eq!(d.detach(&mut buf, &mut own), Some(prefix));
            prop_assert!(buf.is_empty() && d.is_idle(&buf));
            let rest = prefix.frame_len() - own.len();
            own.extend_from_slice(&data[cut..cut + rest]);
            got.push(prefix.split_frame(Bytes::from(own)).map_err(|e| TestCaseError::fail(e.to_string()))?);
            buf.extend_from_slice(&data[cut + rest..]);
        } else {
            // The cut fell exactly at the frame's end: it was decoded whole.
            prop_assert_eq!(got.len(), which + 1);
            buf.extend_from_slice(&data[cut..]);
        }
        while let Some(m) = d.decode(&mut buf).map_err(|e| TestCaseError::fail(e.to_string()))? {
            got.push(m);
        }
        prop_assert_eq!(got, msgs);
    }

    /// Any prefix the format can carry is read back by the decoder as the same lengths.
    #[test]
    fn prefixes_round_trip(header_len in 0..=MAX_HEADER_LEN, payload_len: u32) {
        let p = FramePrefix::new(header_len, payload_len as usize).expect("in range");
        let mut d = FrameDecoder::new(usize::MAX);
        let mut buf = BytesMut::from(&p.to_bytes()[..]);
        let decoded = d.decode(&mut buf).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if p.message_len() == 0 {
            prop_assert!(decoded.is_some_and(|m| m.is_empty()));
        } else {
            prop_assert!(decoded.is_none());
            prop_assert_eq!(d.pending_prefix(), Some(p));
            prop_assert_eq!(d.pending_frame_len(), Some(PREFIX_LEN + header_len + payload_len as usize));
        }
    }

    /// The stream sender's frames (vectored writes of the encoder's parts) reach the stream
    /// receiver whole, through a pipe whose capacity cuts writes and reads at arbitrary
    /// points, and with a read buffer small enough that some frames take the large-frame path.
    #[test]
    fn stream_sender_and_receiver_carry_any_messages(
        msgs in messages(),
        pipe in 1usize..700,
        batch in any::<bool>(),
    ) {
        let config = StreamConfig::default().with_max_message_size(MAX).with_read_buffer_size(512);
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let got = rt.block_on(async {
            let (a, b) = tokio::io::duplex(pipe);
            let mut tx = StreamSender::new(a, Arc::default(), &config);
            let mut rx = StreamReceiver::new(b, Arc::default(), &config);
            let sent = msgs.clone();
            let writer = tokio::spawn(async move {
                if batch {
                    let mut all = sent;
                    tx.send_batch(&mut all).await.unwrap();
                } else {
                    for m in sent {
                        tx.send(m).await.unwrap();
                    }
                }
                tx.close().await.unwrap();
            });
            let mut got = Vec::new();
            while let Some(m) = rx.recv().await.unwrap() {
                got.push(m);
            }
            writer.await.unwrap();
            got
        });
        prop_assert_eq!(got, msgs);
    }
}
