use super::*;
use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc;
use transport_framed::frame::encode_prefix;

const ECHO: u32 = 1;
const SLOW: u32 = 2;
const BIG: u32 = 3;
const FAIL: u32 = 4;
/// Every wait in these tests ends within this.
const BOUND: Duration = Duration::from_secs(20);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

async fn handle(req: Request) -> Result<Bytes, Status> {
    match req.method {
        ECHO => Ok(req.payload),
        SLOW => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(Bytes::from_static(b"slow"))
        }
        BIG => Ok(Bytes::from(vec![9u8; 64 << 10])),
        FAIL => Err(Status::new(code::APPLICATION + 1, "no")),
        m => Err(Status::unknown_method(m)),
    }
}

type Reply = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Bytes, Status>> + Send>>;
type Server = BlockingServer<fn(Request) -> Reply>;

fn server(rt: &tokio::runtime::Runtime, server: ServerConfig, config: BlockingConfig) -> Server {
    let h: fn(Request) -> Reply = |req| Box::pin(handle(req));
    BlockingServer::new(h, server, config, rt.handle().clone())
}

/// Runs `f` on a thread and waits at most [`BOUND`] for its result.
fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(BOUND).expect("finished in time")
}

/// The idle timeout of [`idle_server`].
const IDLE: Duration = Duration::from_millis(100);

/// A server that closes a connection after [`IDLE`] without a message.
fn idle_server(rt: &tokio::runtime::Runtime) -> Server {
    let sc = ServerConfig {
        idle_timeout: Some(IDLE),
        ..ServerConfig::default()
    };
    server(rt, sc, BlockingConfig::default())
}

/// The async [`RpcServer`](super::super::RpcServer) serving one end of a socket pair on
/// `rt`; returns the other end and the server's task.
fn async_served(
    rt: &tokio::runtime::Runtime,
) -> (UnixStream, tokio::task::JoinHandle<Result<(), RpcError>>) {
    let (a, b) = UnixStream::pair().unwrap();
    b.set_nonblocking(true).unwrap();
    let async_server = super::super::RpcServer::new(handle, ServerConfig::default());
    let task = rt.spawn(async move {
        let b = tokio::net::UnixStream::from_std(b).unwrap();
        let conn =
            transport_framed::StreamConnection::new(b, "uds", Default::default(), "pair".into());
        async_server.serve_connection(conn).await
    });
    (a, task)
}

/// A server serving one end of a socket pair on its own thread; returns the other end and
/// the thread's result.
fn served(s: &Server) -> (UnixStream, mpsc::Receiver<Result<(), RpcError>>) {
    let (a, b) = UnixStream::pair().unwrap();
    let (tx, rx) = mpsc::channel();
    let s = s.clone();
    std::thread::spawn(move || {
        let _ = tx.send(s.serve_connection(b));
    });
    (a, rx)
}

#[test]
fn calls_are_answered_over_unix_and_tcp_listeners() {
    let rt = runtime();
    let s = server(&rt, ServerConfig::default(), BlockingConfig::default());
    let dir = std::env::temp_dir().join(format!("blocking-rpc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.sock");
    let _ = std::fs::remove_file(&path);
    let unix = UnixListener::bind(&path).unwrap();
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp_addr = tcp.local_addr().unwrap();
    let (s1, s2) = (s.clone(), s.clone());
    let unix_thread = std::thread::spawn(move || s1.serve(unix));
    let tcp_thread = std::thread::spawn(move || s2.serve(tcp));

    let path2 = path.clone();
    bounded(move || {
        let mut u = BlockingClient::new(
            UnixStream::connect(&path2).unwrap(),
            BlockingConfig::default(),
        )
        .unwrap();
        let mut t = BlockingClient::new(
            std::net::TcpStream::connect(tcp_addr).unwrap(),
            BlockingConfig::default(),
        )
        .unwrap();
        assert!(
            t.socket().nodelay().unwrap(),
            "TCP clients send without Nagle delay"
        );
        for size in [0usize, 1, 100, 70_000, 1 << 20] {
            let payload: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
            assert_eq!(u.call(ECHO, &payload).unwrap(), payload, "uds {size}");
            assert_eq!(t.call(ECHO, &payload).unwrap(), payload, "tcp {size}");
        }
        let before = u.metrics().snapshot();
        u.oneway(ECHO, b"dropped").unwrap();
        assert_eq!(u.call(ECHO, b"after").unwrap(), &b"after"[..]);
        let used = u.metrics().snapshot() - before;
        assert_eq!((used.messages_sent, used.messages_received), (2, 1));
        assert_eq!(
            used.syscalls, 3,
            "a write per message, one read for the answer"
        );
        match u.call(FAIL, b"") {
            Err(RpcError::Remote(st)) => assert_eq!(st.code, code::APPLICATION + 1),
            other => panic!("{other:?}"),
        }
        match t.call(77, b"") {
            Err(RpcError::Remote(st)) => assert_eq!(st.code, code::UNKNOWN_METHOD),
            other => panic!("{other:?}"),
        }
    });
    s.shutdown();
    let (a, b) = bounded(move || (unix_thread.join().unwrap(), tcp_thread.join().unwrap()));
    a.unwrap();
    b.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A blocking client against the async server, and the async client against the blocking
/// server: one wire format.
#[test]
fn blocking_and_async_ends_interoperate() {
    let rt = runtime();
    let (a, async_side) = async_served(&rt);
    let mut client = BlockingClient::new(a, BlockingConfig::default()).unwrap();
    let got = bounded(move || client.call(ECHO, b"to async").unwrap());
    assert_eq!(got, &b"to async"[..]);

    let s = server(&rt, ServerConfig::default(), BlockingConfig::default());
    let (a, done) = served(&s);
    a.set_nonblocking(true).unwrap();
    let got = rt.block_on(async move {
        let a = tokio::net::UnixStream::from_std(a).unwrap();
        let conn =
            transport_framed::StreamConnection::new(a, "uds", Default::default(), "pair".into());
        let client = super::super::RpcClient::new(conn, Default::default());
        let calls: Vec<_> = (0..8u8)
            .map(|i| {
                let c = client.clone();
                tokio::spawn(async move { c.call(ECHO, Bytes::from(vec![i; 10])).await })
            })
            .collect();
        let mut got = Vec::new();
        for c in calls {
            got.push(
                tokio::time::timeout(BOUND, c)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap(),
            );
        }
        client.close().await.unwrap();
        got
    });
    for (i, g) in got.iter().enumerate() {
        assert_eq!(&g[..], &[i as u8; 10][..]);
    }
    done.recv_timeout(BOUND).unwrap().unwrap();
    async_side.abort();
}

/// Frames up to `SMALL_FRAME_PAYLOAD` bytes of payload go as one contiguous write, larger
/// ones as vectored writes: payloads on both sides of that bound (and empty ones) reach an
/// async server and a blocking server byte for byte, and come back as sent.
#[test]
fn small_and_large_frames_arrive_whole() {
    let rt = runtime();
    let sizes = [
        0,
        1,
        SMALL_FRAME_PAYLOAD - 1,
        SMALL_FRAME_PAYLOAD,
        SMALL_FRAME_PAYLOAD + 1,
        100_000,
    ];
    // Each size as a call (its echo checked) and, if `oneway`, then as a oneway.
    let each_size = move |client: &mut BlockingClient<UnixStream>, to: &str, oneway: bool| {
        for n in sizes {
            let p = (0..n).map(|i| (i * 7 + n) as u8).collect::<Vec<u8>>();
            assert_eq!(client.call(ECHO, &p).unwrap(), p, "{n} bytes to the {to}");
            if oneway {
                client.oneway(ECHO, &p).unwrap();
            }
        }
    };

    let (a, async_side) = async_served(&rt);
    let mut client = BlockingClient::new(a, BlockingConfig::default()).unwrap();
    bounded(move || each_size(&mut client, "async server", false));
    async_side.abort();

    let s = server(&rt, ServerConfig::default(), BlockingConfig::default());
    let (a, _done) = served(&s);
    let mut client = BlockingClient::new(a, BlockingConfig::default()).unwrap();
    bounded(move || {
        each_size(&mut client, "blocking server", true);
        // The oneways were read in order (an answer after them means they were taken).
        assert_eq!(client.call(ECHO, b"end").unwrap(), &b"end"[..]);
    });
}

#[test]
fn a_call_past_its_deadline_fails_and_its_late_answer_is_skipped() {
    let rt = runtime();
    let s = server(&rt, ServerConfig::default(), BlockingConfig::default());
    let (a, _done) = served(&s);
    bounded(move || {
        let mut c = BlockingClient::new(a, BlockingConfig::default()).unwrap();
        let t = Instant::now();
        match c.call_with(SLOW, b"", Some(Duration::from_millis(50))) {
            Err(RpcError::DeadlineExceeded(d)) => assert_eq!(d, Duration::from_millis(50)),
            other => panic!("{other:?}"),
        }
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "gave up at the deadline"
        );
        // The slow answer arrives first and is skipped; this call gets its own.
        assert_eq!(c.call(ECHO, b"mine").unwrap(), &b"mine"[..]);
    });
}

#[test]
fn a_response_over_the_limit_is_an_error_and_the_connection_goes_on() {
    let rt = runtime();
    let s = server(&rt, ServerConfig::default(), BlockingConfig::default());
    let (a, _done) = served(&s);
    bounded(move || {
        let config = BlockingConfig::default().with_max_message_size(1024);
        let mut c = BlockingClient::new(a, config).unwrap();
        match c.call(BIG, b"") {
            Err(RpcError::ResponseTooLarge { len, max }) => {
                assert_eq!(len, (RPC_HEADER_LEN + (64 << 10)) as u64);
                assert_eq!(max, 1024);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.call(ECHO, b"still").unwrap(), &b"still"[..]);
        match c.call(ECHO, &[0u8; 2000]) {
            Err(RpcError::RequestTooLarge { .. }) => {}
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn a_request_over_the_server_limit_is_answered_with_an_error() {
    let rt = runtime();
    let s = server(
        &rt,
        ServerConfig::default(),
        BlockingConfig::default().with_max_message_size(4096),
    );
    let (a, _done) = served(&s);
    bounded(move || {
        let mut c = BlockingClient::new(a, BlockingConfig::default()).unwrap();
        match c.call(ECHO, &vec![1u8; 100_000]) {
            Err(RpcError::Remote(st)) => assert_eq!(st.code, code::MESSAGE_TOO_LARGE),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.call(ECHO, b"ok").unwrap(), &b"ok"[..]);
    });
}

/// Wrong magic ends the connection with a typed error; so does a frame that stops
/// arriving; a peer that closes mid-frame is a truncation. None of them hangs.
#[test]
fn a_hostile_client_gets_a_typed_error_not_a_hang() {
    let rt = runtime();
    let config = BlockingConfig::default().with_frame_timeout(Duration::from_millis(200));
    let s = server(&rt, ServerConfig::default(), config);

    let (mut a, done) = served(&s);
    a.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    match done.recv_timeout(BOUND).unwrap() {
        Err(RpcError::ConnectionLost(e)) => {
            assert!(matches!(*e, TransportError::Malformed(_)), "{e}")
        }
        other => panic!("{other:?}"),
    }

    let (mut a, done) = served(&s);
    // A prefix announcing 1 MiB, then nothing.
    a.write_all(&encode_prefix(RPC_HEADER_LEN, 1 << 20))
        .unwrap();
    match done.recv_timeout(BOUND).unwrap() {
        Err(RpcError::ConnectionLost(e)) => match *e {
            TransportError::Stalled {
                received, expected, ..
            } => {
                assert_eq!(received, PREFIX_LEN as u64);
                assert_eq!(expected, (PREFIX_LEN + RPC_HEADER_LEN + (1 << 20)) as u64);
            }
            ref other => panic!("{other}"),
        },
        other => panic!("{other:?}"),
    }

    let (mut a, done) = served(&s);
    a.write_all(&encode_prefix(RPC_HEADER_LEN, 10)).unwrap();
    a.write_all(&[0u8; 5]).unwrap();
    drop(a);
    match done.recv_timeout(BOUND).unwrap() {
        Err(RpcError::ConnectionLost(e)) => {
            assert!(
                matches!(*e, TransportError::Truncated { received: 13, .. }),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// A frame announcing the largest length the format allows buffers only what arrived.
#[test]
fn an_announced_length_alone_allocates_nothing_big() {
    let (mut a, mut b) = UnixStream::pair().unwrap();
    a.write_all(&encode_prefix(RPC_HEADER_LEN, u32::MAX as usize - 64))
        .unwrap();
    a.write_all(&[0u8; 100]).unwrap();
    drop(a);
    let config = BlockingConfig::default().with_max_message_size(usize::MAX / 2);
    let mut r = FrameReader::new(&config, Arc::new(Metrics::default()));
    match r.next(&mut b, Limit::Deadline(None)) {
        Err(TransportError::Truncated { received, .. }) => assert_eq!(received, 108),
        other => panic!("{other:?}"),
    }
    assert!(
        r.buf.capacity() <= 2 * READ_CHUNK,
        "{} bytes reserved",
        r.buf.capacity()
    );
}

#[test]
fn a_server_that_dies_mid_answer_fails_this_call_and_every_later_one() {
    let (a, mut b) = UnixStream::pair().unwrap();
    let peer = std::thread::spawn(move || {
        let mut req = [0u8; PREFIX_LEN + RPC_HEADER_LEN];
        b.read_exact(&mut req).unwrap();
        b.write_all(&encode_prefix(RPC_HEADER_LEN, 1000)).unwrap();
        b.write_all(&[0u8; 10]).unwrap();
    });
    bounded(move || {
        let mut c = BlockingClient::new(a, BlockingConfig::default()).unwrap();
        let first = c.call(ECHO, b"").unwrap_err();
        assert!(
            matches!(&first, RpcError::ConnectionLost(e) if matches!(**e, TransportError::Truncated { .. })),
            "{first}"
        );
        let second = c.call(ECHO, b"").unwrap_err();
        assert_eq!(second.to_string(), first.to_string());
    });
    peer.join().unwrap();
}

#[test]
fn connections_beyond_the_limit_are_closed_at_once() {
    let rt = runtime();
    let s = server(
        &rt,
        ServerConfig::default(),
        BlockingConfig::default().with_max_connections(1),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let s2 = s.clone();
    let serving = std::thread::spawn(move || s2.serve(listener));
    let s3 = s.clone();
    bounded(move || {
        let mut first = BlockingClient::new(
            std::net::TcpStream::connect(addr).unwrap(),
            BlockingConfig::default(),
        )
        .unwrap();
        assert_eq!(first.call(ECHO, b"1").unwrap(), &b"1"[..]);
        let mut second = BlockingClient::new(
            std::net::TcpStream::connect(addr).unwrap(),
            BlockingConfig::default(),
        )
        .unwrap();
        assert!(second.call(ECHO, b"2").unwrap_err().is_connection_error());
        assert_eq!(s3.refused(), 1);
        assert_eq!(first.call(ECHO, b"3").unwrap(), &b"3"[..]);
    });
    s.shutdown();
    bounded(move || serving.join().unwrap()).unwrap();
}

#[test]
fn shutdown_ends_accepting_and_every_connection() {
    let rt = runtime();
    let s = server(&rt, ServerConfig::default(), BlockingConfig::default());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let s2 = s.clone();
    let serving = std::thread::spawn(move || s2.serve(listener));
    let mut c = BlockingClient::new(
        std::net::TcpStream::connect(addr).unwrap(),
        BlockingConfig::default(),
    )
    .unwrap();
    let mut c = bounded(move || {
        assert_eq!(c.call(ECHO, b"x").unwrap(), &b"x"[..]);
        c
    });
    assert_eq!(s.connections(), 1);
    s.shutdown();
    bounded(move || serving.join().unwrap()).unwrap();
    // The connection's thread stopped reading and closed it.
    let e = bounded(move || c.call(ECHO, b"y").unwrap_err());
    assert!(e.is_connection_error(), "{e}");
}

#[test]
fn an_idle_connection_is_closed_after_the_idle_timeout() {
    let rt = runtime();
    let s = idle_server(&rt);
    let (a, done) = served(&s);
    let t = Instant::now();
    done.recv_timeout(BOUND).unwrap().unwrap();
    assert!(t.elapsed() >= IDLE);
    drop(a);
}

/// With a spin budget the client polls for the answer before blocking (more than one read
/// per call, the extra ones finding nothing), except where the process may use one CPU only.
#[test]
fn a_spinning_client_polls_before_it_blocks() {
    let spinning = transport_core::spin::available_cpus() > 1;
    let (a, mut b) = UnixStream::pair().unwrap();
    let config = BlockingConfig::default().with_spin(Duration::from_secs(5));
    let c = BlockingClient::new(a, config).unwrap();
    let metrics = c.metrics().clone();
    let peer = std::thread::spawn(move || {
        let mut req = [0u8; PREFIX_LEN + RPC_HEADER_LEN];
        b.read_exact(&mut req).unwrap();
        let id = RpcHeader::decode(&req[PREFIX_LEN..]).unwrap().request_id;
        // Answer once the client has polled twice (its write and two reads), or after a
        // bound (it blocked instead).
        let t = Instant::now();
        let bound = if spinning {
            BOUND
        } else {
            Duration::from_millis(100)
        };
        while metrics.syscalls.get() < 3 && t.elapsed() < bound {
            std::thread::yield_now();
        }
        let m = Metrics::default();
        write_frame(&mut b, RpcHeader::new(Kind::Response, 0, id, 2), b"ok", &m).unwrap();
        b
    });
    let (reply, c) = bounded(move || {
        let mut c = c;
        (c.call(ECHO, b"").unwrap(), c)
    });
    assert_eq!(reply, &b"ok"[..]);
    let used = c.metrics().snapshot();
    let reads = used.syscalls - used.messages_sent;
    if spinning {
        assert!(
            reads > 1,
            "{reads} reads: the client blocked without polling"
        );
    } else {
        assert_eq!(reads, 1, "one CPU: no spinning");
    }
    let _b = peer.join().unwrap();
}

/// A handler past `ServerConfig::handler_timeout` is answered with `DEADLINE_EXCEEDED`, and
/// the connection serves the next call.
#[test]
fn a_handler_past_the_servers_time_limit_is_answered_with_an_error() {
    let rt = runtime();
    let sc = ServerConfig {
        handler_timeout: Some(Duration::from_millis(50)),
        ..ServerConfig::default()
    };
    let s = server(&rt, sc, BlockingConfig::default());
    let (a, _done) = served(&s);
    bounded(move || {
        let mut c = BlockingClient::new(a, BlockingConfig::default()).unwrap();
        match c.call(SLOW, b"") {
            Err(RpcError::Remote(st)) => assert_eq!(st.code, code::DEADLINE_EXCEEDED, "{st}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(c.call(ECHO, b"next").unwrap(), &b"next"[..]);
    });
}

/// A request still arriving is not idle: the idle timeout closes only a connection with
/// nothing in progress (as on the async server).
#[test]
fn a_slow_request_is_not_cut_by_the_idle_timeout() {
    let rt = runtime();
    let s = idle_server(&rt);
    let (mut a, _done) = served(&s);
    let mut frame = encode_prefix(RPC_HEADER_LEN, 3).to_vec();
    frame.extend_from_slice(&RpcHeader::new(Kind::Request, ECHO, 1, 3).encode());
    frame.extend_from_slice(b"abc");
    a.write_all(&frame[..10]).unwrap();
    // The peer is slow: the rest comes after more than the idle timeout.
    std::thread::sleep(Duration::from_millis(300));
    a.write_all(&frame[10..]).unwrap();
    a.set_read_timeout(Some(BOUND)).unwrap();
    let mut reply = [0u8; PREFIX_LEN + RPC_HEADER_LEN + 3];
    a.read_exact(&mut reply)
        .expect("answered, not closed as idle");
    assert_eq!(&reply[PREFIX_LEN + RPC_HEADER_LEN..], b"abc");
}
