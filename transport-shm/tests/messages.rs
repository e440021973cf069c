//! Messages over shared-memory connections through transport-core's traits: sizes inline and
//! in slots, sleeping and waking, slots lent and returned, close, a peer that goes, a message
//! above the receiver's limit (a raw peer that writes what it likes: tests/hostile.rs).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{bounded, header, pair, pattern, sleepy};
use futures_util::FutureExt;
use transport_core::{
    Connection, HeaderBytes, Message, MessageReceiver, MessageSender, TransportError,
};
use transport_shm::conn::ShmConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_size_cross_inline_and_in_slots_bit_for_bit() {
    let (c, s, _dir) = pair(sleepy(64 << 10), sleepy(64 << 10)).await;
    let inline = c.capabilities().inline_size;
    let (mut tx, mut rx) = c.split();
    let (mut stx, mut srx) = s.split();
    // The server echoes every message back.
    let echo = tokio::spawn(async move {
        while let Some(m) = srx.recv().await.expect("server recv") {
            stx.send(m).await.expect("echo");
        }
        stx
    });
    let sizes = [
        0,
        1,
        47,
        48,
        inline - 1,
        inline,
        inline + 1,
        4096,
        (64 << 10) - 64,
    ];
    for round in 0..3u8 {
        for (i, &n) in sizes.iter().enumerate() {
            let h = header(&[round, i as u8, 0xee]);
            let p = pattern(n, round ^ i as u8);
            bounded("send", tx.send(Message::new(h, p.clone())))
                .await
                .unwrap();
            let back = bounded("recv", rx.recv()).await.unwrap().expect("the echo");
            assert_eq!(back.header.as_slice(), h.as_slice(), "size {n}");
            assert_eq!(back.payload, p, "size {n}");
        }
    }
    tx.close().await.unwrap();
    let stx = bounded("the echo server's end", echo).await.unwrap();
    let m = stx.metrics();
    assert_eq!(m.messages_sent.get(), 3 * sizes.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_sleeps_is_woken_for_every_message_in_order() {
    let (c, s, _dir) = pair(sleepy(1 << 10), sleepy(1 << 10)).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut srx) = s.split();
    const N: u32 = 20_000;
    let sender = tokio::spawn(async move {
        for i in 0..N {
            // Bursts and pauses, so that the receiver both finds entries and sleeps.
            if i % 64 == 0 {
                tokio::task::yield_now().await;
            }
            let p = Bytes::copy_from_slice(&i.to_le_bytes());
            tx.send(Message::new(HeaderBytes::EMPTY, p))
                .await
                .expect("send");
        }
        tx
    });
    for i in 0..N {
        let m = bounded("recv", srx.recv())
            .await
            .unwrap()
            .expect("a message");
        assert_eq!(&m.payload[..], &i.to_le_bytes(), "message {i}");
    }
    let tx = bounded("sender", sender).await.unwrap();
    // Doorbells are rung only for sleeps: far fewer than messages unless every one slept.
    assert!(tx.metrics().doorbells.get() <= u64::from(N));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_in_slots_are_not_copied_on_receive_and_their_slots_come_back() {
    let config = || ShmConfig {
        pool_slots: 2,
        ..sleepy(8 << 10)
    };
    let (c, s, _dir) = pair(config(), config()).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut srx) = s.split();
    let big = pattern(8 << 10, 7);
    // Two slots: two payloads held by the receiver take them both.
    for _ in 0..2 {
        tx.send(Message::new(HeaderBytes::EMPTY, big.clone()))
            .await
            .unwrap();
    }
    let held: Vec<Message> = vec![
        srx.recv().await.unwrap().unwrap(),
        srx.recv().await.unwrap().unwrap(),
    ];
    assert_eq!(
        srx.metrics().payload_bytes_copied.get(),
        0,
        "slot payloads are lent"
    );
    // A third waits for a slot while both are held...
    let third = tokio::spawn(async move {
        tx.send(Message::new(HeaderBytes::EMPTY, big.clone()))
            .await
            .unwrap();
        tx
    });
    let mut third = std::pin::pin!(third);
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut third)
            .await
            .is_err(),
        "a send found a slot while the receiver held both"
    );
    // ... and goes once the receiver drops one and receives again (which returns it).
    drop(held);
    let recv = tokio::spawn(async move {
        let m = srx.recv().await.unwrap().unwrap();
        (m, srx)
    });
    let _tx = bounded("the third send", third).await.unwrap();
    let (m, _srx) = bounded("the third message", recv).await.unwrap();
    assert_eq!(m.payload.len(), 8 << 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_large_messages_pass_through_a_small_pool() {
    let config = || ShmConfig {
        pool_slots: 2,
        ring_entries: 4,
        ..sleepy(64 << 10)
    };
    let (c, s, _dir) = pair(config(), config()).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut srx) = s.split();
    const N: usize = 500;
    let sender = tokio::spawn(async move {
        for i in 0..N {
            let p = pattern(60 << 10, i as u8);
            tx.send(Message::new(HeaderBytes::EMPTY, p))
                .await
                .expect("send");
        }
        tx.close().await.unwrap();
    });
    for i in 0..N {
        let m = bounded("recv", srx.recv())
            .await
            .unwrap()
            .expect("a message");
        assert_eq!(m.payload, pattern(60 << 10, i as u8), "message {i}");
    }
    assert!(bounded("the end", srx.recv()).await.unwrap().is_none());
    bounded("sender", sender).await.unwrap();
}

#[tokio::test]
async fn a_dropped_payload_goes_back_though_the_receiving_half_is_not_running() {
    // The shape of a deadlock: a side that holds what it received and then only sends waits
    // for slots of its own that the peer cannot return while the peer waits, in turn, for
    // the slots this side holds. A slot must go back when its payload drops, not at this
    // side's next recv.
    let config = sleepy(64 << 10);
    let slots = config.pool_slots as usize;
    let (c, s, _dir) = pair(config.clone(), config).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut srx) = s.split();
    let big = |i: usize| Message::new(HeaderBytes::EMPTY, pattern(10_000, i as u8));
    let mut held = Vec::new();
    for i in 0..slots {
        bounded("send", tx.send(big(i))).await.unwrap();
        held.push(bounded("recv", srx.recv()).await.unwrap().unwrap());
    }
    // Every slot of the sender's pool is held: the next send waits (no spin budget, so its
    // first poll sleeps).
    assert!(tx.send(big(slots)).now_or_never().is_none());
    drop(held.remove(3));
    bounded("send after a drop alone", tx.send(big(slots)))
        .await
        .unwrap();
    let m = bounded("recv", srx.recv()).await.unwrap().unwrap();
    assert_eq!(m.payload, pattern(10_000, slots as u8));
    assert_eq!(
        held[3].payload,
        pattern(10_000, 4),
        "the others are untouched"
    );
}

#[tokio::test]
async fn close_is_a_clean_end_and_sending_after_it_fails() {
    let (c, s, _dir) = pair(ShmConfig::default(), ShmConfig::default()).await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut srx) = s.split();
    tx.send(Message::new(header(b"last"), Bytes::new()))
        .await
        .unwrap();
    tx.close().await.unwrap();
    let e = tx
        .send(Message::new(header(b"late"), Bytes::new()))
        .await
        .unwrap_err();
    assert!(matches!(e, TransportError::Closed), "{e}");
    let m = bounded("recv", srx.recv()).await.unwrap().unwrap();
    assert_eq!(m.header.as_slice(), b"last");
    assert!(bounded("the end", srx.recv()).await.unwrap().is_none());
    assert!(srx.recv().await.unwrap().is_none(), "the end stays");
}

#[tokio::test]
async fn a_dropped_connection_ends_cleanly() {
    // Dropped: the sender closes on its way out (one gone without a close: tests/hostile.rs).
    let (c, s, _dir) = pair(ShmConfig::default(), ShmConfig::default()).await;
    let (_stx, mut srx) = s.split();
    drop(c);
    assert!(bounded("the end", srx.recv()).await.unwrap().is_none());
}

#[tokio::test]
async fn a_message_above_the_receivers_limit_is_skipped_and_the_next_arrives() {
    let (c, s, _dir) = pair(
        ShmConfig::with_max_message_size(64 << 10),
        ShmConfig::with_max_message_size(4 << 10),
    )
    .await;
    let (mut tx, _crx) = c.split();
    let (_stx, mut srx) = s.split();
    // More than the pool's slots, so a skipped message's slot must come back.
    for _ in 0..10 {
        tx.send(Message::new(header(b"big"), pattern(32 << 10, 1)))
            .await
            .unwrap();
        let e = bounded("recv", srx.recv()).await.unwrap_err();
        match e {
            TransportError::MessageTooLarge { len, max, header } => {
                assert_eq!((len, max), (3 + (32 << 10), 4 << 10));
                assert_eq!(header.as_slice(), b"big");
            }
            other => panic!("{other}"),
        }
    }
    tx.send(Message::new(header(b"small"), pattern(100, 2)))
        .await
        .unwrap();
    let m = bounded("recv", srx.recv()).await.unwrap().unwrap();
    assert_eq!(m.payload, pattern(100, 2));
}
