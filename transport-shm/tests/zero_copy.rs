//! Payloads written in the sender's send buffers (`MessageSender::buffer_pool`, free slots of
//! its pool) cross without a copy: no byte copied on either side, the bytes the receiver
//! holds never change under it, the same buffer may be sent many times, and buffers the
//! application keeps cannot stop its other sends.

mod common;

use bytes::{BufMut, Bytes};
use futures_util::FutureExt;
use transport_core::{
    BufferPool, Connection, HeaderBytes, Message, MessageReceiver, MessageSender,
};

use common::{bounded, header, pair, pattern, sleepy};

const MAX: usize = 64 << 10;

/// A frozen send buffer of the pool holding `bytes`, which must be pool memory.
fn pooled(pool: &dyn BufferPool, bytes: &[u8]) -> Bytes {
    let mut buf = pool.alloc(bytes.len());
    assert!(buf.is_backend_memory(), "a slot of the pool");
    buf.put_slice(bytes);
    buf.freeze()
}

fn msg(payload: Bytes) -> Message {
    Message::new(HeaderBytes::EMPTY, payload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_payload_sent_more_times_than_slots_arrives_every_time_without_a_copy() {
    let (c, s, _dir) = pair(sleepy(MAX), sleepy(MAX)).await;
    assert!(c.capabilities().zero_copy_send);
    let slots = sleepy(MAX).pool_slots as usize;
    let (metrics, server_metrics) = (c.metrics(), s.metrics());
    let (mut tx, _crx) = c.split();
    let (_stx, mut rx) = s.split();
    let pool = tx.buffer_pool();
    let want = pattern(40_000, 3);
    let payload = pooled(&*pool, &want);
    let sends = 3 * slots;
    let receiver = tokio::spawn(async move {
        for i in 0..sends {
            let m = rx.recv().await.expect("recv").expect("a message");
            // Every other send is a slice of the buffer: it travels at its offset in the slot.
            let expect = if i % 2 == 0 {
                &want[..]
            } else {
                &want[100..30_100]
            };
            assert_eq!(&m.payload[..], expect, "message {i}");
            assert_eq!(m.header, header(&[i as u8]));
        }
        rx
    });
    for i in 0..sends {
        let p = if i % 2 == 0 {
            payload.clone()
        } else {
            payload.slice(100..30_100)
        };
        let m = Message::new(header(&[i as u8]), p);
        bounded("send", tx.send(m)).await.expect("send");
    }
    let _rx = bounded("receive all", receiver).await.unwrap();
    let copied =
        metrics.snapshot().payload_bytes_copied + server_metrics.snapshot().payload_bytes_copied;
    assert_eq!(copied, 0, "no payload byte copied on either side");
    assert!(metrics.snapshot().bytes_sent >= (sends * 30_000) as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_the_receiver_holds_never_change_while_the_sender_reuses_its_buffers() {
    let (c, s, _dir) = pair(sleepy(MAX), sleepy(MAX)).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut rx) = s.split();
    let pool = tx.buffer_pool();
    let first = pattern(20_000, 1);
    bounded("send", tx.send(msg(pooled(&*pool, &first))))
        .await
        .unwrap();
    let held = bounded("recv", rx.recv()).await.unwrap().unwrap();
    // The sender drops its buffer at once and writes many new ones: none may be the slot
    // the receiver still reads.
    for seed in 2..40u8 {
        let next = pattern(20_000, seed);
        bounded("send", tx.send(msg(pooled(&*pool, &next))))
            .await
            .unwrap();
        let got = bounded("recv", rx.recv()).await.unwrap().unwrap();
        assert_eq!(&got.payload[..], &next[..]);
    }
    assert_eq!(
        &held.payload[..],
        &first[..],
        "the held payload is as it was sent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffers_the_application_keeps_cannot_stop_its_other_sends() {
    let (c, s, _dir) = pair(sleepy(MAX), sleepy(MAX)).await;
    let slots = sleepy(MAX).pool_slots as usize;
    let (mut tx, _crx) = c.split();
    let (_stx, mut rx) = s.split();
    let pool = tx.buffer_pool();
    let kept: Vec<_> = std::iter::repeat_with(|| pool.alloc(MAX / 2))
        .take(slots)
        .collect();
    let lent = kept.iter().filter(|b| b.is_backend_memory()).count();
    assert_eq!(lent, slots - slots / 4, "all slots but a reserve are lent");
    // Buffers shorter than the inline limit or longer than a slot are heap memory.
    assert!(!pool.alloc(16).is_backend_memory());
    assert!(!pool.alloc(MAX + 1).is_backend_memory());
    // Heap payloads still go, by copy through the reserved slots, many more than there are.
    for seed in 0..(4 * slots) as u8 {
        let p = pattern(MAX / 2, seed);
        bounded("send", tx.send(msg(p.clone()))).await.unwrap();
        let got = bounded("recv", rx.recv()).await.unwrap().unwrap();
        assert_eq!(got.payload, p);
    }
    drop(kept);
    assert!(
        pool.alloc(MAX / 2).is_backend_memory(),
        "slots are free again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_waits_while_the_receiver_holds_a_pools_worth_and_goes_when_it_drops_one() {
    let (c, s, _dir) = pair(sleepy(MAX), sleepy(MAX)).await;
    let slots = sleepy(MAX).pool_slots as usize;
    let (mut tx, _crx) = c.split();
    let (_stx, mut rx) = s.split();
    let pool = tx.buffer_pool();
    let payload = pooled(&*pool, &pattern(10_000, 9));
    let mut held = Vec::new();
    for _ in 0..slots {
        bounded("send", tx.send(msg(payload.clone())))
            .await
            .unwrap();
        held.push(bounded("recv", rx.recv()).await.unwrap().unwrap());
    }
    // Every send is outstanding: one more cannot go until the receiver gives one back. The
    // spin budget is zero, so the first poll already sleeps on the doorbell.
    assert!(
        tx.send(msg(payload.clone())).now_or_never().is_none(),
        "a send past the pool's worth waits"
    );
    // Dropping a payload sends its slot back at once, though the receiving half is not
    // running (no recv is in progress): the waiting send goes on.
    drop(held.pop());
    bounded("send after a return", tx.send(msg(payload.clone())))
        .await
        .unwrap();
    let got = bounded("recv", rx.recv()).await.unwrap().unwrap();
    assert_eq!(got.payload, payload);
}
