//! The stream frame decoder (`transport_framed::frame::FrameDecoder`, what the uds and tcp
//! receivers run on every byte a peer sends) fed a stream of whole frames, lying prefixes and
//! raw bytes, in chunks of any size. It must not panic; every message it returns fits the
//! limit; `holds_frame` is true exactly when the next decode returns a message; while no
//! error occurred, the messages re-encoded are the bytes consumed; and a stream of valid
//! frames within the limit comes out whole, in order, with nothing left at the end.
#![no_main]

use arbitrary::Arbitrary;
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;
use transport_core::TransportError;
use transport_framed::frame::{FrameDecoder, FramePrefix};

#[derive(Arbitrary, Debug)]
enum Piece {
    /// A frame as an honest peer writes it (header clamped to 64 bytes).
    Frame { header: Vec<u8>, payload: Vec<u8> },
    /// A valid prefix announcing lengths the bytes that follow may not match.
    Prefix { header_len: u8, payload_len: u32 },
    /// Anything.
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// The decoder's limit (kept small so that oversized frames occur).
    max: u16,
    pieces: Vec<Piece>,
    /// Sizes of the reads the stream arrives in (cycled; 0 counts as 1).
    chunks: Vec<u8>,
}

fn frame_bytes(header: &[u8], payload: &[u8], out: &mut Vec<u8>) {
    let p = FramePrefix::new(header.len(), payload.len()).expect("lengths within the format");
    out.extend_from_slice(&p.to_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(payload);
}

fuzz_target!(|input: Input| {
    let max = usize::from(input.max);
    let mut stream = Vec::new();
    let mut sent = Vec::new();
    let mut only_frames_within_limit = true;
    for p in &input.pieces {
        match p {
            Piece::Frame { header, payload } => {
                let header = &header[..header.len().min(64)];
                frame_bytes(header, payload, &mut stream);
                only_frames_within_limit &= header.len() + payload.len() <= max;
                sent.push((header.to_vec(), payload.clone()));
            }
            Piece::Prefix {
                header_len,
                payload_len,
            } => {
                only_frames_within_limit = false;
                match FramePrefix::new(usize::from(*header_len), *payload_len as usize) {
                    Some(p) => stream.extend_from_slice(&p.to_bytes()),
                    None => stream.extend_from_slice(&[b't', b'x', 1, *header_len]),
                }
            }
            Piece::Raw(r) => {
                only_frames_within_limit = false;
                stream.extend_from_slice(r);
            }
        }
    }

    let mut d = FrameDecoder::new(max);
    let mut src = BytesMut::new();
    let mut fed = 0usize;
    let mut got: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut reencoded = Vec::new();
    let mut any_error = false;
    let mut chunk = 0usize;
    let decode = |d: &mut FrameDecoder,
                  src: &mut BytesMut,
                  eof: bool,
                  got: &mut Vec<(Vec<u8>, Vec<u8>)>,
                  reencoded: &mut Vec<u8>|
     -> Result<bool, TransportError> {
        let holds = d.holds_frame(src);
        let r = if eof {
            d.decode_eof(src)
        } else {
            d.decode(src)
        };
        match r {
            Ok(Some(m)) => {
                let len = m.header.len() + m.payload.len();
                assert!(len <= max, "a {len}-byte message passed the limit {max}");
                frame_bytes(m.header.as_slice(), &m.payload, reencoded);
                got.push((m.header.as_slice().to_vec(), m.payload.to_vec()));
                Ok(true)
            }
            Ok(None) => {
                assert!(
                    !holds,
                    "holds_frame said a frame was there, decode found none"
                );
                Ok(false)
            }
            Err(e) => Err(e),
        }
    };
    'feed: loop {
        let n = if input.chunks.is_empty() {
            stream.len() - fed
        } else {
            usize::from(input.chunks[chunk % input.chunks.len()].max(1))
        };
        chunk += 1;
        let n = n.min(stream.len() - fed);
        src.extend_from_slice(&stream[fed..fed + n]);
        fed += n;
        let eof = fed == stream.len();
        loop {
            match decode(&mut d, &mut src, eof, &mut got, &mut reencoded) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    any_error = true;
                    if e.is_fatal() {
                        break 'feed;
                    }
                }
            }
        }
        if eof {
            break;
        }
    }
    if !any_error {
        let consumed = fed - src.len();
        assert_eq!(
            reencoded[..],
            stream[..consumed],
            "the messages returned are not the frames consumed"
        );
    }
    if only_frames_within_limit {
        assert!(!any_error, "valid frames within the limit gave an error");
        assert_eq!(
            got, sent,
            "valid frames did not come out whole and in order"
        );
        assert!(src.is_empty(), "bytes left after the last valid frame");
    }
});
