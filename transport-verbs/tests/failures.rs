//! Failure handling: a QP forced into the error state fails pending and later operations
//! promptly with a typed error; no hang. Also while a large message is being read (rendezvous),
//! on either side: both ends fail, and every buffer comes back once they are dropped.

mod common;

use std::future::Future;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
    TransportError,
};
use transport_verbs::{VerbsConfig, VerbsError, VerbsTransport, WcStatus};

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn qp_forced_to_error_fails_pending_calls_with_a_typed_error() {
    let addr = common::listen_addr();
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

/// Payload of the large message: above the rendezvous threshold and within the default
/// `max_message_size` (64 MiB, header included).
const LARGE: usize = 48 << 20;

/// Whose queue pair a test breaks while the large message is being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broken {
    /// The receiving side's, whose RDMA READs are in flight.
    Reader,
    /// The sending side's, whose exposed payload the READs read.
    Sender,
}

/// `len` bytes of a pattern that repeats every 251 bytes (not a power of two: a chunk read
/// from the wrong offset does not match).
fn pattern(len: usize) -> Bytes {
    let period: Vec<u8> = (0..251u8).collect();
    let mut v = period.repeat(len.div_ceil(period.len()));
    v.truncate(len);
    Bytes::from(v)
}

/// Whether `e` is one of the transport's typed failures of a broken connection: a verbs error
/// (a work completion's, the device's), a message cut short, or the peer gone.
fn is_typed_failure(e: &TransportError) -> bool {
    match e {
        TransportError::Truncated { .. } => true,
        TransportError::Io(io) => io.kind() == std::io::ErrorKind::ConnectionReset,
        TransportError::Failed(inner) => is_typed_failure(inner),
        _ => e.backend_error::<VerbsError>().is_some(),
    }
}

/// Whether `e` is a work completion error of the side's own queue pair in the error state
/// (what the test hook's fault surfaces as).
fn is_own_flush(e: &TransportError) -> bool {
    matches!(
        e.backend_error::<VerbsError>(),
        Some(VerbsError::WorkCompletion {
            status: WcStatus::Flushed,
            ..
        })
    )
}

/// Waits (at most 30 s) until `verbs` has no connection and no pool buffer out but its
/// posted receive buffers.
async fn all_returned(verbs: &VerbsTransport, side: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = verbs.memory_use();
        if m.connections == 0 && m.lent_bytes == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{side}: connections or buffers left 30 s after both ends were dropped: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A large message is being read (rendezvous: the receiver's RDMA READs in flight) when one
/// side's queue pair is forced into the error state. Both sides fail promptly with typed
/// errors; the receive never returns a wrong message (it fails, `Truncated` or a work
/// completion error, or, if the READs all finished before the fault landed, returns the whole
/// message and the next receive fails); after both connections are dropped each transport has
/// no connection and every pool buffer back.
fn qp_broken_mid_rendezvous(broken: Broken) {
    let name = match broken {
        Broken::Reader => "qp_error_reader_mid_rendezvous",
        Broken::Sender => "qp_error_sender_mid_rendezvous",
    };
    let addr = common::listen_addr();
    common::run(async move {
        // Two transports, so that each side's memory is its own.
        let server = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let client = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        assert!(LARGE > client.config().eager_limit, "goes by rendezvous");
        assert!(LARGE < client.config().max_message_size, "fits");
        let mut listener = server.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let conn = client.connect(&addr).await.expect("connect");
        let accepted = listener.accept().await.expect("accept");
        let read = accepted.metrics().clone();
        let (mut tx, mut rx) = conn.split();
        let (mut stx, mut srx) = accepted.split();

        // Both receives are pending before the message goes: the server's (which reads it)
        // and the client's (which nothing answers), each polled once here, then driven by a
        // task of its own.
        let mut server_recv = Box::pin(async move {
            let first = srx.recv().await;
            let next = match &first {
                Ok(Some(_)) => Some(srx.recv().await.map(|m| m.map(|m| m.payload.len()))),
                _ => None,
            };
            (first, next, srx)
        });
        let mut client_recv = Box::pin(async move {
            let r = rx.recv().await;
            (r, rx)
        });
        let polled = std::future::poll_fn(|cx| {
            Poll::Ready((
                server_recv.as_mut().poll(cx).is_pending(),
                client_recv.as_mut().poll(cx).is_pending(),
            ))
        })
        .await;
        assert_eq!(polled, (true, true), "nothing was sent yet");
        let server_recv = tokio::spawn(server_recv);
        let client_recv = tokio::spawn(client_recv);

        let payload = pattern(LARGE);
        let before = read.snapshot().bytes_received;
        tokio::time::timeout(
            Duration::from_secs(10),
            tx.send(Message::new(HeaderBytes::from([3u8]), payload.clone())),
        )
        .await
        .expect("the send was queued promptly")
        .expect("send");

        // Break a queue pair once the transfer is under way: a few READ chunks arrived.
        let deadline = Instant::now() + Duration::from_secs(60);
        while read.snapshot().bytes_received < before + (2 << 20) {
            assert!(Instant::now() < deadline, "the transfer never started");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let at_break = read.snapshot().bytes_received - before;
        match broken {
            Broken::Reader => stx.inject_qp_error().await,
            Broken::Sender => tx.inject_qp_error().await,
        }
        let start = Instant::now();

        let (first, next, srx) = tokio::time::timeout(Duration::from_secs(10), server_recv)
            .await
            .expect("the server's receive ended within 10 s of the fault, no hang")
            .expect("task");
        let server_took = start.elapsed();
        let server_outcome = match (first, next) {
            // The fault landed while the payload was being read.
            (Err(TransportError::Truncated { received, expected }), None) => {
                assert_eq!(expected, LARGE as u64);
                assert!(received < expected, "{received} of {expected}");
                format!("Truncated ({received} of {expected} bytes)")
            }
            (Err(e), None) if e.backend_error::<VerbsError>().is_some() => {
                assert!(
                    matches!(
                        e.backend_error::<VerbsError>(),
                        Some(VerbsError::WorkCompletion { .. })
                    ),
                    "expected a work completion error, got {e:?}"
                );
                format!("{e}")
            }
            // The READs all finished before the fault landed: the message is whole and right,
            // and the next receive fails.
            (Ok(Some(m)), Some(Err(e))) if is_typed_failure(&e) => {
                assert_eq!(m.header.as_slice(), &[3u8][..]);
                assert!(m.payload == payload, "the message arrived whole, but wrong");
                format!("the whole message, then: {e}")
            }
            (first, next) => panic!(
                "expected Truncated or a work completion error (or the whole message, then a \
                 typed error), got {:?}, then {next:?}",
                first.map(|m| m.map(|m| m.payload.len()))
            ),
        };

        let (r, rx) = tokio::time::timeout(Duration::from_secs(10), client_recv)
            .await
            .expect("the client's receive ended within 10 s of the fault, no hang")
            .expect("task");
        let client_took = start.elapsed();
        let e = match r {
            Err(e) => e,
            Ok(m) => panic!(
                "the client's receive must fail, got {:?}",
                m.map(|m| m.payload.len())
            ),
        };
        match broken {
            // Its own queue pair broke: its pending receive is flushed.
            Broken::Sender => assert!(is_own_flush(&e), "{e:?}"),
            // Its peer's broke, which then disconnected.
            Broken::Reader => assert!(is_typed_failure(&e), "{e:?}"),
        }
        println!(
            "{name}: {at_break} of {LARGE} bytes read when the {broken:?}'s queue pair broke; \
             server's receive after {server_took:?}: {server_outcome}; client's receive after \
             {client_took:?}: {e}"
        );

        // The broken side's later sends fail too.
        let small = || Message::new(HeaderBytes::EMPTY, Bytes::from_static(b"x"));
        let broken_tx = match broken {
            Broken::Reader => &mut stx,
            Broken::Sender => &mut tx,
        };
        let e = tokio::time::timeout(Duration::from_secs(10), broken_tx.send(small()))
            .await
            .expect("no hang")
            .expect_err("a send after the fault");
        assert!(e.is_fatal(), "{e:?}");

        // Both connections dropped: nothing stays on either transport.
        drop((tx, rx, stx, srx));
        all_returned(&server, "server").await;
        all_returned(&client, "client").await;
    });
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn reader_qp_forced_to_error_mid_rendezvous_fails_both_sides() {
    qp_broken_mid_rendezvous(Broken::Reader);
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn sender_qp_forced_to_error_mid_rendezvous_fails_both_sides() {
    qp_broken_mid_rendezvous(Broken::Sender);
}
