use super::*;
use crate::test_util::{gated_echo_server, Duplex};
use crate::RpcError;
use crate::{ClientConfig, RpcClient};

/// Starts `calls` echo calls of `size` bytes against a gated server, opens the gate once
/// every request has arrived, checks each reply, and returns the server's writes for them.
async fn writes_for_replies_ready_together(calls: u64, size: usize) -> u64 {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let server_metrics = server_end.metrics();
    let (open, serving) = gated_echo_server(server_end);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let tasks: Vec<_> = (0..calls)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move {
                let p = Bytes::from(vec![i as u8; size]);
                (c.call(1, p.clone()).await, p)
            })
        })
        .collect();
    while server_metrics.snapshot().messages_received < calls {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let before = server_metrics.snapshot();
    open.send(true).expect("handlers wait");
    for task in tasks {
        let (reply, sent) = task.await.expect("task");
        assert_eq!(reply.expect("call"), sent);
    }
    let after = server_metrics.snapshot();
    assert_eq!(after.messages_sent - before.messages_sent, calls);
    client.close().await.expect("close");
    serving.await.expect("task").expect("served");
    after.syscalls - before.syscalls
}

/// Replies that become ready together leave in a few writes, not one write per call, and
/// each still reaches its own caller.
#[tokio::test]
async fn replies_ready_together_are_written_together() {
    const CALLS: u64 = 64;
    let writes = writes_for_replies_ready_together(CALLS, 8).await;
    assert!(writes <= 8, "{CALLS} replies took {writes} writes");
}

/// Large replies that become ready together also leave together: eight 64 KiB replies
/// take one or two writes, not one each (the batch holds up to `Replies::MAX_BYTES`).
#[tokio::test]
async fn large_replies_ready_together_are_written_together() {
    const CALLS: u64 = 8;
    const SIZE: usize = 64 << 10;
    let writes = writes_for_replies_ready_together(CALLS, SIZE).await;
    assert!(
        writes <= 2,
        "{CALLS} replies of {SIZE} bytes took {writes} writes"
    );
}

/// One request frame, as the client would write it.
fn request_frame(id: u64, payload: &[u8]) -> Vec<u8> {
    let header = RpcHeader::new(Kind::Request, 1, id, payload.len()).encode();
    let mut frame = transport_framed::frame::encode_prefix(header.len(), payload.len()).to_vec();
    frame.extend_from_slice(&header);
    frame.extend_from_slice(payload);
    frame
}

/// A server answering every request with its payload's length (small replies, which
/// `Replies` may hold) on one end of an in-memory stream; the other end as raw bytes out
/// and decoded messages in.
fn server_on_raw_stream() -> (
    tokio::io::WriteHalf<tokio::io::DuplexStream>,
    transport_framed::StreamReceiver<tokio::io::ReadHalf<tokio::io::DuplexStream>>,
) {
    let (w, replies, _) = server_on_raw_stream_with(
        |req: Request| async move {
            Ok::<_, Status>(Bytes::copy_from_slice(&req.payload.len().to_le_bytes()))
        },
        1 << 20,
    );
    (w, replies)
}

/// [`server_on_raw_stream`] with `handler`, over pipes of `pipe` bytes; also returns the
/// server connection's counters.
fn server_on_raw_stream_with<H: Handler>(
    handler: H,
    pipe: usize,
) -> (
    tokio::io::WriteHalf<tokio::io::DuplexStream>,
    transport_framed::StreamReceiver<tokio::io::ReadHalf<tokio::io::DuplexStream>>,
    Arc<Metrics>,
) {
    let (client_end, server_end) = Duplex::pair_with_pipe(8 << 20, pipe);
    let server_metrics = server_end.metrics();
    let server = RpcServer::new(handler, ServerConfig::default());
    tokio::spawn(async move { server.serve_connection(server_end).await });
    let (r, w) = tokio::io::split(client_end.io);
    let replies = transport_framed::StreamReceiver::new(r, Arc::default(), &client_end.config);
    (w, replies, server_metrics)
}

/// Answers every request with its payload.
async fn echo(req: Request) -> Result<Bytes, Status> {
    Ok(req.payload)
}

async fn reply_id<R: MessageReceiver>(replies: &mut R) -> u64 {
    let msg = tokio::time::timeout(Duration::from_secs(10), replies.recv())
        .await
        .expect("a reply arrives")
        .expect("recv")
        .expect("open");
    let header = RpcHeader::decode(msg.header.as_slice()).expect("header");
    assert_eq!(header.kind, Kind::Response);
    header.request_id
}

/// A reply waits while the next request is arriving, so that both replies leave in one
/// write; it goes out once that request is complete.
#[tokio::test]
async fn replies_wait_for_a_request_that_is_arriving() {
    use tokio::io::AsyncWriteExt;
    let (mut w, mut replies) = server_on_raw_stream();
    let (a, b) = (request_frame(1, b"a"), request_frame(2, &[7u8; 32 << 10]));
    w.write_all(&[&a[..], &b[..1000]].concat()).await.unwrap();
    let early = tokio::time::timeout(Duration::from_millis(100), replies.recv()).await;
    assert!(early.is_err(), "the reply to 1 was held: {early:?}");
    w.write_all(&b[1000..]).await.unwrap();
    assert_eq!(reply_id(&mut replies).await, 1);
    assert_eq!(reply_id(&mut replies).await, 2);
}

/// No reply waits for a request whose rest is larger than `Replies::HOLD_BYTES`.
#[tokio::test]
async fn replies_do_not_wait_for_a_large_request() {
    use tokio::io::AsyncWriteExt;
    let (mut w, mut replies) = server_on_raw_stream();
    let a = request_frame(1, b"a");
    let b = request_frame(2, &vec![7u8; 2 * Replies::HOLD_BYTES]);
    w.write_all(&[&a[..], &b[..1000]].concat()).await.unwrap();
    assert_eq!(reply_id(&mut replies).await, 1);
    w.write_all(&b[1000..]).await.unwrap();
    assert_eq!(reply_id(&mut replies).await, 2);
}

/// A reply of `Replies::HOLD_REPLY_BYTES` does not wait for the request arriving behind
/// it (a small one does: `replies_wait_for_a_request_that_is_arriving`).
#[tokio::test]
async fn large_replies_do_not_wait_for_a_request_that_is_arriving() {
    use tokio::io::AsyncWriteExt;
    let (mut w, mut replies, _) = server_on_raw_stream_with(echo, 1 << 20);
    let a = request_frame(1, &vec![7u8; Replies::HOLD_REPLY_BYTES]);
    let b = request_frame(2, &[7u8; 32 << 10]);
    w.write_all(&[&a[..], &b[..1000]].concat()).await.unwrap();
    assert_eq!(reply_id(&mut replies).await, 1);
    w.write_all(&b[1000..]).await.unwrap();
    assert_eq!(reply_id(&mut replies).await, 2);
}

/// While a reply of `Replies::READ_AHEAD_REPLY_BYTES` or more waits to be written, the
/// server does not read the request behind it unless that has arrived whole: with the
/// client not reading replies, a reply larger than the pipe blocks the server, and the
/// next request (in the pipe, larger than the server's read buffer) stays unread until
/// the reply is taken.
#[tokio::test]
async fn large_replies_are_written_before_the_next_request_is_read() {
    use tokio::io::AsyncWriteExt;
    const PIPE: usize = 2 * Replies::READ_AHEAD_REPLY_BYTES;
    // A tiny request gets a reply larger than the pipe (and smaller than a full batch);
    // others are echoed.
    const LARGE: usize = PIPE + PIPE / 2;
    const { assert!(LARGE < Replies::MAX_BYTES) };
    let (mut w, mut replies, server_metrics) = server_on_raw_stream_with(
        |req: Request| async move {
            Ok::<_, Status>(if req.payload.len() < 64 {
                Bytes::from(vec![0u8; LARGE])
            } else {
                req.payload
            })
        },
        PIPE,
    );
    let second = vec![8u8; 2 * transport_framed::DEFAULT_READ_BUFFER];
    let bytes = [request_frame(1, b"a"), request_frame(2, &second)].concat();
    assert!(bytes.len() < PIPE);
    w.write_all(&bytes)
        .await
        .expect("both requests fit in the pipe");
    let read = |m: &Arc<Metrics>| m.snapshot().messages_received;
    let early = tokio::time::timeout(Duration::from_millis(300), async {
        while read(&server_metrics) < 2 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        early.is_err(),
        "the server read request 2 while reply 1 waited"
    );
    assert_eq!(read(&server_metrics), 1);
    assert_eq!(reply_id(&mut replies).await, 1);
    assert_eq!(reply_id(&mut replies).await, 2);
}

/// Held replies go out once `Replies::HOLD_BYTES` of requests arrived since holding
/// began, although requests keep arriving.
#[tokio::test]
async fn held_replies_wait_for_a_bounded_number_of_bytes() {
    use tokio::io::AsyncWriteExt;
    let (mut w, mut replies) = server_on_raw_stream();
    let part = vec![7u8; Replies::HOLD_BYTES * 3 / 5];
    let mut bytes = request_frame(1, b"a");
    for id in 2..=4 {
        bytes.extend_from_slice(&request_frame(id, &part));
    }
    // Request 5 only starts: replies 1..=4 must not wait for it.
    bytes.extend_from_slice(&request_frame(5, &part)[..1000]);
    let writer = tokio::spawn(async move {
        w.write_all(&bytes).await.unwrap();
        w
    });
    for id in 1..=4 {
        assert_eq!(reply_id(&mut replies).await, id);
    }
    let _w = writer.await.expect("writer");
}

/// A handler that answers more than the connection allows gets an error reply saying so,
/// and the connection goes on.
#[tokio::test]
async fn oversized_reply_becomes_an_error() {
    let (client_end, mut server_end) = Duplex::pair(1 << 20);
    server_end.config.max_message_size = 1024;
    let server = RpcServer::new(
        |req: Request| async move {
            match req.method {
                1 => Ok(Bytes::from(vec![7u8; 4096])),
                _ => Ok(req.payload),
            }
        },
        ServerConfig::default(),
    );
    tokio::spawn(async move { server.serve_connection(server_end).await });
    let client = RpcClient::new(client_end, ClientConfig::default());
    match client.call(1, Bytes::new()).await {
        Err(RpcError::Remote(s)) => assert_eq!(s.code, code::MESSAGE_TOO_LARGE, "{s:?}"),
        other => panic!("expected MESSAGE_TOO_LARGE, got {other:?}"),
    }
    let p = Bytes::from_static(b"still here");
    assert_eq!(client.call(2, p.clone()).await.expect("next call"), p);
}

/// The default connection limit keeps an eighth of the descriptor limit (at least 64)
/// for the rest of the process, never reaches 0, and follows this process's limit.
#[test]
fn default_max_connections_leaves_descriptors_for_the_process() {
    assert_eq!(max_connections_for(Some(1024)), 896);
    assert_eq!(max_connections_for(Some(1 << 20)), 917_504);
    assert_eq!(max_connections_for(Some(256)), 192);
    assert_eq!(max_connections_for(Some(10)), 1);
    assert_eq!(max_connections_for(None), 896);
    assert_eq!(
        max_connections_for(Some(libc::RLIM_INFINITY)),
        (1 << 30) - (1 << 27)
    );
    let soft = soft_nofile().expect("getrlimit");
    let config = ServerConfig::default();
    assert_eq!(config.max_connections, max_connections_for(Some(soft)));
    assert_eq!(config.idle_timeout, Some(DEFAULT_IDLE_TIMEOUT));
}

/// With the default settings a connection that never sends a frame is closed after
/// [`DEFAULT_IDLE_TIMEOUT`], not before (paused clock).
#[tokio::test(start_paused = true)]
async fn a_silent_connection_is_closed_after_the_default_idle_timeout() {
    let server = RpcServer::new(
        |req: Request| async move { Ok(req.payload) },
        ServerConfig::default(),
    );
    let (client_end, server_end) = Duplex::pair_with_pipe(1 << 20, 64 * 1024);
    let start = Instant::now();
    let served = tokio::spawn({
        let server = server.clone();
        async move { server.serve_connection(server_end).await }
    });
    // Counted while it is served.
    tokio::task::yield_now().await;
    assert_eq!(server.connections(), 1);
    let ended = tokio::time::timeout(DEFAULT_IDLE_TIMEOUT * 2, served)
        .await
        .expect("a silent connection outlived twice the default idle timeout")
        .expect("task");
    assert!(ended.is_ok(), "{ended:?}");
    assert!(start.elapsed() >= DEFAULT_IDLE_TIMEOUT, "closed too early");
    assert_eq!(server.connections(), 0);
    drop(client_end);
}

/// Accept failures back off (5 ms doubling to 1 s) and are logged at most once per
/// interval, with the count of failures since the last line.
#[test]
fn accept_backoff_doubles_and_logs_once_per_interval() {
    let mut b = AcceptBackoff::new();
    let t0 = Instant::now();
    let (w, log) = b.failed(t0);
    assert_eq!((w, log), (Duration::from_millis(5), Some(1)));
    let mut now = t0;
    let mut lines = vec![];
    let mut waits = vec![];
    for _ in 0..200 {
        let (w, log) = b.failed(now);
        now += w;
        waits.push(w);
        lines.extend(log);
    }
    assert_eq!(waits[0], Duration::from_millis(10));
    assert!(waits.iter().all(|&w| w <= AcceptBackoff::MAX));
    assert_eq!(*waits.last().expect("waits"), AcceptBackoff::MAX);
    // ~195 s of failures: one line per 10 s, and every failure counted once.
    let elapsed = now.duration_since(t0);
    assert!(
        lines.len() as u64 <= elapsed.as_secs() / 10 + 1,
        "{lines:?}"
    );
    assert_eq!(1 + lines.iter().sum::<u64>() + b.failures_since_log, 201);
    b.succeeded();
    assert_eq!(b.failed(now).0, AcceptBackoff::FIRST);
}

/// A listener whose accept always fails (EMFILE), counting the attempts.
struct FailingListener(Arc<std::sync::atomic::AtomicUsize>);

impl Listener for FailingListener {
    type Addr = String;
    type Connection = Duplex;
    fn local_addr(&self) -> Result<String, TransportError> {
        Ok("failing".into())
    }
    async fn accept(&mut self) -> Result<Duplex, TransportError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(std::io::Error::from_raw_os_error(24).into())
    }
}

/// A server out of file descriptors retries accept a bounded number of times per second
/// (backing off, not at a fixed short pause), and still shuts down promptly.
#[tokio::test(start_paused = true)]
async fn failing_accepts_back_off() {
    let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let server = RpcServer::new(
        |req: Request| async move { Ok(req.payload) },
        ServerConfig::default(),
    );
    let srv = server.clone();
    let listener = FailingListener(attempts.clone());
    let serving = tokio::spawn(async move { srv.serve(listener).await });
    tokio::time::sleep(Duration::from_secs(60)).await;
    let n = attempts.load(Ordering::SeqCst);
    // 5+10+...+640 ms, then one per second: ~68 attempts in 60 s (a fixed 10 ms pause
    // would make 6000).
    assert!((50..=80).contains(&n), "{n} accept attempts in 60 s");
    server.shutdown().await;
    tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("serve returns on shutdown")
        .expect("task")
        .expect("serve");
}

/// `RpcClient::close` lets the calls in flight finish before it closes the connection,
/// so a server that cancels the calls of closed connections still answers them.
#[tokio::test]
async fn client_close_waits_for_calls_in_flight() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let (open, serving) = gated_echo_server(server_end);
    let client = RpcClient::new(client_end, ClientConfig::default());
    let c = client.clone();
    let call = tokio::spawn(async move { c.call(1, Bytes::from_static(b"late")).await });
    while client.in_flight() == 0 {
        tokio::task::yield_now().await;
    }
    let c = client.clone();
    let closing = tokio::spawn(async move { c.close().await });
    let early = tokio::time::timeout(Duration::from_millis(50), async {
        while !closing.is_finished() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(early.is_err(), "close waits while a call is in flight");
    assert!(matches!(
        client.call(1, Bytes::new()).await,
        Err(RpcError::ClientClosed)
    ));
    open.send(true).expect("handlers wait");
    let reply = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("answered")
        .expect("task");
    assert_eq!(reply.expect("call"), "late");
    tokio::time::timeout(Duration::from_secs(10), closing)
        .await
        .expect("close returns")
        .expect("task")
        .expect("close");
    serving.await.expect("task").expect("served");
}

/// The idle timeout does not cut a request that is still arriving, however long it takes
/// (stalls are the transport's frame timeout to end), and still closes once idle.
#[tokio::test(start_paused = true)]
async fn idle_timeout_spares_a_request_that_is_arriving() {
    use tokio::io::AsyncWriteExt;
    let (client_end, server_end) = Duplex::pair(8 << 20);
    let config = ServerConfig {
        idle_timeout: Some(Duration::from_secs(1)),
        ..ServerConfig::default()
    };
    let server = RpcServer::new(
        |req: Request| async move {
            Ok::<_, Status>(Bytes::copy_from_slice(&req.payload.len().to_le_bytes()))
        },
        config,
    );
    let serving = tokio::spawn(async move { server.serve_connection(server_end).await });
    let (r, mut w) = tokio::io::split(client_end.io);
    let mut replies = transport_framed::StreamReceiver::new(r, Arc::default(), &client_end.config);
    let frame = request_frame(1, &vec![7u8; 4 << 20]);
    // 4 MiB over ~4 s, 300 ms between pieces: never a second without bytes.
    for piece in frame.chunks(frame.len() / 13 + 1) {
        w.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(reply_id(&mut replies).await, 1, "answered, not cut");
    let start = tokio::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("closed once idle");
    ended.expect("task").expect("clean end");
    assert!(start.elapsed() >= Duration::from_millis(700));
}

/// The idle timeout counts from the last request: calls 0.6 s apart keep a connection
/// with a 1 s timeout open past the time its timer was first set for, and it closes one
/// timeout after the last of them, not earlier (paused clock).
#[tokio::test(start_paused = true)]
async fn idle_timeout_counts_from_the_last_request() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let config = ServerConfig {
        idle_timeout: Some(Duration::from_secs(1)),
        ..ServerConfig::default()
    };
    let server = RpcServer::new(|req: Request| async move { Ok(req.payload) }, config);
    let mut serving = tokio::spawn(async move { server.serve_connection(server_end).await });
    let client = crate::RpcClient::new(client_end, crate::ClientConfig::default());
    for i in 0..4u8 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        let reply = client.call(1, Bytes::from(vec![i])).await.expect("open");
        assert_eq!(reply, vec![i]);
    }
    // 2.4 s in, past two timeouts from the start: the connection is still served.
    assert!(!serving.is_finished());
    let last = tokio::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(10), &mut serving)
        .await
        .expect("closed once idle");
    ended.expect("task").expect("clean end");
    let idle_for = last.elapsed();
    assert!(
        idle_for >= Duration::from_secs(1) && idle_for < Duration::from_millis(1100),
        "closed {idle_for:?} after the last call"
    );
}

/// On a transport that can tell whether a request is there (`try_recv`), the server
/// takes requests that way while replies wait to be written, and writes the replies at
/// once when none is: every call of pipelined rounds is answered, once, with its own
/// payload, and both outcomes of the look were met.
#[tokio::test]
async fn requests_taken_by_try_recv_are_all_answered() {
    use crate::test_util::Looking;
    use crate::{ClientConfig, RpcClient};
    use std::sync::atomic::Ordering;
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let looking = Looking::new(server_end);
    let found = looking.found.clone();
    let server = RpcServer::new(
        // Every other call waits a turn: calls then end while requests are there.
        |req: Request| async move {
            if req.payload[1] % 2 == 1 {
                tokio::task::yield_now().await;
            }
            Ok(req.payload)
        },
        ServerConfig::default(),
    );
    let serving = tokio::spawn(async move { server.serve_connection(looking).await });
    let client = RpcClient::new(client_end, ClientConfig::default());
    tokio::time::timeout(Duration::from_secs(30), async {
        for round in 0..20u8 {
            let calls = (0..64u8).map(|i| client.call(1, Bytes::from(vec![round, i])));
            let answers = futures_util::future::join_all(calls).await;
            for (i, answer) in answers.into_iter().enumerate() {
                assert_eq!(answer.expect("answered"), vec![round, i as u8]);
            }
        }
    })
    .await
    .expect("every round is answered");
    assert!(
        found.ready.load(Ordering::Relaxed) > 0,
        "requests taken by the look"
    );
    assert!(
        found.empty.load(Ordering::Relaxed) > 0,
        "replies written on an empty look"
    );
    client.close().await.expect("close");
    serving.await.expect("task").expect("served");
}

/// `shutdown` ends a connection that sits idle (nothing to read, nothing running).
#[tokio::test]
async fn shutdown_wakes_an_idle_connection() {
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let server = RpcServer::new(
        |req: Request| async move { Ok(req.payload) },
        ServerConfig::default(),
    );
    let srv = server.clone();
    let serving = tokio::spawn(async move { srv.serve_connection(server_end).await });
    let client = RpcClient::new(client_end, ClientConfig::default());
    let p = Bytes::from_static(b"before");
    assert_eq!(client.call(1, p.clone()).await.expect("call"), p);
    server.shutdown().await;
    let served = tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("the idle connection ended on shutdown");
    served.expect("task").expect("clean end");
    let r = client.call(1, Bytes::new()).await;
    assert!(matches!(r, Err(ref e) if e.is_connection_error()), "{r:?}");
}

/// Handlers that answer at once (run in a box the server reuses) and handlers that wait
/// (which take their box with them) interleave on one connection: each call gets its own
/// answer, a waiting handler's future is not overwritten by the requests after it, and one
/// past `handler_timeout` is answered with `DEADLINE_EXCEEDED` while the others go on.
#[tokio::test]
async fn handlers_that_wait_and_handlers_that_answer_at_once_interleave() {
    const NOW: u32 = 1;
    const GATED: u32 = 2;
    const NEVER: u32 = 3;
    let (client_end, server_end) = Duplex::pair(1 << 20);
    let (open, gate) = tokio::sync::watch::channel(false);
    let server = RpcServer::new(
        move |req: Request| {
            let mut gate = gate.clone();
            async move {
                match req.method {
                    NOW => {}
                    GATED => {
                        let _ = gate.wait_for(|open| *open).await;
                    }
                    _ => std::future::pending::<()>().await,
                }
                Ok::<_, Status>(req.payload)
            }
        },
        ServerConfig {
            handler_timeout: Some(Duration::from_secs(1)),
            ..ServerConfig::default()
        },
    );
    let serving = tokio::spawn(async move { server.serve_connection(server_end).await });
    let client = RpcClient::new(client_end, ClientConfig::default());
    let call = |method: u32, body: &'static str| {
        let c = client.clone();
        tokio::spawn(async move { c.call(method, Bytes::from_static(body.as_bytes())).await })
    };
    let never = call(NEVER, "never");
    let gated: Vec<_> = (0..3).map(|_| call(GATED, "gated")).collect();
    for i in 0..20 {
        let body: &'static str = if i % 2 == 0 { "even" } else { "odd" };
        let reply = tokio::time::timeout(Duration::from_secs(10), call(NOW, body))
            .await
            .expect("answered at once")
            .expect("task");
        assert_eq!(reply.expect("call"), body);
    }
    assert_eq!(client.in_flight(), 4, "the waiting calls are still running");
    open.send(true).expect("handlers wait");
    for g in gated {
        let reply = tokio::time::timeout(Duration::from_secs(10), g)
            .await
            .expect("answered once the gate opened")
            .expect("task");
        assert_eq!(reply.expect("call"), "gated");
    }
    let timed_out = tokio::time::timeout(Duration::from_secs(10), never)
        .await
        .expect("answered at the handler timeout")
        .expect("task");
    match timed_out {
        Err(RpcError::Remote(status)) => assert_eq!(status.code, code::DEADLINE_EXCEEDED),
        other => panic!("expected DEADLINE_EXCEEDED, got {other:?}"),
    }
    client.close().await.expect("close");
    serving.await.expect("task").expect("served");
}
