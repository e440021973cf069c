//! A receiver that does not read: the sender runs out of credits and waits (the receiving side
//! holds its buffers back instead of queueing without bound); once the application reads,
//! everything arrives, in order.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_verbs::{VerbsConfig, VerbsTransport};

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_slow_reader_stalls_the_sender_then_gets_everything_in_order() {
    let addr = common::listen_addr();
    common::run(async move {
        let mut cfg = VerbsConfig::default();
        cfg.recv_depth = 8;
        let verbs = VerbsTransport::new(cfg).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let conn = verbs.connect(&addr).await.expect("connect");
        let server = listener.accept().await.expect("accept");
        let client_metrics = conn.metrics();
        let (mut tx, _rx) = conn.split();
        let (_stx, mut srx) = server.split();
        // recv_depth 8: at most 4 x 8 deliveries wait for the application, then credits stop.
        const N: u32 = 300;
        let mut sender = tokio::spawn(async move {
            let payload = Bytes::from(vec![3u8; 8192]);
            for i in 0..N {
                tx.send(Message::new(
                    HeaderBytes::from(i.to_le_bytes()),
                    payload.clone(),
                ))
                .await
                .expect("send");
            }
            tx
        });
        // Nobody reads: the sender must end up waiting for credits (liveness check only).
        let start = Instant::now();
        while client_metrics.snapshot().credit_stalls == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the sender never ran out of credits: {:?}",
                client_metrics.snapshot()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Without reads the sender can never finish: at most 4 x 8 deliveries wait for the
        // application, 8 more in receive buffers, and the sender's queues hold ~130.
        assert!(
            tokio::time::timeout(Duration::from_secs(3), &mut sender)
                .await
                .is_err(),
            "the sender got all {N} messages out although nothing was read"
        );
        assert!(client_metrics.snapshot().messages_sent < N as u64);
        for i in 0..N {
            let m = srx.recv().await.expect("recv").expect("open");
            assert_eq!(m.header.as_slice(), i.to_le_bytes(), "order");
            assert_eq!(m.payload.len(), 8192);
        }
        let _tx = sender.await.expect("sender");
        println!(
            "backpressure: sender stalled on credits, then {N} messages arrived in order ({:?})",
            client_metrics.snapshot()
        );
    });
}
