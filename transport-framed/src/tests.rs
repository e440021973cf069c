use super::*;
use crate::frame::encode_prefix;
use bytes::Bytes;
use transport_core::HeaderBytes;

fn pair(
    max: usize,
) -> (
    StreamSender<tokio::io::DuplexStream>,
    StreamReceiver<tokio::io::DuplexStream>,
    tokio::io::DuplexStream,
) {
    let (a, b) = tokio::io::duplex(1 << 16);
    let (c, d) = tokio::io::duplex(1 << 16);
    drop(c);
    let cfg = StreamConfig {
        max_message_size: max,
        read_buffer_size: 4096,
        ..StreamConfig::default()
    };
    let m = Arc::new(Metrics::default());
    (
        StreamSender::new(a, m.clone(), &cfg),
        StreamReceiver::new(b, m, &cfg),
        d,
    )
}

/// The write futures stay small: the RPC client boxes one per batch it writes, and a
/// future over ~1 KiB misses the allocator's per-thread cache (the vectored write's 64
/// slices would make it 1.1 KiB; docs/notes/2026-12-03-bench-instructions-per-call.md).
#[test]
fn write_futures_keep_their_slices_off_the_future() {
    let (mut tx, _rx, _) = pair(1 << 20);
    let mut batch = vec![Message::new(HeaderBytes::EMPTY, Bytes::new())];
    let send_batch = std::mem::size_of_val(&tx.send_batch(&mut batch));
    let send = std::mem::size_of_val(&tx.send(Message::new(HeaderBytes::EMPTY, Bytes::new())));
    let slices = MAX_SLICES * std::mem::size_of::<IoSlice<'static>>();
    assert!(
        send_batch < slices && send < slices,
        "send_batch future {send_batch} B, send future {send} B: the {slices} B of slices \
         are kept across the write's await"
    );
}

#[tokio::test]
async fn messages_round_trip_in_order() {
    let (mut tx, mut rx, _) = pair(1 << 20);
    let writer = tokio::spawn(async move {
        for i in 0u32..200 {
            let payload = Bytes::from(vec![i as u8; (i as usize) * 37]);
            tx.send(Message::new(HeaderBytes::from(i.to_le_bytes()), payload))
                .await
                .unwrap();
        }
        let mut batch: Vec<Message> = (0..10)
            .map(|i| Message::new(HeaderBytes::from([i as u8]), Bytes::new()))
            .collect();
        tx.send_batch(&mut batch).await.unwrap();
        assert!(batch.is_empty());
        tx.close().await.unwrap();
    });
    for i in 0u32..200 {
        let m = rx.recv().await.unwrap().unwrap();
        assert_eq!(m.header.as_slice(), i.to_le_bytes());
        assert_eq!(m.payload.len(), i as usize * 37);
        assert!(m.payload.iter().all(|&b| b == i as u8));
    }
    for i in 0..10u8 {
        assert_eq!(rx.recv().await.unwrap().unwrap().header.as_slice(), [i]);
    }
    assert!(rx.recv().await.unwrap().is_none(), "clean EOF");
    writer.await.unwrap();
}

/// A lone frame (the writer's one-frame path) written a few bytes at a time, so that its
/// writes start inside its head, at the head's end and inside its payload, arrives whole,
/// for every mix of empty and non-empty header and payload.
#[tokio::test]
async fn lone_frames_written_in_pieces_arrive_whole() {
    let (a, b) = tokio::io::duplex(3);
    let cfg = StreamConfig::default();
    let mut tx = StreamSender::new(a, Arc::default(), &cfg);
    let m = Arc::new(Metrics::default());
    let mut rx = StreamReceiver::new(b, m.clone(), &cfg);
    let cases: Vec<(Vec<u8>, Vec<u8>)> = [0usize, 1, 7]
        .iter()
        .flat_map(|&h| [0usize, 1, 13].map(|p| (vec![h as u8; h], vec![p as u8; p])))
        .collect();
    let sent = cases.clone();
    let writer = tokio::spawn(async move {
        for (h, p) in sent {
            let msg = Message::new(HeaderBytes::new(&h).unwrap(), Bytes::from(p));
            tx.send(msg).await.unwrap();
        }
    });
    let wait = std::time::Duration::from_secs(10);
    for (h, p) in cases {
        let got = tokio::time::timeout(wait, rx.recv())
            .await
            .expect("in time");
        let got = got.unwrap().unwrap();
        assert_eq!((got.header.as_slice(), &got.payload[..]), (&h[..], &p[..]));
    }
    tokio::time::timeout(wait, writer).await.unwrap().unwrap();
    // The 3-byte pipe made the writer write in pieces (and the reader read in them).
    assert!(m.snapshot().syscalls > 2 * 9, "{:?}", m.snapshot().syscalls);
}

#[tokio::test]
async fn large_frame_gets_exact_allocation() {
    let (mut tx, mut rx, _) = pair(4 << 20);
    let payload = Bytes::from((0..(3 << 20)).map(|i| i as u8).collect::<Vec<_>>());
    let p2 = payload.clone();
    tokio::spawn(async move { tx.send(Message::new(HeaderBytes::EMPTY, p2)).await });
    let m = rx.recv().await.unwrap().unwrap();
    assert_eq!(m.payload, payload);
    assert!(rx.buffer_capacity() <= (3 << 20) + PREFIX_LEN + 4096);
}

/// Back-to-back large frames are read into their own buffers, not first into the read
/// buffer and then copied: after a large frame the receiver reads only a little ahead.
/// A small frame after the large ones still arrives, and reads return to full size.
#[tokio::test]
async fn large_frames_in_a_row_are_barely_copied() {
    let (mut rx, m) = eight_large_frames_then_a_small_one().await;
    recv_the_eight_large_frames(&mut rx).await;
    let small = rx.recv().await.unwrap().unwrap();
    assert_eq!(
        (small.header.as_slice(), &small.payload[..]),
        (&[9u8][..], &b"small"[..])
    );
    // The first frame's start came with a full read buffer; the other seven with at most
    // READ_AFTER_LARGE bytes each, not a full read buffer.
    let copied = m.snapshot().payload_bytes_copied;
    assert!(
        copied <= (64 << 10) + 7 * READ_AFTER_LARGE as u64,
        "{copied} payload bytes copied"
    );
}

/// A stream of large frames takes one read per frame: each frame's last read also takes
/// the next frame's start (`READ_PAST_LARGE`), so that start is not a read of its own.
/// A small frame caught in that read arrives without another.
#[tokio::test]
async fn large_frames_in_a_row_take_one_read_each() {
    let (mut rx, m) = eight_large_frames_then_a_small_one().await;
    recv_the_eight_large_frames(&mut rx).await;
    let reads_for_large = m.snapshot().syscalls;
    let small = rx.recv().await.unwrap().unwrap();
    assert_eq!(&small.payload[..], b"small");
    // The first read fills the read buffer; then one read per frame, each ending in the
    // next frame's start (two per frame without the read past the frame).
    assert_eq!(reads_for_large, 1 + 8, "reads for 8 large frames");
    assert_eq!(
        m.snapshot().syscalls,
        reads_for_large,
        "the small frame came with the last large frame's read"
    );
}

/// A receiver (read buffer 64 KiB) with 8 frames of 256 KiB (header `[i]`, payload all
/// `i`) and then a small one (header `[9]`, payload "small") written before its first
/// read, so every read could take a full buffer; and the receiver's own counters.
async fn eight_large_frames_then_a_small_one(
) -> (StreamReceiver<tokio::io::DuplexStream>, Arc<Metrics>) {
    let (a, b) = tokio::io::duplex(8 << 20);
    let cfg = StreamConfig {
        max_message_size: 1 << 20,
        read_buffer_size: 64 << 10,
        ..StreamConfig::default()
    };
    let mut tx = StreamSender::new(a, Arc::default(), &cfg);
    let m = Arc::new(Metrics::default());
    let rx = StreamReceiver::new(b, m.clone(), &cfg);
    for i in 0..8u8 {
        let payload = Bytes::from(vec![i; 256 << 10]);
        tx.send(Message::new(HeaderBytes::from([i]), payload))
            .await
            .unwrap();
    }
    let small = Message::new(HeaderBytes::from([9]), Bytes::from_static(b"small"));
    tx.send(small).await.unwrap();
    (rx, m)
}

/// Receives and checks the 8 large frames of [`eight_large_frames_then_a_small_one`].
async fn recv_the_eight_large_frames(rx: &mut StreamReceiver<tokio::io::DuplexStream>) {
    for i in 0..8u8 {
        let msg = rx.recv().await.unwrap().unwrap();
        assert_eq!(msg.header.as_slice(), [i]);
        assert_eq!(msg.payload.len(), 256 << 10);
        assert!(msg.payload.iter().all(|&b| b == i));
    }
}

/// The receiver reports how much of a partly received message is still to come, for
/// small frames (in the read buffer) and large ones (in their own buffer), and nothing
/// between messages.
#[tokio::test]
async fn remaining_in_message_follows_partial_frames() {
    use tokio::io::AsyncWriteExt;
    let (mut w, b) = tokio::io::duplex(1 << 20);
    let cfg = StreamConfig {
        max_message_size: 1 << 20,
        read_buffer_size: 4096,
        ..StreamConfig::default()
    };
    let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
    assert_eq!(rx.remaining_in_message(), None);
    for len in [1000usize, 100_000] {
        let mut frame = encode_prefix(2, len).to_vec();
        frame.extend_from_slice(&[1, 2]);
        frame.extend(std::iter::repeat_n(9u8, len));
        w.write_all(&frame[..500]).await.unwrap();
        let pending = tokio::time::timeout(std::time::Duration::from_millis(20), rx.recv());
        assert!(pending.await.is_err(), "the frame is incomplete");
        assert_eq!(rx.remaining_in_message(), Some(frame.len() - 500));
        w.write_all(&frame[500..]).await.unwrap();
        let msg = rx.recv().await.unwrap().unwrap();
        assert_eq!(msg.payload.len(), len);
        assert_eq!(rx.remaining_in_message(), None);
    }
}

/// A window of more than 16 large frames held at once goes back to the pool whole, and
/// the next window reuses every buffer (a pool of 16 would make a window of 32 RPC
/// replies of 64 KiB allocate half its buffers afresh).
#[tokio::test]
async fn a_window_of_32_large_frames_reuses_all_its_buffers() {
    let (mut tx, mut rx, _) = pair(8 << 20);
    let writer = tokio::spawn(async move {
        for i in 0..64u8 {
            let payload = Bytes::from(vec![i; 100_000]);
            tx.send(Message::new(HeaderBytes::from([0u8; 3]), payload))
                .await
                .unwrap();
        }
        tx
    });
    let mut first = Vec::new();
    for _ in 0..32 {
        first.push(rx.recv().await.unwrap().unwrap());
    }
    let buffers: std::collections::HashSet<usize> =
        first.iter().map(|m| m.payload.as_ptr() as usize).collect();
    assert_eq!(buffers.len(), 32, "held frames have buffers of their own");
    drop(first);
    let mut second = Vec::new();
    for i in 32..64u8 {
        let m = rx.recv().await.unwrap().unwrap();
        assert!(m.payload.iter().all(|&b| b == i));
        second.push(m);
    }
    let reused = second
        .iter()
        .filter(|m| buffers.contains(&(m.payload.as_ptr() as usize)))
        .count();
    assert_eq!(reused, 32, "every buffer of the first window is reused");
    drop(writer.await.unwrap());
}

/// The pool hands out the buffer given back last (the one whose bytes are likeliest
/// still cached), not the oldest: a window of replies then cycles through few buffers.
#[tokio::test]
async fn the_large_buffer_given_back_last_is_reused_first() {
    let (mut tx, mut rx, _) = pair(4 << 20);
    let writer = tokio::spawn(async move {
        for i in 0..4u8 {
            let payload = Bytes::from(vec![i + 1; 100_000]);
            tx.send(Message::new(HeaderBytes::from([i; 3]), payload))
                .await
                .unwrap();
        }
        tx
    });
    let first = rx.recv().await.unwrap().unwrap();
    let second = rx.recv().await.unwrap().unwrap();
    let third = rx.recv().await.unwrap().unwrap();
    let buffer_of = |m: &Message| m.payload.as_ptr() as usize - (PREFIX_LEN + 3);
    let (a, b, c) = (buffer_of(&first), buffer_of(&second), buffer_of(&third));
    assert!(
        a != b && b != c && a != c,
        "held payloads have buffers of their own"
    );
    // Given back in the order first, second, third: the third is the newest.
    drop(first);
    drop(second);
    drop(third);
    let fourth = rx.recv().await.unwrap().unwrap();
    assert!(fourth.payload.iter().all(|&x| x == 4));
    assert_eq!(
        buffer_of(&fourth),
        c,
        "the buffer given back last is the one reused"
    );
    drop(writer.await.unwrap());
}

#[tokio::test]
async fn large_frame_buffers_are_reused_once_dropped() {
    let (mut tx, mut rx, _) = pair(4 << 20);
    let m = rx.metrics().clone();
    let sizes = [300_000usize, 290_000, 300_000, 5_000];
    let writer = tokio::spawn(async move {
        for (i, n) in sizes.into_iter().enumerate() {
            let payload = Bytes::from(vec![i as u8 + 1; n]);
            tx.send(Message::new(HeaderBytes::from([i as u8; 3]), payload))
                .await
                .unwrap();
        }
        tx
    });
    let first = rx.recv().await.unwrap().unwrap();
    assert_eq!(first.header.as_slice(), [0u8; 3]);
    assert_eq!(first.payload.len(), 300_000);
    assert!(first.payload.iter().all(|&b| b == 1));
    // The frame's prefix and header sit right before its payload in the same buffer.
    let base = first.payload.as_ptr() as usize - (PREFIX_LEN + 3);
    drop(first);
    let second = rx.recv().await.unwrap().unwrap();
    assert_eq!(second.header.as_slice(), [1u8; 3]);
    assert_eq!(second.payload.len(), 290_000);
    assert!(second.payload.iter().all(|&b| b == 2));
    assert_eq!(
        second.payload.as_ptr() as usize - (PREFIX_LEN + 3),
        base,
        "a dropped large payload's buffer is reused for the next one that fits"
    );
    // Held payloads are never reused: the third frame gets memory of its own.
    let third = rx.recv().await.unwrap().unwrap();
    assert_eq!(third.header.as_slice(), [2u8; 3]);
    assert!(third.payload.iter().all(|&b| b == 3));
    assert!(
        second.payload.iter().all(|&b| b == 2),
        "untouched while held"
    );
    assert_ne!(third.payload.as_ptr(), second.payload.as_ptr());
    let small = rx.recv().await.unwrap().unwrap();
    assert_eq!(small.payload.len(), 5_000);
    assert!(small.payload.iter().all(|&b| b == 4));
    // What was read ahead into the read buffer had to be moved: counted, bounded by it.
    let copied = m.payload_bytes_copied.get();
    assert!(copied <= 3 * 16384, "copied {copied}");
    drop(writer.await.unwrap());
    assert!(rx.recv().await.unwrap().is_none());
}

#[tokio::test]
async fn large_frame_recv_is_cancel_safe_and_truncation_is_reported() {
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let cfg = StreamConfig {
        max_message_size: 1 << 20,
        read_buffer_size: 4096,
        ..StreamConfig::default()
    };
    let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &cfg);
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let mut wire = encode_prefix(2, payload.len()).to_vec();
    wire.extend_from_slice(b"hh");
    wire.extend_from_slice(&payload);
    // Half the frame, then the recv future is dropped.
    raw.write_all(&wire[..50_000]).await.unwrap();
    let r = tokio::time::timeout(std::time::Duration::from_millis(50), rx.recv()).await;
    assert!(r.is_err(), "no whole message yet");
    raw.write_all(&wire[50_000..]).await.unwrap();
    let m = rx.recv().await.unwrap().unwrap();
    assert_eq!(m.header.as_slice(), b"hh");
    assert_eq!(&m.payload[..], &payload[..]);
    // A second large frame cut short by the peer's death.
    raw.write_all(&wire[..30_000]).await.unwrap();
    drop(raw);
    match rx.recv().await {
        Err(TransportError::Truncated { received, expected }) => {
            assert_eq!(received, 30_000);
            assert_eq!(expected, wire.len() as u64);
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    assert!(matches!(
        first_failure(rx.recv().await),
        TransportError::Truncated {
            received: 30_000,
            ..
        }
    ));
}

/// The error a receiver reports after it failed: `Failed`, fatal, with the first error
/// (typed) as its source; returns that first error.
fn first_failure(r: Result<Option<Message>, TransportError>) -> TransportError {
    use std::error::Error;
    let e = r.expect_err("the receiver stays failed");
    assert!(e.is_fatal());
    let TransportError::Failed(first) = &e else {
        panic!("expected Failed, got {e:?}");
    };
    let source = e.source().expect("the first error is the source");
    let typed = source
        .downcast_ref::<TransportError>()
        .expect("the source is a TransportError");
    assert!(std::ptr::eq(typed, &**first));
    assert!(std::ptr::eq(e.original(), typed));
    typed.duplicate()
}

#[tokio::test]
async fn cancelled_send_is_finished_by_the_next_operation() {
    let (a, b) = tokio::io::duplex(1024);
    let cfg = StreamConfig::default();
    let m = Arc::new(Metrics::default());
    let mut tx = StreamSender::new(a, m.clone(), &cfg);
    let mut rx = StreamReceiver::new(b, m, &cfg);
    let big = Bytes::from(vec![5u8; 100_000]);
    // Only 1 KiB fits in the pipe: the send stalls part-way and is dropped.
    let r = tokio::time::timeout(
        std::time::Duration::from_millis(20),
        tx.send(Message::new(HeaderBytes::from(*b"big"), big.clone())),
    )
    .await;
    assert!(r.is_err(), "the send must have stalled");
    let reader = tokio::spawn(async move {
        let first = rx.recv().await.unwrap().unwrap();
        let second = rx.recv().await.unwrap().unwrap();
        (first, second)
    });
    tx.send(Message::new(
        HeaderBytes::from(*b"next"),
        Bytes::from_static(b"x"),
    ))
    .await
    .unwrap();
    let (first, second) = reader.await.unwrap();
    assert_eq!(first.header.as_slice(), b"big");
    assert_eq!(first.payload, big);
    assert_eq!(second.header.as_slice(), b"next");
}

#[tokio::test]
async fn oversize_send_writes_nothing() {
    let (mut tx, _rx, _) = pair(10);
    let e = tx
        .send(Message::new(HeaderBytes::EMPTY, Bytes::from(vec![0; 11])))
        .await
        .unwrap_err();
    assert!(matches!(
        e,
        TransportError::MessageTooLarge {
            len: 11,
            max: 10,
            ..
        }
    ));
    assert_eq!(tx.metrics().bytes_sent.get(), 0);
}

/// A batch refuses a message over the limit before writing anything, and leaves it (and
/// the rest) in the batch: one message alone, or among others.
#[tokio::test]
async fn oversize_batch_writes_nothing_and_keeps_its_messages() {
    for others in [0, 2] {
        let (mut tx, _rx, _) = pair(10);
        let mut batch = vec![Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"ok")); others];
        batch.push(Message::new(HeaderBytes::EMPTY, Bytes::from(vec![0; 11])));
        let e = tx.send_batch(&mut batch).await.unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::MessageTooLarge {
                    len: 11,
                    max: 10,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(batch.len(), others + 1, "the batch keeps its messages");
        assert_eq!(tx.metrics().bytes_sent.get(), 0);
    }
}

#[tokio::test]
async fn huge_length_is_rejected_before_allocating_and_stream_recovers() {
    let (a, b) = tokio::io::duplex(1 << 16);
    let cfg = StreamConfig {
        max_message_size: 1024,
        read_buffer_size: 4096,
        ..StreamConfig::default()
    };
    let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &cfg);
    let mut raw = a;
    // A frame claiming 4 GiB, of which only 10 bytes are ever sent... then a valid frame
    // can not follow (the skip would swallow it), so the peer closes: expect Truncated.
    let mut wire = encode_prefix(3, u32::MAX as usize).to_vec();
    wire.extend_from_slice(b"abc");
    wire.extend_from_slice(&[0u8; 10]);
    raw.write_all(&wire).await.unwrap();
    let e = rx.recv().await.unwrap_err();
    assert!(
        matches!(e, TransportError::MessageTooLarge { ref header, .. } if header.as_slice() == b"abc")
    );
    assert!(!e.is_fatal());
    assert!(
        rx.buffer_capacity() <= 8192,
        "no allocation for the claimed length"
    );
    drop(raw);
    assert!(matches!(
        rx.recv().await,
        Err(TransportError::Truncated { .. })
    ));
}

#[tokio::test]
async fn peer_dies_mid_message() {
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let cfg = StreamConfig::default();
    let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &cfg);
    let mut wire = encode_prefix(0, 1000).to_vec();
    wire.extend_from_slice(&[1u8; 400]);
    raw.write_all(&wire).await.unwrap();
    drop(raw);
    match rx.recv().await {
        Err(TransportError::Truncated { received, expected }) => {
            assert_eq!(received, 408);
            assert_eq!(expected, 1008);
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    for _ in 0..2 {
        assert!(matches!(
            first_failure(rx.recv().await),
            TransportError::Truncated {
                received: 408,
                expected: 1008
            }
        ));
    }
}

/// After a clean end the receiver answers `Failed(Closed)`; after a malformed frame,
/// `Failed(Malformed)`: the first error's type, not a string.
#[tokio::test]
async fn after_the_end_or_a_fatal_error_the_first_error_is_kept_typed() {
    let (raw, b) = tokio::io::duplex(1 << 16);
    let mut rx = StreamReceiver::new(b, Arc::default(), &StreamConfig::default());
    drop(raw);
    assert!(rx.recv().await.unwrap().is_none(), "clean end");
    let again = rx.recv().await;
    assert!(matches!(first_failure(again), TransportError::Closed));

    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let mut rx = StreamReceiver::new(b, Arc::default(), &StreamConfig::default());
    raw.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let first = rx.recv().await.unwrap_err();
    assert!(matches!(first, TransportError::Malformed(m) if m.contains("magic")));
    // More (valid) bytes do not revive it.
    raw.write_all(&encode_prefix(0, 0)).await.unwrap();
    assert!(matches!(
        first_failure(rx.recv().await),
        TransportError::Malformed(m) if m.contains("magic")
    ));
    let shown = rx.recv().await.unwrap_err().to_string();
    assert!(
        shown.starts_with("the connection failed earlier: malformed frame: bad magic"),
        "{shown}"
    );
}

#[tokio::test]
async fn garbage_is_malformed() {
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &StreamConfig::default());
    raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(matches!(rx.recv().await, Err(TransportError::Malformed(_))));
}

/// A receiver with its own budget, read side fed by hand.
fn budgeted(
    budget: usize,
) -> (
    tokio::io::DuplexStream,
    StreamReceiver<tokio::io::DuplexStream>,
) {
    let (raw, b) = tokio::io::duplex(8 << 20);
    let cfg = StreamConfig {
        max_message_size: 64 << 20,
        read_buffer_size: 4096,
        memory_budget: MemoryBudget::new(budget),
        frame_timeout: Some(Duration::from_secs(30)),
    };
    (raw, StreamReceiver::new(b, Arc::default(), &cfg))
}

/// Announcing a 60 MiB frame to a receiver whose budget is short (64 MiB: the frame is
/// more than half of it) costs one first chunk, not 60 MiB: what it holds grows with what
/// arrives, charged to the budget.
#[tokio::test(start_paused = true)]
async fn an_announced_length_alone_allocates_one_first_chunk() {
    let (mut raw, mut rx) = budgeted(64 << 20);
    let budget = rx.large_pool.budget.clone();
    let len = 60 << 20;
    let mut head = encode_prefix(2, len).to_vec();
    head.extend_from_slice(b"hh");
    raw.write_all(&head).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
    assert!(r.is_err(), "nothing to deliver yet");
    assert_eq!(budget.used(), LARGE_FIRST_CHUNK, "one first chunk, charged");
    // 3 MiB arrive: the buffer doubles to 4 MiB, not to 60.
    raw.write_all(&vec![1u8; 3 << 20]).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
    assert!(r.is_err(), "still incomplete");
    assert_eq!(budget.used(), 4 << 20, "grown with the bytes that arrived");
    drop(raw);
    assert!(matches!(
        rx.recv().await,
        Err(TransportError::Truncated { .. })
    ));
    drop(rx);
    assert_eq!(budget.used(), 0, "everything given back");
}

/// Many connections announcing large frames together hold at most the budget: the others
/// wait for budget, and a frame that gets neither bytes nor budget for `frame_timeout`
/// fails with `Stalled`.
#[tokio::test(start_paused = true)]
async fn announcements_on_many_connections_stay_within_the_budget_then_stall() {
    // 20 first chunks of 64 KiB would be 1.25 MiB: 8 fit, 12 wait.
    let budget = MemoryBudget::new(512 << 10);
    let mut peers = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (raw, b) = tokio::io::duplex(1 << 16);
        let cfg = StreamConfig {
            max_message_size: 64 << 20,
            read_buffer_size: 4096,
            memory_budget: budget.clone(),
            frame_timeout: Some(Duration::from_secs(30)),
        };
        let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
        let mut raw = raw;
        raw.write_all(&encode_prefix(0, 60 << 20)).await.unwrap();
        raw.write_all(&[7u8; 100]).await.unwrap();
        peers.push(raw);
        tasks.push(tokio::spawn(async move { rx.recv().await.map(|_| ()) }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        budget.used(),
        512 << 10,
        "the budget is spent, not exceeded"
    );
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(40), t).await {
            Ok(Ok(Err(TransportError::Stalled { expected, .. }))) => {
                assert_eq!(expected, (60 << 20) + PREFIX_LEN as u64)
            }
            other => panic!("expected Stalled, got {other:?}"),
        }
    }
    assert_eq!(budget.used(), 0);
    drop(peers);
}

/// A frame too large to accept is refused and its payload skipped; if the peer stops
/// half-way through that payload, the skip times out like any started frame.
#[tokio::test(start_paused = true)]
async fn a_stalled_skip_of_an_oversized_frame_times_out() {
    let (mut raw, b) = tokio::io::duplex(1 << 20);
    let cfg = StreamConfig {
        max_message_size: 1 << 20,
        read_buffer_size: 4096,
        ..StreamConfig::default()
    };
    let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
    let mut wire = encode_prefix(1, 4 << 20).to_vec();
    wire.extend_from_slice(&[0u8; 1001]);
    raw.write_all(&wire).await.unwrap();
    assert!(matches!(
        rx.recv().await,
        Err(TransportError::MessageTooLarge { .. })
    ));
    let start = tokio::time::Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(120), rx.recv()).await;
    // It reports how far into the rejected frame it got: prefix, header, 1000 bytes.
    let frame_len = (PREFIX_LEN + 1 + (4 << 20)) as u64;
    assert!(
        matches!(r, Ok(Err(TransportError::Stalled { received: 1009, expected, .. })) if expected == frame_len),
        "expected Stalled, got {r:?}"
    );
    assert!(start.elapsed() <= DEFAULT_FRAME_TIMEOUT + Duration::from_secs(1));
}

/// Peers that announce large frames and then trickle hold a first chunk each, not the
/// budget: an honest large frame on another connection still gets through.
#[tokio::test]
async fn bare_announcements_leave_budget_for_an_honest_frame() {
    let budget = MemoryBudget::new(4 << 20);
    let cfg = StreamConfig {
        max_message_size: 64 << 20,
        read_buffer_size: 4096,
        memory_budget: budget.clone(),
        frame_timeout: Some(Duration::from_secs(30)),
    };
    let mut hostile = Vec::new();
    for _ in 0..16 {
        let (mut raw, b) = tokio::io::duplex(1 << 16);
        let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
        raw.write_all(&encode_prefix(0, 60 << 20)).await.unwrap();
        raw.write_all(&[1u8]).await.unwrap();
        let pending = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await;
        assert!(pending.is_err());
        hostile.push((raw, rx));
    }
    assert_eq!(budget.used(), 16 * LARGE_FIRST_CHUNK, "a first chunk each");
    let (mut raw, b) = tokio::io::duplex(4 << 20);
    let mut rx = StreamReceiver::new(b, Arc::default(), &cfg);
    let mut wire = encode_prefix(0, 2 << 20).to_vec();
    wire.extend(std::iter::repeat_n(5u8, 2 << 20));
    raw.write_all(&wire).await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the honest frame is not starved")
        .unwrap()
        .unwrap();
    assert!(m.payload.len() == 2 << 20 && m.payload.iter().all(|&x| x == 5));
    drop(hostile);
}

/// A small frame that stops half-way fails after `frame_timeout`; an idle connection
/// (nothing started) does not.
#[tokio::test(start_paused = true)]
async fn a_stalled_small_frame_times_out_but_idle_does_not() {
    let (mut raw, mut rx) = budgeted(1 << 20);
    let idle = tokio::time::timeout(Duration::from_secs(600), rx.recv()).await;
    assert!(idle.is_err(), "no limit between messages");
    let mut wire = encode_prefix(0, 100).to_vec();
    wire.extend_from_slice(&[1u8; 10]);
    raw.write_all(&wire).await.unwrap();
    let start = tokio::time::Instant::now();
    match rx.recv().await {
        Err(TransportError::Stalled {
            received,
            expected,
            after,
        }) => {
            assert_eq!((received, expected), (18, 108));
            assert_eq!(after, Duration::from_secs(30));
        }
        other => panic!("expected Stalled, got {other:?}"),
    }
    assert!(start.elapsed() >= Duration::from_secs(30));
    assert!(start.elapsed() < Duration::from_secs(31));
    assert!(matches!(
        first_failure(rx.recv().await),
        TransportError::Stalled {
            received: 18,
            expected: 108,
            ..
        }
    ));
}

/// A frame that keeps arriving slowly is not cut: the limit counts from the last byte.
#[tokio::test(start_paused = true)]
async fn a_slow_frame_that_progresses_is_not_cut() {
    let (mut raw, mut rx) = budgeted(64 << 20);
    let payload = vec![3u8; 200_000];
    let mut wire = encode_prefix(0, payload.len()).to_vec();
    wire.extend_from_slice(&payload);
    let writer = tokio::spawn(async move {
        for chunk in wire.chunks(20_000) {
            tokio::time::sleep(Duration::from_secs(20)).await;
            raw.write_all(chunk).await.unwrap();
        }
        raw
    });
    let m = rx
        .recv()
        .await
        .expect("20 s gaps are within the 30 s limit")
        .unwrap();
    assert_eq!(m.payload.len(), payload.len());
    let _raw = writer.await.unwrap();
}

/// A received large payload stays charged while the application holds it; a receiver
/// that needs more waits until it is dropped.
#[tokio::test]
async fn held_payloads_count_and_their_return_unblocks_a_waiting_receiver() {
    let budget = MemoryBudget::new(2 << 20);
    let cfg = StreamConfig {
        max_message_size: 64 << 20,
        read_buffer_size: 4096,
        memory_budget: budget.clone(),
        frame_timeout: Some(Duration::from_secs(30)),
    };
    let frame = |fill: u8| {
        let mut w = encode_prefix(0, 1_500_000).to_vec();
        w.extend(std::iter::repeat_n(fill, 1_500_000));
        w
    };
    let (mut raw_a, a) = tokio::io::duplex(4 << 20);
    let (mut raw_b, b) = tokio::io::duplex(4 << 20);
    let mut rx_a = StreamReceiver::new(a, Arc::default(), &cfg);
    let mut rx_b = StreamReceiver::new(b, Arc::default(), &cfg);
    raw_a.write_all(&frame(1)).await.unwrap();
    raw_b.write_all(&frame(2)).await.unwrap();
    let held = rx_a.recv().await.unwrap().unwrap();
    assert!(budget.used() >= 1_500_000, "the held payload is charged");
    let waiting = tokio::spawn(async move { rx_b.recv().await });
    let early = tokio::time::timeout(Duration::from_millis(100), async {
        while !waiting.is_finished() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        early.is_err(),
        "b waits for budget while a's payload is held"
    );
    assert!(held.payload.iter().all(|&x| x == 1));
    drop(held);
    let m = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("b proceeds once the payload is dropped")
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(m.payload.len() == 1_500_000 && m.payload.iter().all(|&x| x == 2));
}

#[tokio::test]
async fn recv_is_cancel_safe() {
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let mut rx = StreamReceiver::new(b, Arc::new(Metrics::default()), &StreamConfig::default());
    let mut wire = encode_prefix(1, 5).to_vec();
    wire.extend_from_slice(b"h12345");
    raw.write_all(&wire[..6]).await.unwrap();
    // The partial frame is read, then the recv future is dropped.
    let r = tokio::time::timeout(std::time::Duration::from_millis(50), rx.recv()).await;
    assert!(r.is_err(), "no whole message yet");
    raw.write_all(&wire[6..]).await.unwrap();
    let m = rx.recv().await.unwrap().unwrap();
    assert_eq!(m.header.as_slice(), b"h");
    assert_eq!(&m.payload[..], b"12345");
}
