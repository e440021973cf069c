//! Failure handling: a QP forced into the error state fails pending and later operations
//! promptly with a typed error; no hang.

mod common;

use std::future::Future;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_verbs::{VerbsConfig, VerbsError, VerbsTransport, WcStatus};

#[test]
fn qp_forced_to_error_fails_pending_calls_with_a_typed_error() {
    let Some(addr) = common::listen_addr_or_skip("qp_error") else {
        return;
    };
    common::run(async move {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let conn = verbs.connect(&addr).await.expect("connect");
        let server = listener.accept().await.expect("accept");
        let (mut tx, mut rx) = conn.split();
        let (mut stx, mut srx) = server.split();

        // The connection works.
        tx.send(Message::new(
            HeaderBytes::from([1u8]),
            Bytes::from_static(b"hi"),
        ))
        .await
        .expect("send");
        let m = srx.recv().await.expect("recv").expect("open");
        assert_eq!(&m.payload[..], b"hi");

        // A receive is pending on the client when its QP breaks: polled once (nothing was sent
        // to the client, so it waits), then the QP is broken, then the same receive is awaited.
        let mut pending = std::pin::pin!(rx.recv());
        let first = std::future::poll_fn(|cx| Poll::Ready(pending.as_mut().poll(cx))).await;
        assert!(
            first.is_pending(),
            "nothing was sent to the client: {first:?}"
        );
        let start = Instant::now();
        tx.inject_qp_error().await;
        let r = tokio::time::timeout(Duration::from_secs(5), pending)
            .await
            .expect("the pending receive failed promptly, no hang");
        let e = r.expect_err("the pending receive failed");
        match e.backend_error::<VerbsError>() {
            Some(VerbsError::WorkCompletion { status, .. }) => {
                assert_eq!(*status, WcStatus::Flushed, "{e}");
                println!(
                    "qp_error: pending receive failed after {:?}: {e}",
                    start.elapsed()
                );
            }
            _ => panic!("expected a typed work completion error, got {e:?}"),
        }
        // Later sends fail too, with the same cause.
        let e = tx
            .send(Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"x")))
            .await
            .expect_err("send after the QP error");
        assert!(e.is_fatal(), "{e:?}");
        // The peer learns that the connection is gone (disconnect), also without hanging.
        let r = tokio::time::timeout(Duration::from_secs(10), srx.recv())
            .await
            .expect("the peer saw the end promptly");
        assert!(!matches!(r, Ok(Some(_))), "{r:?}");
        let _ = stx.close().await;
    });
}
