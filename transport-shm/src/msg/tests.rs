use super::*;
use crate::pool::PoolReader;
use crate::region::Region;
use proptest::prelude::*;
use std::os::fd::AsFd;

const SLOT_BYTES: usize = 1024;

fn pool() -> PoolLayout {
    PoolLayout::new(8, SLOT_BYTES).unwrap()
}

fn decoder() -> Decoder {
    Decoder::new(MsgLimits::default(), pool(), pool())
}

fn header(len: usize) -> HeaderBytes {
    let b: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(13) | 1).collect();
    HeaderBytes::new(&b).unwrap()
}

fn payload(len: usize) -> Bytes {
    (0..len).map(|i| (i % 251) as u8).collect::<Vec<_>>().into()
}

/// A sender's pool and the receiver's view of it (two mappings of one memfd).
fn pools() -> (PoolWriter<Region>, PoolReader) {
    let (mine, fd) = Region::create("pool", pool().bytes()).unwrap();
    let theirs = Region::map(fd.as_fd(), pool().bytes()).unwrap();
    (
        PoolWriter::new(mine, pool()).unwrap(),
        PoolReader::new(theirs, pool()).unwrap(),
    )
}

/// Feeds `entries` to `dec`: the message completed by the last, with none before it.
fn decode_all(dec: &mut Decoder, entries: &[Entry]) -> Decoded {
    let (last, rest) = entries.split_last().unwrap();
    for e in rest {
        assert_eq!(dec.push(e).unwrap(), None);
        assert!(dec.in_message());
    }
    let d = dec.push(last).unwrap().expect("complete");
    assert!(!dec.in_message());
    d
}

/// Sends `msg` through encoder, pool and decoder and returns what the receiver gets.
fn round_trip(msg: &Message, tx: &mut PoolWriter<Region>, rx: &mut PoolReader) -> Message {
    let enc = Encoder::new(MsgLimits::default());
    let mut out = [[0xaa; ENTRY_BYTES]; 8];
    let n = enc.encode(msg, tx, &mut out).unwrap().entries;
    assert_eq!(n, entries_for(msg.header.len() + inline_len(msg)));
    match decode_all(&mut decoder(), &out[..n]) {
        Decoded::Message(m) => m,
        Decoded::InSlot {
            header,
            slot,
            offset,
            len,
        } => Message::new(header, rx.take(slot, offset, len).unwrap()),
        other => panic!("{other:?}"),
    }
}

fn inline_len(msg: &Message) -> usize {
    if msg.payload.len() <= DEFAULT_INLINE_LIMIT {
        msg.payload.len()
    } else {
        0
    }
}

#[test]
fn the_layout_constants_hold_together() {
    assert_eq!(
        (DESCRIPTOR_BYTES, FIRST_DATA, RETURNS_PER_ENTRY),
        (16, 48, 12)
    );
    assert_eq!(MsgLimits::default().max_entries(), entries_for(64 + 192));
    // The most continuation entries any limit allows fit in the descriptor's byte.
    let widest = MsgLimits::new(MAX_INLINE_LIMIT, u32::MAX as usize).unwrap();
    assert_eq!(widest.max_entries(), 66);
    assert_eq!(
        MsgLimits::new(0, u32::MAX as usize + 1),
        Err(MsgError::BadLimits {
            inline_limit: 0,
            max_payload: u32::MAX as usize + 1
        })
    );
}

#[test]
fn a_void_rpc_request_is_one_entry() {
    let enc = Encoder::new(MsgLimits::default());
    let mut out = [[0xaa; ENTRY_BYTES]; 2];
    for h in [16, 24, 32, 48] {
        assert_eq!(
            enc.encode_inline(&header(h), b"", &mut out).unwrap(),
            1,
            "{h}"
        );
    }
    // Exactly: descriptor, header, zeros.
    let n = enc.encode_inline(&header(24), b"", &mut out).unwrap();
    let e = out[..n][0];
    assert_eq!(&e[..16], &[1, 24, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(&e[16..40], header(24).as_slice());
    assert!(e[40..].iter().all(|b| *b == 0));
    assert_eq!(enc.encode_inline(&header(49), b"", &mut out).unwrap(), 2);
}

#[test]
fn messages_of_every_boundary_size_round_trip_exactly() {
    let (mut tx, mut rx) = pools();
    let sizes = [
        0,
        1,
        FIRST_DATA - 24,
        FIRST_DATA - 23,
        DEFAULT_INLINE_LIMIT,
        DEFAULT_INLINE_LIMIT + 1,
        SLOT_BYTES - 1,
        SLOT_BYTES,
    ];
    for h in [0, 1, 24, 47, 48, 49, 64] {
        for len in sizes {
            let msg = Message::new(header(h), payload(len));
            let got = round_trip(&msg, &mut tx, &mut rx);
            assert_eq!(got, msg, "header {h}, payload {len}");
            // Return any slot the payload used, as the transport would.
            drop(got);
            let mut back = [SlotId::new(0); RETURNS_PER_ENTRY];
            let n = rx.pop_returns(&mut back);
            assert_eq!(n, usize::from(len > DEFAULT_INLINE_LIMIT), "{h}/{len}");
            for s in &back[..n] {
                tx.release(*s).unwrap();
            }
        }
    }
    assert_eq!(tx.lent(), 0);
}

#[test]
fn payloads_over_a_slot_or_the_limit_are_refused_when_encoding() {
    let (mut tx, _rx) = pools();
    let enc = Encoder::new(MsgLimits::default());
    let mut out = [[0; ENTRY_BYTES]; 8];
    let too_long = Message::new(header(1), payload(SLOT_BYTES + 1));
    assert_eq!(
        enc.encode(&too_long, &mut tx, &mut out),
        Err(MsgError::PayloadTooLong {
            len: SLOT_BYTES + 1,
            max: SLOT_BYTES
        })
    );
    assert_eq!(
        enc.encode_inline(&header(1), &payload(193), &mut out),
        Err(MsgError::InlineTooLong { len: 193, max: 192 })
    );
    assert_eq!(
        enc.encode_inline(&header(64), &payload(192), &mut out[..3]),
        Err(MsgError::NoRoom { need: 5, got: 3 })
    );
    let big = Message::new(header(64), payload(500));
    assert_eq!(
        enc.encode(&big, &mut tx, &mut out[..1]),
        Err(MsgError::NoRoom { need: 2, got: 1 })
    );
    assert_eq!(tx.lent(), 0, "no slot taken by a refused message");
    for _ in 0..8 {
        enc.encode(&big, &mut tx, &mut out).unwrap();
    }
    assert_eq!(enc.encode(&big, &mut tx, &mut out), Err(MsgError::NoSlot));
}

#[test]
fn slot_returns_and_close_round_trip() {
    let mut dec = decoder();
    let mut e = [0xaa; ENTRY_BYTES];
    for n in [1, 5, RETURNS_PER_ENTRY] {
        let ids: Vec<SlotId> = (0..n as u32).map(|i| SlotId::new(7 - i % 8)).collect();
        assert_eq!(encode_returns(&ids, &mut e), n);
        match dec.push(&e).unwrap() {
            Some(Decoded::Returns(r)) => assert_eq!(r.as_slice(), &ids[..]),
            other => panic!("{other:?}"),
        }
    }
    encode_close(&mut e);
    assert_eq!(e[0], 4);
    assert_eq!(dec.push(&e).unwrap(), Some(Decoded::Close));
}

/// A one-entry inline message with a 24-byte header and `payload` bytes, to corrupt.
fn good_entry(payload_len: usize) -> Entry {
    let mut out = [[0; ENTRY_BYTES]; 1];
    Encoder::new(MsgLimits::default())
        .encode_inline(&header(24), &payload(payload_len), &mut out)
        .unwrap();
    out[0]
}

fn first_error(entries: &[Entry]) -> MsgError {
    let mut dec = decoder();
    for e in entries {
        if let Err(err) = dec.push(e) {
            // It sticks, whatever comes next.
            assert_eq!(dec.push(&good_entry(0)), Err(err));
            assert_eq!(dec.failed(), Some(err));
            return err;
        }
    }
    panic!("no error from {entries:?}");
}

#[test]
fn every_bad_field_is_its_own_typed_error_and_sticks() {
    let with = |f: &dyn Fn(&mut Entry)| {
        let mut e = good_entry(4);
        f(&mut e);
        e
    };
    for k in [0u8, 5, 255] {
        assert_eq!(
            first_error(&[with(&|e| e[0] = k)]),
            MsgError::UnknownKind(k)
        );
    }
    for byte in [3u8, 12, 15, 16 + 28, 63] {
        assert_eq!(
            first_error(&[with(&|e| e[byte as usize] = 1)]),
            MsgError::Reserved { entry: 0, byte },
            "{byte}"
        );
    }
    // An inline message must not name a slot.
    assert_eq!(
        first_error(&[with(&|e| e[9] = 1)]),
        MsgError::Reserved { entry: 0, byte: 9 }
    );
    assert_eq!(
        first_error(&[with(&|e| e[1] = 65)]),
        MsgError::HeaderTooLong(65)
    );
    assert_eq!(
        first_error(&[with(&|e| e[4..8].copy_from_slice(&193u32.to_le_bytes()))]),
        MsgError::InlineTooLong { len: 193, max: 192 }
    );
    assert_eq!(
        first_error(&[with(&|e| e[4..8].copy_from_slice(&u32::MAX.to_le_bytes()))]),
        MsgError::InlineTooLong {
            len: u32::MAX as usize,
            max: 192
        }
    );
    // 24 + 4 bytes of data need no continuation; 1 or 255 announced.
    for got in [1u8, 255] {
        assert_eq!(
            first_error(&[with(&|e| e[2] = got)]),
            MsgError::BadContinuation { got, want: 0 }
        );
    }
    // 24 + 100 bytes need 2; 1 announced.
    let mut two = [[0; ENTRY_BYTES]; 3];
    let n = Encoder::new(MsgLimits::default())
        .encode_inline(&header(24), &payload(100), &mut two)
        .unwrap();
    assert_eq!(n, 3);
    two[0][2] = 1;
    assert_eq!(
        first_error(&two[..1]),
        MsgError::BadContinuation { got: 1, want: 2 }
    );
    // Padding after the data in the last continuation entry.
    two[0][2] = 2;
    let end = (24 + 100 - FIRST_DATA) - ENTRY_BYTES; // data bytes in the last entry
    two[2][end] = 9;
    assert_eq!(
        first_error(&two),
        MsgError::Reserved {
            entry: 2,
            byte: end as u8
        }
    );
}

#[test]
fn bad_slots_and_slot_lengths_are_refused() {
    let mut out = [[0; ENTRY_BYTES]; 2];
    let enc = Encoder::new(MsgLimits::default());
    let in_slot = |slot: u32, len: usize, out: &mut [Entry; 2]| {
        enc.encode_in_slot(&header(24), SlotId::new(slot), 0, len, out)
            .unwrap();
        out[0]
    };
    assert_eq!(
        first_error(&[in_slot(8, 10, &mut out)]),
        MsgError::SlotOutOfRange { slot: 8, slots: 8 }
    );
    assert_eq!(
        first_error(&[in_slot(u32::MAX, 10, &mut out)]),
        MsgError::SlotOutOfRange {
            slot: u32::MAX,
            slots: 8
        }
    );
    assert_eq!(
        first_error(&[in_slot(0, SLOT_BYTES + 1, &mut out)]),
        MsgError::PayloadTooLong {
            len: SLOT_BYTES + 1,
            max: SLOT_BYTES
        }
    );
    // An offset in the slot: the payload must end inside it, and no sum may wrap.
    let at = |offset: u32, len: usize, out: &mut [Entry; 2]| {
        enc.encode_in_slot(&header(24), SlotId::new(1), offset, len, out)
            .unwrap();
        out[0]
    };
    let last = (SLOT_BYTES - 10) as u32;
    assert!(matches!(
        decoder().push(&at(last, 10, &mut out)),
        Ok(Some(Decoded::InSlot { offset, len: 10, .. })) if offset == last
    ));
    for (offset, len) in [(last + 1, 10), (1, SLOT_BYTES), (u32::MAX, 1)] {
        assert_eq!(
            first_error(&[at(offset, len, &mut out)]),
            MsgError::PastSlotEnd {
                offset,
                len,
                slot_bytes: SLOT_BYTES
            }
        );
    }
    // Only a payload in a slot has an offset.
    let mut inline = [[0; ENTRY_BYTES]; 1];
    enc.encode_inline(&header(8), b"x", &mut inline).unwrap();
    inline[0][13] = 1;
    assert_eq!(
        first_error(&inline),
        MsgError::Reserved { entry: 0, byte: 13 }
    );
    // The payload limit binds when it is below a slot.
    let mut dec = Decoder::new(MsgLimits::new(16, 100).unwrap(), pool(), pool());
    assert_eq!(
        dec.push(&in_slot(0, 101, &mut out)),
        Err(MsgError::PayloadTooLong { len: 101, max: 100 })
    );
    // Returns: ids in range of *this side's* pool, a count from 1 to 12, zeros after.
    let mut e = [0; ENTRY_BYTES];
    encode_returns(&[SlotId::new(1), SlotId::new(8)], &mut e);
    assert_eq!(
        first_error(&[e]),
        MsgError::SlotOutOfRange { slot: 8, slots: 8 }
    );
    for count in [0u32, 13, u32::MAX] {
        encode_returns(&[SlotId::new(1)], &mut e);
        e[4..8].copy_from_slice(&count.to_le_bytes());
        assert_eq!(first_error(&[e]), MsgError::BadReturnCount(count));
    }
    encode_returns(&[SlotId::new(1)], &mut e);
    e[20] = 1;
    assert_eq!(first_error(&[e]), MsgError::Reserved { entry: 0, byte: 20 });
    encode_close(&mut e);
    e[63] = 1;
    assert_eq!(first_error(&[e]), MsgError::Reserved { entry: 0, byte: 63 });
}

fn message() -> impl Strategy<Value = Message> {
    (
        proptest::collection::vec(any::<u8>(), 0..=MAX_HEADER_LEN),
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..=DEFAULT_INLINE_LIMIT + 8),
            proptest::collection::vec(any::<u8>(), 0..=SLOT_BYTES),
        ],
    )
        .prop_map(|(h, p)| Message::new(HeaderBytes::new(&h).unwrap(), p.into()))
}

/// What a hostile peer may put in the ring, a few entries at a time: random bytes; a
/// plausible descriptor (kind 1 to 4, small lengths, often the right continuation count)
/// with random data; zeros; or a real message's entries with one byte changed (or none),
/// so that every check, and the continuation states, are reached.
fn peer_entries() -> impl Strategy<Value = Vec<Entry>> {
    let random = proptest::array::uniform32(any::<u8>()).prop_map(|h| {
        let mut e = [0u8; ENTRY_BYTES];
        e[..32].copy_from_slice(&h);
        e[32..].copy_from_slice(&h);
        vec![e]
    });
    let plausible = (
        1u8..=4,
        0u8..=70,
        0u8..=6,
        prop_oneof![0u32..=200, 0u32..=1100, any::<u32>()],
        prop_oneof![0u32..=10, any::<u32>()],
        any::<bool>(),
        any::<bool>(),
        any::<u8>(),
    )
        .prop_map(|(kind, hl, cont, len, slot, fix_cont, dirty, fill)| {
            let mut e = [0u8; ENTRY_BYTES];
            e[0] = kind;
            e[1] = hl;
            e[2] = cont;
            e[4..8].copy_from_slice(&len.to_le_bytes());
            e[8..12].copy_from_slice(&slot.to_le_bytes());
            let data = hl as usize + if kind == 1 { len as usize } else { 0 };
            if fix_cont {
                e[2] = continuations_for(data).min(255) as u8;
            }
            for b in &mut e[16..16 + data.min(FIRST_DATA)] {
                *b = fill;
            }
            if dirty {
                e[63] |= 1;
            }
            vec![e]
        });
    let mutated = (
        message(),
        any::<bool>(),
        any::<usize>(),
        any::<u8>(),
        0usize..ENTRY_BYTES,
    )
        .prop_map(|(msg, in_slot, which, value, byte)| {
            let enc = Encoder::new(MsgLimits::default());
            let mut out = [[0u8; ENTRY_BYTES]; 8];
            let n = if in_slot || msg.payload.len() > DEFAULT_INLINE_LIMIT {
                let len = msg.payload.len().min(SLOT_BYTES);
                enc.encode_in_slot(&msg.header, SlotId::new(3), 0, len, &mut out)
            } else {
                enc.encode_inline(&msg.header, &msg.payload, &mut out)
            }
            .unwrap();
            let mut v = out[..n].to_vec();
            // Half of them left as they were (valid), half with one byte changed.
            let i = which % (2 * n);
            if i < n {
                v[i][byte] = value;
            }
            v
        });
    let returns = (
        proptest::collection::vec(prop_oneof![0u32..8, 0u32..10], 1..=RETURNS_PER_ENTRY),
        prop_oneof![Just(None), (0u32..=14).prop_map(Some)],
    )
        .prop_map(|(ids, count)| {
            let ids: Vec<SlotId> = ids.into_iter().map(SlotId::new).collect();
            let mut e = [0u8; ENTRY_BYTES];
            encode_returns(&ids, &mut e);
            if let Some(c) = count {
                e[4..8].copy_from_slice(&c.to_le_bytes());
            }
            vec![e]
        });
    let mut close = [0u8; ENTRY_BYTES];
    encode_close(&mut close);
    prop_oneof![
        1 => random,
        2 => plausible,
        5 => mutated,
        1 => returns,
        1 => Just(vec![close]),
        1 => Just(vec![[0u8; ENTRY_BYTES]]),
    ]
}

proptest! {
    /// Any sequence of messages, through one encoder, pool and decoder, comes out exactly.
    #[test]
    fn random_messages_round_trip_exactly(msgs in proptest::collection::vec(message(), 1..20)) {
        let (mut tx, mut rx) = pools();
        let enc = Encoder::new(MsgLimits::default());
        let mut dec = decoder();
        let mut out = [[0x55; ENTRY_BYTES]; 8];
        for msg in msgs {
            let n = enc.encode(&msg, &mut tx, &mut out).unwrap().entries;
            let mut got = None;
            for (i, e) in out[..n].iter().enumerate() {
                let d = dec.push(e).unwrap();
                prop_assert_eq!(d.is_some(), i == n - 1);
                got = d;
            }
            let got = match got.unwrap() {
                Decoded::Message(m) => m,
                Decoded::InSlot { header, slot, offset, len } => {
                    Message::new(header, rx.take(slot, offset, len).unwrap())
                }
                other => return Err(TestCaseError::fail(format!("{other:?}"))),
            };
            prop_assert_eq!(&got, &msg);
            drop(got);
            // Slots come back through a return entry, like on the rings.
            let mut back = [SlotId::new(0); RETURNS_PER_ENTRY];
            let k = rx.pop_returns(&mut back);
            if k > 0 {
                let mut e = [0; ENTRY_BYTES];
                prop_assert_eq!(encode_returns(&back[..k], &mut e), k);
                match dec.push(&e).unwrap() {
                    Some(Decoded::Returns(r)) => {
                        for s in r.as_slice() {
                            tx.release(*s).unwrap();
                        }
                    }
                    other => return Err(TestCaseError::fail(format!("{other:?}"))),
                }
            }
            prop_assert_eq!(tx.lent(), 0);
        }
    }

    /// Whatever entries the peer writes, the decoder returns messages within the limits,
    /// "more to come", or a typed error that then sticks; it never panics.
    #[test]
    fn arbitrary_entries_give_typed_errors_or_valid_messages(
        chunks in proptest::collection::vec(peer_entries(), 1..30)
    ) {
        let limits = MsgLimits::default();
        let mut dec = Decoder::new(limits, pool(), pool());
        let mut failed = None;
        for e in chunks.iter().flatten() {
            match dec.push(e) {
                Ok(Some(Decoded::Message(m))) => {
                    prop_assert!(failed.is_none());
                    prop_assert!(m.header.len() <= MAX_HEADER_LEN);
                    prop_assert!(m.payload.len() <= limits.inline_limit());
                }
                Ok(Some(Decoded::InSlot { header, slot, offset, len })) => {
                    prop_assert!(header.len() <= MAX_HEADER_LEN);
                    prop_assert!((slot.get() as usize) < pool().slots());
                    prop_assert!(len as usize <= SLOT_BYTES);
                    prop_assert!(offset as usize + len as usize <= SLOT_BYTES);
                    // The triple is one the pool's own check accepts.
                    prop_assert!(pool().payload_range(slot, offset, len).is_ok());
                }
                Ok(Some(Decoded::Returns(r))) => {
                    prop_assert!((1..=RETURNS_PER_ENTRY).contains(&r.as_slice().len()));
                    prop_assert!(r.as_slice().iter().all(|s| (s.get() as usize) < pool().slots()));
                }
                Ok(Some(Decoded::Close)) | Ok(None) => prop_assert!(failed.is_none()),
                Err(e) => {
                    prop_assert!(failed.is_none_or(|f| f == e), "the error changed");
                    prop_assert!(!matches!(e, MsgError::BadLimits { .. } | MsgError::NoRoom { .. } | MsgError::Pool(_) | MsgError::NoSlot), "an encoding error from the decoder: {}", e);
                    failed = Some(e);
                }
            }
        }
    }
}

#[test]
fn a_decoder_sizes_its_buffer_from_its_limits_and_never_changes_it() {
    let mut dec = decoder();
    let (ptr, len) = (dec.buf.as_ptr(), dec.buf.len());
    assert_eq!(len, MsgLimits::default().max_entries() * ENTRY_BYTES);
    // The largest messages, then a peer announcing far more than the limits allow.
    let enc = Encoder::new(MsgLimits::default());
    let mut out = [[0; ENTRY_BYTES]; 8];
    for _ in 0..3 {
        let n = enc
            .encode_inline(&header(64), &payload(DEFAULT_INLINE_LIMIT), &mut out)
            .unwrap();
        assert_eq!(n, MsgLimits::default().max_entries());
        assert!(matches!(
            decode_all(&mut dec, &out[..n]),
            Decoded::Message(_)
        ));
    }
    let mut huge = out[0];
    huge[2] = 255;
    huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(dec.push(&huge).is_err());
    assert_eq!((dec.buf.as_ptr(), dec.buf.len()), (ptr, len));
    let small = Decoder::new(MsgLimits::new(0, 0).unwrap(), pool(), pool());
    assert_eq!(
        small.buf.len(),
        2 * ENTRY_BYTES,
        "a full header: two entries"
    );
}
