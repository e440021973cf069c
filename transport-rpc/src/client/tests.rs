use super::*;
use crate::test_util::{gated_echo_server, Duplex, Gated};
use std::task::Poll;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Waits until `n` messages sit in the client's outbox (their callers wait for the writer).
async fn queued(client: &RpcClient<impl MessageSender>, n: usize) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while client.shared.outbox().queue.len() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the calls queue up");
}

/// Spawns calls 0..n of method 1, call i carrying the byte i.
fn spawn_calls<S: MessageSender>(
    client: &RpcClient<S>,
    n: u8,
) -> Vec<JoinHandle<Result<Bytes, RpcError>>> {
    (0..n)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { c.call(1, Bytes::from(vec![i])).await })
        })
        .collect()
}

/// Every call ends, with a connection error.
async fn all_fail_with_connection_errors(calls: Vec<JoinHandle<Result<Bytes, RpcError>>>) {
    for call in calls {
        let r = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("no call hangs")
            .expect("task");
        assert!(matches!(r, Err(ref e) if e.is_connection_error()), "{r:?}");
    }
}

/// Waits until a caller holds the writer (its write waits for the switch).
async fn write_started(client: &RpcClient<impl MessageSender>) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while client.shared.writer.try_lock().is_some() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("a caller takes the writer");
}

/// Spawns calls 0..n like [`spawn_calls`], and returns once every one of them has been
/// polled once. By then each call either holds a slot or waits for one: a call registers
/// (and counts in `in_flight`) and queues its request in the same poll that gives it a
/// slot, so with no reply coming (no slot freed), `in_flight` tells how many got one.
async fn start_calls<S: MessageSender>(
    client: &RpcClient<S>,
    n: u8,
) -> Vec<JoinHandle<Result<Bytes, RpcError>>> {
    let (polled_tx, mut polled) = tokio::sync::mpsc::unbounded_channel();
    let calls = (0..n)
        .map(|i| {
            let c = client.clone();
            let polled_tx = polled_tx.clone();
            tokio::spawn(async move {
                let mut call = std::pin::pin!(c.call(1, Bytes::from(vec![i])));
                let first = transport_core::poll_once(call.as_mut()).await;
                let _ = polled_tx.send(());
                match first {
                    Poll::Ready(r) => r,
                    Poll::Pending => call.await,
                }
            })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(10), async {
        for _ in 0..n {
            polled
                .recv()
                .await
                .expect("a call task ended before its first poll");
        }
    })
    .await
    .expect("every call task runs");
    calls
}

/// Calls made while a write is under way go out together in the next write, and each
/// caller returns once its own message was taken.
#[tokio::test]
async fn calls_queued_behind_a_write_go_out_in_one_batch() {
    let (conn, open) = Gated::new(false);
    let writes = conn.writes.clone();
    let client = RpcClient::new(conn, ClientConfig::default());
    let first = {
        let c = client.clone();
        tokio::spawn(async move { c.oneway(1, Bytes::from_static(b"first")).await })
    };
    // The first message is being written (the sender waits for the switch)...
    write_started(&client).await;
    // ...and ten more calls queue behind it.
    let rest: Vec<_> = (0..10u8)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { c.oneway(2, Bytes::from(vec![i])).await })
        })
        .collect();
    queued(&client, 10).await;
    open.send(true).expect("sender waits");
    first.await.expect("task").expect("first oneway");
    for r in rest {
        r.await.expect("task").expect("queued oneway");
    }
    assert_eq!(*writes.lock().expect("log"), vec![1, 10]);
}

/// Calls started in the same turn while another call is in flight leave in one write;
/// the first call, alone in flight, is written at once.
#[tokio::test]
async fn calls_started_together_leave_together() {
    let (conn, open) = Gated::new(false);
    open.send(true).expect("sender takes messages at once");
    let writes = conn.writes.clone();
    let client = RpcClient::new(conn, ClientConfig::default());
    // Nothing ever answers: every call stays in flight.
    let first = spawn_calls(&client, 1);
    tokio::time::timeout(Duration::from_secs(10), async {
        while writes.lock().expect("log").is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the first call is written");
    let c = client.clone();
    let together = tokio::spawn(async move {
        let calls = (0..10u8).map(|i| c.call(1, Bytes::from(vec![i])));
        futures_util::future::join_all(calls).await
    });
    tokio::time::timeout(Duration::from_secs(10), async {
        while writes.lock().expect("log").iter().sum::<usize>() < 11 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("all eleven requests are written");
    assert_eq!(*writes.lock().expect("log"), vec![1, 10]);
    together.abort();
    first[0].abort();
}

/// A call dropped while its message is being written does not leave the connection with
/// half a message: the write is finished without waiting for another call.
#[tokio::test]
async fn a_write_whose_caller_is_dropped_is_finished() {
    let (conn, open) = Gated::new(false);
    let writes = conn.writes.clone();
    let client = RpcClient::new(conn, ClientConfig::default());
    let c = client.clone();
    let call = tokio::spawn(async move { c.oneway(1, Bytes::from_static(b"dropped")).await });
    write_started(&client).await;
    call.abort();
    assert!(call.await.expect_err("aborted").is_cancelled());
    open.send(true).expect("sender waits");
    tokio::time::timeout(Duration::from_secs(10), async {
        while writes.lock().expect("log").is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the started write is finished by itself");
    assert_eq!(*writes.lock().expect("log"), vec![1]);
    client.oneway(1, Bytes::new()).await.expect("next oneway");
    assert_eq!(*writes.lock().expect("log"), vec![1, 1]);
}

/// Runs `f` for at most `polls` polls (yielding between them), then drops it.
async fn within_polls<F: Future>(polls: u64, f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    for _ in 0..polls {
        let polled = transport_core::poll_once(f.as_mut()).await;
        if let Poll::Ready(v) = polled {
            return Some(v);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// Calls and oneways dropped at any point (queued, half written, waiting for the reply)
/// never corrupt the connection: every call that completes gets its own payload back,
/// nothing hangs, and the connection still works afterwards. Requests and replies of
/// 300 KB do not fit the 1 MiB in-memory pipe together, so writes block and calls are
/// dropped in the middle of them; the server holds replies while requests arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_calls_never_corrupt_the_connection() {
    use crate::{Request, RpcServer, ServerConfig};
    let (client_end, server_end) = Duplex::pair(4 << 20);
    let server = RpcServer::new(
        |req: Request| async move { Ok::<_, Status>(req.payload) },
        ServerConfig::default(),
    );
    tokio::spawn(async move { server.serve_connection(server_end).await });
    let client = RpcClient::new(client_end, ClientConfig::default());
    let (mut completed, mut dropped) = (0, 0);
    for round in 0..20u64 {
        let tasks: Vec<_> = (0..60u64)
            .map(|i| {
                let c = client.clone();
                tokio::spawn(async move {
                    let size = [10, 70_000, 300_000][(i % 3) as usize];
                    let payload = Bytes::from(vec![(i + round) as u8; size]);
                    // Two calls in three are dropped after 0-7 polls.
                    let polls = match (i + round) % 3 {
                        0 => u64::MAX,
                        _ => (i * 7 + round * 13) % 8,
                    };
                    if i % 5 == 4 {
                        let sent = within_polls(polls, c.oneway(2, payload)).await;
                        return sent.map(|r| r.expect("oneway")).is_some();
                    }
                    match within_polls(polls, c.call(1, payload.clone())).await {
                        Some(reply) => {
                            let reply = reply.expect("call");
                            assert!(reply == payload, "call {i} got another call's reply");
                            true
                        }
                        None => false,
                    }
                })
            })
            .collect();
        for t in tasks {
            let done = tokio::time::timeout(Duration::from_secs(20), t)
                .await
                .expect("no call hangs")
                .expect("task");
            if done {
                completed += 1;
            } else {
                dropped += 1;
            }
        }
        let after = Bytes::from(vec![round as u8; 100_000]);
        let reply = tokio::time::timeout(Duration::from_secs(20), client.call(1, after.clone()))
            .await
            .expect("the connection still answers")
            .expect("call after the drops");
        assert_eq!(reply, after);
    }
    assert!(
        completed >= 100 && dropped > 0,
        "{completed} completed, {dropped} dropped"
    );
}

/// A failed write fails every call whose message it carried, and every later call.
#[tokio::test]
async fn a_failed_write_fails_every_call_in_it() {
    let (conn, open) = Gated::new(true);
    let client = RpcClient::new(conn, ClientConfig::default());
    let calls = spawn_calls(&client, 5);
    queued(&client, 4).await;
    open.send(true).expect("sender waits");
    all_fail_with_connection_errors(calls).await;
    let later = client.oneway(1, Bytes::new()).await;
    assert!(
        matches!(later, Err(ref e) if e.is_connection_error()),
        "{later:?}"
    );
}

/// No more than `max_in_flight` calls reach the server at once; the others wait for a
/// slot and go out as earlier calls finish.
#[tokio::test]
async fn max_in_flight_holds_back_further_calls() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let server_metrics = server_end.metrics();
    let (open, _serving) = gated_echo_server(server_end);
    let client = RpcClient::new(
        client_end,
        ClientConfig {
            max_in_flight: 3,
            default_deadline: None,
        },
    );
    let calls = start_calls(&client, 10).await;
    // Every call has been polled and nothing is answered yet (no slot comes free): three
    // calls took a slot, the seven others wait for one.
    assert_eq!(client.in_flight(), 3);
    assert_eq!(client.shared.state().slot_waiters, 7);
    assert!(calls.iter().all(|c| !c.is_finished()));
    // The three requests reach the server...
    tokio::time::timeout(Duration::from_secs(10), async {
        while server_metrics.snapshot().messages_received < 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the first three requests reach the server");
    // ...and nothing else can: they are all the client ever queued for writing.
    assert_eq!(client.shared.outbox().queued, 3);
    assert_eq!(server_metrics.snapshot().messages_received, 3);
    assert_eq!(client.in_flight(), 3);
    open.send(true).expect("handlers wait");
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.expect("task").expect("call"), vec![i as u8]);
    }
    assert_eq!(client.metrics().snapshot().in_flight_max, 3);
}

/// A call that stops waiting for a slot (its task aborted, its deadline passed) takes
/// none and swallows no wake-up: the call behind it gets the slot when it comes free.
#[tokio::test]
async fn a_call_that_gives_up_waiting_for_a_slot_leaves_it_to_the_next() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let (open, _serving) = gated_echo_server(server_end);
    let client = RpcClient::new(
        client_end,
        ClientConfig {
            max_in_flight: 1,
            default_deadline: None,
        },
    );
    let mut calls = start_calls(&client, 3).await;
    assert_eq!(client.shared.state().slot_waiters, 2);
    let second = calls.remove(1);
    second.abort();
    assert!(second.await.expect_err("aborted").is_cancelled());
    assert_eq!(client.shared.state().slot_waiters, 1);
    open.send(true).expect("handlers wait");
    let answers = tokio::time::timeout(Duration::from_secs(10), async {
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.expect("task").expect("call"));
        }
        answers
    })
    .await
    .expect("the first and the third call are answered");
    assert_eq!(
        answers,
        vec![Bytes::from(vec![0u8]), Bytes::from(vec![2u8])]
    );
    assert_eq!(client.in_flight(), 0);
    assert_eq!(client.shared.state().slot_waiters, 0);
}

/// Request ids are never 0 (the id of oneway calls), never repeat while a call is in
/// flight, and the id of a call that went away no longer finds an entry when its slot
/// serves a later call (its late reply is dropped).
#[test]
fn a_stale_request_id_finds_no_call() {
    let mut p = Pending::default();
    let first = p.insert();
    let other = p.insert();
    assert_ne!(first, 0);
    assert_ne!(first, other);
    assert!(p.remove(first).is_some());
    let reuse = p.insert();
    assert_eq!(
        Pending::slot(reuse),
        Pending::slot(first),
        "the slot is reused"
    );
    assert_ne!(reuse, first);
    assert!(p.get_mut(first).is_none());
    assert!(p.remove(first).is_none());
    assert_eq!(p.get_mut(reuse).map(|w| w.id), Some(reuse));
    assert_eq!(p.len(), 2);
}

/// Calls waiting for a slot fail with the connection's error when it closes.
#[tokio::test]
async fn waiting_calls_fail_when_the_connection_closes() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let client = RpcClient::new(
        client_end,
        ClientConfig {
            max_in_flight: 1,
            default_deadline: None,
        },
    );
    let calls = start_calls(&client, 3).await;
    // One call holds the only slot, the two others wait for it.
    assert_eq!(client.in_flight(), 1);
    assert_eq!(client.shared.state().slot_waiters, 2);
    assert!(calls.iter().all(|c| !c.is_finished()));
    drop(server_end);
    all_fail_with_connection_errors(calls).await;
}

/// A server that answers with a message only clients send breaks the protocol: the
/// call fails with a typed [`ProtocolError`] naming the kind, not a string.
#[tokio::test]
async fn a_request_from_the_server_is_a_typed_protocol_error() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let (mut tx, mut rx) = server_end.split();
    let server = tokio::spawn(async move {
        let req = rx.recv().await.expect("recv").expect("a request");
        let h = RpcHeader::decode(req.header.as_slice()).expect("header");
        let bogus = RpcHeader::new(Kind::Request, 9, h.request_id, 0);
        tx.send(Message::new(
            HeaderBytes::from(bogus.encode()),
            Bytes::new(),
        ))
        .await
        .expect("send");
        // Keep the connection open until the client has failed the call.
        rx.recv().await
    });
    let err = tokio::time::timeout(Duration::from_secs(10), client.call(1, Bytes::new()))
        .await
        .expect("the call ends")
        .expect_err("a request is not an answer");
    match err {
        RpcError::Protocol(ProtocolError::UnexpectedKind { from, kind }) => {
            assert_eq!((from, kind), ("server", Kind::Request));
        }
        other => panic!("expected an unexpected-kind protocol error, got {other:?}"),
    }
    // The connection is gone: the next call fails at once with a connection error.
    let next = tokio::time::timeout(Duration::from_secs(10), client.call(1, Bytes::new()))
        .await
        .expect("the call ends");
    assert!(matches!(next, Err(e) if e.is_connection_error()));
    drop(client);
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
}

/// A lone call reads its reply on its own task (no hand-over from another task); a reply
/// that overtakes another call's is handed over to that call by the one that read it.
#[tokio::test]
async fn a_lone_call_reads_its_own_reply_and_an_overtaking_reply_is_handed_over() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let (open, serving) = gated_echo_server(server_end);
    open.send(true).expect("handlers run");
    for i in 0..100u8 {
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            client.call(1, Bytes::from(vec![i])),
        )
        .await
        .expect("the call ends")
        .expect("call");
        assert_eq!(reply, vec![i]);
    }
    assert_eq!(
        client.metrics().snapshot().handoffs,
        0,
        "lone calls read their own replies"
    );
    drop(client);
    let _ = tokio::time::timeout(Duration::from_secs(10), serving).await;

    // Two calls; the server answers the second first.
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let (mut tx, mut rx) = server_end.split();
    let server = tokio::spawn(async move {
        let mut ids = Vec::new();
        for _ in 0..2 {
            let m = rx.recv().await.expect("recv").expect("a request");
            ids.push(
                RpcHeader::decode(m.header.as_slice())
                    .expect("header")
                    .request_id,
            );
        }
        for (id, body) in [(ids[1], b"second"), (ids[0], b"first_")] {
            let h = RpcHeader::new(Kind::Response, 1, id, body.len());
            tx.send(Message::new(
                HeaderBytes::from(h.encode()),
                Bytes::from_static(body),
            ))
            .await
            .expect("reply");
        }
        rx.recv().await
    });
    let calls = start_calls(&client, 2).await;
    let mut replies = Vec::new();
    for call in calls {
        let reply = tokio::time::timeout(Duration::from_secs(10), call)
            .await
            .expect("the call ends")
            .expect("task")
            .expect("call");
        replies.push(reply);
    }
    assert_eq!(replies, [&b"first_"[..], &b"second"[..]]);
    assert_eq!(
        client.metrics().snapshot().handoffs,
        1,
        "the first call read both"
    );
    drop(client);
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
}

/// The header of the next message the server end receives (`what`, within 10 s).
/// A client on a [`Looking`](crate::test_util::Looking) end (its receiver answers
/// `try_recv`), the counts of what those looks found, and the server's end.
fn looking_client() -> (
    RpcClient<transport_framed::StreamSender<tokio::io::WriteHalf<tokio::io::DuplexStream>>>,
    Arc<crate::test_util::LookCounts>,
    Duplex,
) {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let looking = crate::test_util::Looking::new(client_end);
    let found = looking.found.clone();
    (
        RpcClient::new(looking, ClientConfig::default()),
        found,
        server_end,
    )
}

fn response(id: u64, body: &'static [u8]) -> Message {
    let h = RpcHeader::new(Kind::Response, 1, id, body.len());
    Message::new(HeaderBytes::from(h.encode()), Bytes::from_static(body))
}

/// The ids a fresh client gives its first call, and its second once the first has ended.
fn first_two_ids() -> (u64, u64) {
    let mut p = Pending::default();
    let first = p.insert();
    p.remove(first);
    (first, p.insert())
}

/// One call of method 1 with no payload, bounded by 10 s.
async fn call_once<S: MessageSender>(client: &RpcClient<S>) -> Result<Bytes, RpcError> {
    tokio::time::timeout(Duration::from_secs(10), client.call(1, Bytes::new()))
        .await
        .expect("the call ends")
}

/// No reply was handed from one task to another, and no call is left in flight.
fn assert_settled<S: MessageSender>(client: &RpcClient<S>, why: &str) {
    assert_eq!(client.metrics().snapshot().handoffs, 0, "{why}");
    assert_eq!(client.in_flight(), 0, "{why}");
}

fn looked(found: &crate::test_util::LookCounts) -> (usize, usize) {
    use std::sync::atomic::Ordering::Relaxed;
    (found.ready.load(Relaxed), found.empty.load(Relaxed))
}

#[tokio::test]
async fn a_reply_there_when_the_call_looks_is_taken_in_that_look() {
    let (client, found, server_end) = looking_client();
    let (mut tx, mut rx) = server_end.split();
    let (first, second) = first_two_ids();
    // Written before the calls: each finds its reply at its first look.
    tx.send(response(first, b"at once")).await.expect("reply");
    let reply = call_once(&client).await.expect("call");
    assert_eq!(reply, &b"at once"[..]);
    assert_eq!(looked(&found), (1, 0), "taken by the call's first look");
    assert_eq!(next_header(&mut rx, "the request").await.request_id, first);
    assert_eq!(client.in_flight(), 0);
    // The receiving half is back: the next call looks again.
    tx.send(response(second, b"again")).await.expect("reply");
    let reply = call_once(&client).await.expect("call");
    assert_eq!(reply, &b"again"[..]);
    assert_eq!(looked(&found), (2, 0));
    assert_settled(&client, "no reply handed over");
}

#[tokio::test]
async fn a_late_reply_found_at_once_is_dropped_and_the_call_reads_on() {
    let (client, found, server_end) = looking_client();
    let (mut tx, _rx) = server_end.split();
    let (first, _) = first_two_ids();
    // A reply to no call (one that went away), then the call's own.
    tx.send(response(7 << 32 | 5, b"late"))
        .await
        .expect("reply");
    tx.send(response(first, b"mine")).await.expect("reply");
    let reply = call_once(&client).await.expect("call");
    assert_eq!(reply, &b"mine"[..]);
    assert_eq!(looked(&found), (2, 0), "both found at once");
    assert_settled(&client, "the late one is dropped");
}

#[tokio::test]
async fn the_end_found_at_once_fails_the_call_and_the_calls_after_it() {
    let (client, found, server_end) = looking_client();
    let (mut tx, _rx) = server_end.split();
    tx.close().await.expect("close");
    for _ in 0..2 {
        let r = call_once(&client).await;
        assert!(matches!(r, Err(RpcError::ConnectionClosed)), "{r:?}");
    }
    assert_eq!(
        looked(&found).0,
        1,
        "the end was found at the first call's look"
    );
}

async fn next_header<R: MessageReceiver>(rx: &mut R, what: &str) -> RpcHeader {
    let m = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap_or_else(|_| panic!("{what} arrives"))
        .expect("recv")
        .unwrap_or_else(|| panic!("{what}, not the end"));
    RpcHeader::decode(m.header.as_slice()).expect("header")
}

/// A waker that records that it was woken.
struct Flag(std::sync::atomic::AtomicBool);

impl std::task::Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Polls `f` until it is pending with the receiving half still out of reach (at most 100
/// polls: a call yields once before its write when others are in flight).
fn poll_until_parked<F: Future + Unpin>(f: &mut F, waker: &Waker) -> Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(waker);
    for _ in 0..100 {
        if let Poll::Ready(out) = std::pin::Pin::new(&mut *f).poll(&mut cx) {
            return Poll::Ready(out);
        }
    }
    Poll::Pending
}

/// When the reader leaves the receiving half to a waiting call and that call is cancelled
/// before it takes it, the next waiting call is woken instead: no call waits forever for
/// a receiver nobody reads.
#[tokio::test]
async fn a_call_cancelled_after_being_woken_to_read_passes_the_receiver_on() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let (mut tx, mut rx) = server_end.split();
    let noop = Waker::noop().clone();
    let flag = Arc::new(Flag(std::sync::atomic::AtomicBool::new(false)));
    let c_waker = Waker::from(flag.clone());
    let mut a = Box::pin(client.call(1, Bytes::from_static(b"a")));
    let mut b = Box::pin(client.call(1, Bytes::from_static(b"b")));
    let mut c = Box::pin(client.call(1, Bytes::from_static(b"c")));
    // A writes and reads; B and C write, then wait for the receiving half.
    assert!(poll_until_parked(&mut a, &noop).is_pending());
    assert!(poll_until_parked(&mut b, &noop).is_pending());
    assert!(poll_until_parked(&mut c, &c_waker).is_pending());
    assert_eq!(
        client.shared.state().want_inbox.len(),
        2,
        "B and C wait to read"
    );
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(next_header(&mut rx, "a request").await.request_id);
    }
    let reply = |id: u64, body: &'static [u8]| {
        let h = RpcHeader::new(Kind::Response, 1, id, body.len());
        Message::new(HeaderBytes::from(h.encode()), Bytes::from_static(body))
    };
    tx.send(reply(ids[0], b"A")).await.expect("reply to A");
    // A reads its reply and leaves the receiver to B, the oldest waiting call.
    let got = tokio::time::timeout(Duration::from_secs(10), &mut a)
        .await
        .expect("A ends");
    assert_eq!(got.expect("A's call"), &b"A"[..]);
    assert!(!flag.0.load(Ordering::SeqCst), "B is woken first, not C");
    // B gives up before taking it: C is woken to read.
    drop(b);
    assert!(
        flag.0.load(Ordering::SeqCst),
        "a cancelled call passes the receiver on"
    );
    tx.send(reply(ids[2], b"C")).await.expect("reply to C");
    let got = tokio::time::timeout(Duration::from_secs(10), &mut c)
        .await
        .expect("C ends");
    assert_eq!(got.expect("C's call"), &b"C"[..]);
    // The server is told B is off.
    let h = next_header(&mut rx, "the cancel").await;
    assert_eq!((h.kind, h.request_id), (Kind::Cancel, ids[1]));
}

/// What the client writes after giving up on a call, in
/// [`late_reply_while_writing`].
#[derive(Clone, Copy, PartialEq)]
enum Then {
    Call,
    Oneway,
}

/// A server that writes a large late reply (to a call that gave up) and reads nothing
/// until that reply is taken, while the client writes a large request (`then`): the write
/// reads the late reply meanwhile, so neither side waits for the other forever.
async fn late_reply_while_writing(then: Then) {
    const BIG: usize = 4 << 20; // four times the in-memory pipe's capacity
    let (client_end, server_end) = Duplex::pair(8 << 20);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let (mut tx, mut rx) = server_end.split();
    let (gave_up_tx, gave_up_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let a = rx.recv().await.expect("recv").expect("call a");
        let a = RpcHeader::decode(a.header.as_slice()).expect("header");
        gave_up_rx.await.expect("the client gives up on a");
        // The late reply to `a`: this send waits until the client reads it, and nothing
        // is read from the client meanwhile.
        let late = RpcHeader::new(Kind::Response, 1, a.request_id, BIG);
        tx.send(Message::new(
            HeaderBytes::from(late.encode()),
            Bytes::from(vec![7u8; BIG]),
        ))
        .await
        .expect("the late reply is taken");
        loop {
            let m = rx.recv().await.expect("recv").expect("message b");
            let h = RpcHeader::decode(m.header.as_slice()).expect("header");
            match h.kind {
                Kind::Oneway => break,
                Kind::Request => {
                    let reply = RpcHeader::new(Kind::Response, 1, h.request_id, 2);
                    tx.send(Message::new(
                        HeaderBytes::from(reply.encode()),
                        Bytes::from_static(b"ok"),
                    ))
                    .await
                    .expect("reply b");
                    break;
                }
                _ => continue, // a's cancel
            }
        }
        rx.recv().await
    });
    let gave_up = client
        .call_with(
            1,
            Bytes::new(),
            CallOptions::deadline(Duration::from_millis(10)),
        )
        .await;
    assert!(
        matches!(gave_up, Err(RpcError::DeadlineExceeded(_))),
        "{gave_up:?}"
    );
    gave_up_tx.send(()).expect("server waits");
    let big = Bytes::from(vec![1u8; BIG]);
    let b = tokio::time::timeout(Duration::from_secs(10), async {
        match then {
            Then::Call => client.call(1, big).await,
            Then::Oneway => client.oneway(1, big).await.map(|()| Bytes::new()),
        }
    })
    .await
    .expect("the large write is not stuck behind the late reply")
    .expect("message b");
    if then == Then::Call {
        assert_eq!(b, Bytes::from_static(b"ok"));
    }
    drop(client);
    let _ = tokio::time::timeout(Duration::from_secs(10), server).await;
}

#[tokio::test]
async fn a_write_the_server_does_not_drain_reads_replies_meanwhile() {
    late_reply_while_writing(Then::Call).await;
}

/// No call is in flight during the oneway, but one went away unanswered: its late reply
/// may still come, so the blocked oneway write reads too.
#[tokio::test]
async fn a_oneway_the_server_does_not_drain_reads_late_replies_meanwhile() {
    late_reply_while_writing(Then::Oneway).await;
}

/// A oneway write the peer does not take at once, with no call in flight and none gone
/// unanswered: no answer can come, so it waits for the write alone and leaves the
/// receiving half where it is.
#[tokio::test]
async fn a_blocked_oneway_with_nothing_owed_leaves_the_receiver_alone() {
    let (client_end, server_end) = Duplex::pair_with_pipe(1 << 20, 4096);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let (_tx, mut rx) = server_end.split();
    let mut oneway = Box::pin(client.oneway(1, Bytes::from(vec![3u8; 64 << 10])));
    let waker = Waker::noop();
    assert!(
        poll_until_parked(&mut oneway, waker).is_pending(),
        "the pipe holds 4 KiB: the write waits"
    );
    assert!(
        client.shared.state().inbox.is_some(),
        "the blocked oneway took the receiving half"
    );
    let (sent, got) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(10), oneway),
        rx.recv()
    );
    sent.expect("bounded").expect("oneway taken");
    let got = got.expect("recv").expect("the oneway");
    assert_eq!(got.payload.len(), 64 << 10);
}
