//! The backend conformance suite: written once, run against every backend.
//!
//! A backend implements [`Backend`] (how to make a transport with a given message limit and a
//! fresh address to listen on) and expands [`conformance_tests!`](crate::conformance_tests) in
//! an integration test:
//!
//! ```text
//! // transport-foo/tests/conformance.rs
//! struct Foo;
//! impl transport_test::conformance::Backend for Foo { /* ... */ }
//! transport_test::conformance_tests!(Foo);
//! ```
//!
//! Every case runs on its own two-worker runtime under a hard time limit, so a hang fails the
//! case instead of stalling the run. One case re-executes the test binary as a child process
//! serving RPC and kills it with SIGKILL mid-transfer; the child is entered through the
//! `conformance_capabilities` test when `TRANSPORT_CONFORMANCE_CHILD` is set.

use bytes::Bytes;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
    TransportError,
};
use transport_rpc::{
    code, CallOptions, ClientConfig, Request, RpcClient, RpcError, RpcServer, ServerConfig, Status,
};

/// How a backend is set up for the suite.
pub trait Backend: Send + Sync + 'static {
    /// The transport under test.
    type T: Transport;
    /// A transport whose messages (header + payload) may be up to `max_message_size` bytes.
    fn transport(&self, max_message_size: usize) -> Self::T;
    /// A fresh address to listen on (port 0, a new socket path, ...).
    fn listen_addr(&self) -> <Self::T as Transport>::Addr;
}

/// Time limit of one case.
pub const CASE_TIMEOUT: Duration = Duration::from_secs(120);
/// How quickly a failure (peer gone, deadline) must surface in the cases that check it.
pub const PROMPT: Duration = Duration::from_secs(5);
const CHILD_ENV: &str = "TRANSPORT_CONFORMANCE_CHILD";
const CHILD_READY: &str = "CONFORMANCE_CHILD_LISTENING ";
const MIB: usize = 1 << 20;

/// Runs one case on a fresh runtime with a hard time limit.
pub fn run<F: Future<Output = ()>>(name: &str, case: F) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        if tokio::time::timeout(CASE_TIMEOUT, case).await.is_err() {
            panic!("conformance case `{name}` hung for more than {CASE_TIMEOUT:?}");
        }
    });
    rt.shutdown_timeout(Duration::from_secs(1));
}

/// Expands to one `#[test]` per conformance case for the backend expression `$backend`.
/// Attributes after it go on every test, for example
/// `conformance_tests!(Foo, #[ignore = "needs hardware"])` for a backend that needs a device.
#[macro_export]
macro_rules! conformance_tests {
    ($backend:expr $(, #[$attr:meta])* $(,)?) => {
        $crate::__conformance_cases!($backend, $(#[$attr])*; conformance;
            raw_messages_in_order,
            raw_message_sizes,
            raw_send_batch_dropped_at_any_poll_loses_nothing,
            raw_send_too_large_is_rejected_locally,
            raw_oversized_frame_is_skipped_by_receiver,
            raw_peer_close_is_clean_end,
            rpc_echo_sizes,
            rpc_pipelined_concurrency,
            rpc_many_connections,
            rpc_oneway_in_order,
            rpc_error_status,
            rpc_unknown_method,
            rpc_deadline_cancels_server_work,
            rpc_dropped_call_cancels_server_work,
            rpc_request_too_large_for_server,
            rpc_request_too_large_for_client,
            rpc_response_too_large_for_client,
            rpc_malformed_headers_close_connection,
            rpc_peer_closes_with_calls_pending,
            rpc_graceful_shutdown,
            peer_process_killed_mid_transfer
        );

        /// Checks the capability table; doubles as the child-process entry of
        /// `peer_process_killed_mid_transfer`.
        #[test]
        $(#[$attr])*
        fn conformance_capabilities() {
            $crate::conformance::capabilities_or_child(&$backend);
        }
    };
}

/// One `#[test]` per case, each with the attributes given: `cases` is the module
/// (`conformance::cases`, `hostile::cases`) holding `pub async fn case(&backend)`; each runs
/// under [`run`]'s time limit.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($backend:expr, $(#[$attr:meta])*; $cases:ident; $($case:ident),* $(,)?) => {
        $crate::backend_cases!([$crate::$cases::cases::] $backend, $(#[$attr])*; $($case),*);
    };
}

/// One `#[test]` per case of a per-backend suite: each case is `PREFIX case(&backend)`, an
/// async function taking the backend, run under [`run`]'s time limit, with the attributes
/// given (such as `#[ignore = "needs an RDMA device"]`).
///
/// ```text
/// async fn round_trips<B: Backend>(b: &B) { /* ... */ }
/// mod uds {
///     transport_test::backend_cases!([super::] UdsBackend, ; round_trips);
/// }
/// ```
#[macro_export]
macro_rules! backend_cases {
    ([$($prefix:tt)*] $backend:expr, $(#[$attr:meta])*; $($case:ident),* $(,)?) => {
        $crate::backend_cases!(@each [$($prefix)*] [$(#[$attr])*] $backend; $($case),*);
    };
    (@each $prefix:tt $attrs:tt $backend:expr; $($case:ident),*) => {
        $( $crate::backend_cases!(@case $prefix $attrs $backend; $case); )*
    };
    (@case [$($prefix:tt)*] [$(#[$attr:meta])*] $backend:expr; $case:ident) => {
        #[test]
        $(#[$attr])*
        fn $case() {
            let backend = $backend;
            $crate::conformance::run(stringify!($case), async move {
                $($prefix)* $case(&backend).await
            });
        }
    };
}

/// Re-executes this test binary as a child that runs only the test `entry`, with `env` set
/// (the child's server entry), and waits (30 s at most) for the line `ready` + address it
/// prints. The rest of the child's output is drained so that it never blocks on a full pipe.
pub(crate) async fn spawn_child_server<A>(
    entry: &str,
    env: &str,
    ready: &str,
) -> (tokio::process::Child, A)
where
    A: std::str::FromStr,
    A::Err: std::fmt::Debug,
{
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe().expect("current exe");
    let mut child = tokio::process::Command::new(exe)
        // `--include-ignored`: the entry may be ignored by default (a device test), and was
        // asked for all the same since the parent runs.
        .args([
            entry,
            "--nocapture",
            "--test-threads",
            "1",
            "--include-ignored",
        ])
        .env(env, "1")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the child server");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let addr = loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("child started in time")
            .expect("read child stdout")
            .expect("the child printed its address (is the macro at the test's root?)");
        // libtest may print "test name ... " ahead of it on the same line.
        if let Some(at) = line.find(ready) {
            break line[at + ready.len()..]
                .trim()
                .parse::<A>()
                .expect("child address");
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

/// Payload of `len` bytes whose content depends on `seed`.
pub fn pattern(len: usize, seed: u64) -> Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

fn header(tag: &[u8]) -> HeaderBytes {
    HeaderBytes::new(tag).expect("short header")
}

/// Sets a flag when dropped: shows that a handler's future was dropped (cancelled).
struct DropFlag(Arc<AtomicBool>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Polls `done` every millisecond until it holds; fails the case, naming `what` it waited for,
/// if it does not hold within `within`.
async fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < within,
            "waited {within:?} for {what}, in vain"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn wait_for(flag: &AtomicBool, within: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if flag.load(Ordering::SeqCst) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    flag.load(Ordering::SeqCst)
}

/// Method ids of the suite's test service.
pub mod method {
    /// Echo the payload.
    pub const ECHO: u32 = 1;
    /// Fail with an application status.
    pub const FAIL: u32 = 2;
    /// Never answer (until cancelled); sets the service's `cancelled` flag when dropped.
    pub const HANG: u32 = 3;
    /// Oneway: count one.
    pub const COUNT: u32 = 4;
    /// Return the count (u64 LE).
    pub const GET_COUNT: u32 = 5;
    /// Sleep the number of milliseconds in the payload's first byte, then echo.
    pub const SLOW_ECHO: u32 = 6;
    /// Answer with as many bytes as the u64 LE payload says.
    pub const GIVE: u32 = 7;
    /// Like `GIVE`, but every byte is the same: quick to make even for a very large answer on
    /// a slow (emulated) machine, where computing `pattern` for 96 MiB in a debug build takes
    /// longer than a case may wait.
    pub const GIVE_FILLED: u32 = 8;
}

/// Shared state of the test service.
#[derive(Default)]
pub struct ServiceState {
    /// Oneway calls counted.
    pub count: AtomicU64,
    /// Set when a `HANG` handler is dropped.
    pub cancelled: Arc<AtomicBool>,
    /// Handlers started (first polled), of any method: a case that acts on a call while its
    /// handler runs waits for this instead of guessing how long the request takes to arrive.
    pub started: AtomicU64,
}

/// The suite's test service.
pub fn service(state: Arc<ServiceState>) -> impl transport_rpc::Handler {
    move |req: Request| {
        // Oneway counting happens at dispatch, in arrival order.
        if req.method == method::COUNT {
            state.count.fetch_add(1, Ordering::SeqCst);
        }
        let state = state.clone();
        async move {
            state.started.fetch_add(1, Ordering::SeqCst);
            match req.method {
                method::ECHO => Ok(req.payload),
                method::FAIL => Err(Status::new(code::APPLICATION + 1, "it failed, as asked")),
                method::HANG => {
                    let _flag = DropFlag(state.cancelled.clone());
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(Bytes::new())
                }
                method::COUNT => Ok(Bytes::new()),
                method::GET_COUNT => Ok(Bytes::copy_from_slice(
                    &state.count.load(Ordering::SeqCst).to_le_bytes(),
                )),
                method::SLOW_ECHO => {
                    let ms = req.payload.first().copied().unwrap_or(0) as u64;
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(req.payload)
                }
                method::GIVE | method::GIVE_FILLED => {
                    let n = req
                        .payload
                        .get(..8)
                        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .ok_or_else(|| Status::new(code::INVALID_ARGUMENT, "want u64 LE"))?;
                    if req.method == method::GIVE_FILLED {
                        return Ok(Bytes::from(vec![0x5a; n as usize]));
                    }
                    Ok(pattern(n as usize, n))
                }
                m => Err(Status::unknown_method(m)),
            }
        }
    }
}

/// A running test server.
pub struct TestServer<B: Backend> {
    /// Where it listens.
    pub addr: <B::T as Transport>::Addr,
    /// The service's state.
    pub state: Arc<ServiceState>,
    /// The server (for shutdown).
    pub server: RpcServer<Box<dyn Fn(Request) -> BoxReply + Send + Sync>>,
}

type BoxReply = std::pin::Pin<Box<dyn Future<Output = Result<Bytes, Status>> + Send>>;

/// Starts the test service on `backend` with a server-side message limit.
pub async fn start_server<B: Backend>(backend: &B, max_message_size: usize) -> TestServer<B> {
    let transport = backend.transport(max_message_size);
    let listener = transport
        .listen(&backend.listen_addr())
        .await
        .expect("listen");
    let addr = listener.local_addr().expect("local addr");
    let state = Arc::new(ServiceState::default());
    let svc = service(state.clone());
    let handler: Box<dyn Fn(Request) -> BoxReply + Send + Sync> =
        Box::new(move |r| Box::pin(transport_rpc::Handler::call(&svc, r)));
    let server = RpcServer::new(handler, ServerConfig::default());
    let s = server.clone();
    tokio::spawn(async move { s.serve(listener).await });
    TestServer {
        addr,
        state,
        server,
    }
}

async fn client<B: Backend>(
    backend: &B,
    addr: &<B::T as Transport>::Addr,
    max_message_size: usize,
) -> RpcClient<<<B::T as Transport>::Connection as Connection>::Sender> {
    let conn = backend
        .transport(max_message_size)
        .connect(addr)
        .await
        .expect("connect");
    RpcClient::new(conn, ClientConfig::default())
}

/// A raw echo server: returns every message as received, until the peer closes.
async fn raw_echo_server<B: Backend>(
    backend: &B,
    max_message_size: usize,
) -> <B::T as Transport>::Addr {
    let mut listener = backend
        .transport(max_message_size)
        .listen(&backend.listen_addr())
        .await
        .expect("listen");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        while let Ok(conn) = listener.accept().await {
            tokio::spawn(async move {
                let (mut tx, mut rx) = conn.split();
                // A failure here shows up in the client as a reset: say what it was.
                loop {
                    match rx.recv().await {
                        Ok(Some(m)) => {
                            if let Err(e) = tx.send(m).await {
                                eprintln!("echo server: send: {e}");
                                break;
                            }
                        }
                        Ok(None) => break,
                        Err(e) => {
                            eprintln!("echo server: recv: {e}");
                            break;
                        }
                    }
                }
                let _ = tx.close().await;
            });
        }
    });
    addr
}

/// Checks the capability table, or runs the child server of
/// [`cases::peer_process_killed_mid_transfer`] when the child variable is set.
pub fn capabilities_or_child<B: Backend>(backend: &B) {
    if std::env::var_os(CHILD_ENV).is_some() {
        child_server(backend);
        return;
    }
    let caps = backend.transport(32 * MIB).capabilities();
    assert!(!caps.name.is_empty());
    assert_eq!(
        caps.max_message_size,
        32 * MIB,
        "the configured limit is reported"
    );
    assert!(caps.max_header_len >= transport_rpc::RPC_HEADER_LEN);
    assert!(
        caps.reliable_ordered,
        "the RPC layer needs reliable, ordered delivery"
    );
    assert!(caps.inline_size <= caps.max_message_size);
}

fn child_server<B: Backend>(backend: &B) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let server = start_server(backend, 128 * MIB).await;
        println!("\n{CHILD_READY}{}", server.addr);
        use std::io::Write;
        std::io::stdout().flush().expect("flush");
        // Serve until killed; bounded so that an orphan cannot live forever.
        tokio::time::sleep(Duration::from_secs(120)).await;
    });
}

/// The cases. Each is an `async fn(&B)` that panics on failure.
pub mod cases {
    use super::*;

    /// Messages arrive whole, in order, with their headers.
    pub async fn raw_messages_in_order<B: Backend>(b: &B) {
        let addr = raw_echo_server(b, 4 * MIB).await;
        let conn = b.transport(4 * MIB).connect(&addr).await.expect("connect");
        let (mut tx, mut rx) = conn.split();
        const N: u32 = 2000;
        let reader = tokio::spawn(async move {
            for i in 0..N {
                let m = rx.recv().await.expect("recv").expect("not closed");
                assert_eq!(m.header.as_slice(), i.to_le_bytes(), "order");
                assert_eq!(m.payload, pattern((i as usize * 131) % 9000, i as u64));
            }
            rx
        });
        for i in 0..N {
            let payload = pattern((i as usize * 131) % 9000, i as u64);
            tx.send(Message::new(header(&i.to_le_bytes()), payload))
                .await
                .expect("send");
        }
        let mut rx = reader.await.expect("reader");
        tx.close().await.expect("close");
        assert!(rx.recv().await.expect("clean end").is_none());
        let m = tx.metrics().snapshot();
        assert_eq!(m.messages_sent, N as u64);
        assert_eq!(m.messages_received, N as u64);
    }

    /// Sizes from 0 B to 16 MiB survive a round trip, bit for bit; batches too.
    pub async fn raw_message_sizes<B: Backend>(b: &B) {
        let addr = raw_echo_server(b, 32 * MIB).await;
        let conn = b.transport(32 * MIB).connect(&addr).await.expect("connect");
        let (mut tx, mut rx) = conn.split();
        let sizes = [
            0,
            1,
            63,
            64,
            65,
            4095,
            4096,
            4097,
            65535,
            65536,
            65537,
            500_000,
            MIB,
            4 * MIB + 3,
            16 * MIB,
        ];
        for (i, &n) in sizes.iter().enumerate() {
            let p = pattern(n, i as u64);
            tx.send(Message::new(header(b"sz"), p.clone()))
                .await
                .expect("send");
            let m = rx.recv().await.expect("recv").expect("open");
            assert_eq!(m.payload.len(), n);
            assert!(m.payload == p, "payload of {n} bytes corrupted");
        }
        let mut batch: Vec<Message> = (0..100u32)
            .map(|i| Message::new(header(&i.to_le_bytes()), pattern(i as usize * 10, 7)))
            .collect();
        tx.send_batch(&mut batch).await.expect("batch");
        for i in 0..100u32 {
            let m = rx.recv().await.expect("recv").expect("open");
            assert_eq!(m.header.as_slice(), i.to_le_bytes());
            assert_eq!(m.payload, pattern(i as usize * 10, 7));
        }
    }

    /// `send_batch` futures dropped after each of their polls (as the RPC client does when a
    /// write cannot finish at once) lose, duplicate and reorder nothing: what a dropped
    /// future took goes out with the next call, what it did not take stays in the batch.
    /// Sizes are small, above a socket buffer, and above verbs' eager limit (rendezvous).
    pub async fn raw_send_batch_dropped_at_any_poll_loses_nothing<B: Backend>(b: &B) {
        let addr = raw_echo_server(b, 4 * MIB).await;
        let conn = b.transport(4 * MIB).connect(&addr).await.expect("connect");
        let (mut tx, mut rx) = conn.split();
        // 160 of them above verbs' eager limit: more than its send queue takes at once.
        const N: u32 = 240;
        let size = |i: u32| [16usize, 70_000, 300_000][i as usize % 3];
        let reader = tokio::spawn(async move {
            for i in 0..N {
                let m = rx.recv().await.expect("recv").expect("not closed");
                assert_eq!(m.header.as_slice(), i.to_le_bytes(), "order");
                assert!(
                    m.payload == pattern(size(i), i as u64),
                    "message {i} corrupted"
                );
            }
            rx
        });
        let mut batch: Vec<Message> = (0..N)
            .map(|i| Message::new(header(&i.to_le_bytes()), pattern(size(i), i as u64)))
            .collect();
        let noop = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(noop);
        let mut polls = 0u64;
        loop {
            let done = {
                let mut write = std::pin::pin!(tx.send_batch(&mut batch));
                write.as_mut().poll(&mut cx)
            };
            polls += 1;
            match done {
                std::task::Poll::Ready(r) => {
                    r.expect("send_batch");
                    break;
                }
                // Dropped after one poll; let the echo server and the reader move on.
                std::task::Poll::Pending => tokio::task::yield_now().await,
            }
        }
        tx.flush().await.expect("flush");
        assert!(batch.is_empty(), "every message was taken");
        let mut rx = tokio::time::timeout(Duration::from_secs(60), reader)
            .await
            .expect("every message arrives")
            .expect("reader");
        tx.close().await.expect("close");
        assert!(rx.recv().await.expect("clean end").is_none());
        assert!(
            polls > 1,
            "the batch needed more than one poll (it exceeds any buffer)"
        );
    }

    /// A message above the sender's limit fails before anything is sent; the connection lives.
    pub async fn raw_send_too_large_is_rejected_locally<B: Backend>(b: &B) {
        let addr = raw_echo_server(b, 4 * MIB).await;
        let conn = b.transport(MIB).connect(&addr).await.expect("connect");
        let (mut tx, mut rx) = conn.split();
        let e = tx
            .send(Message::new(header(b"big"), pattern(MIB, 1)))
            .await
            .expect_err("over the limit");
        assert!(
            matches!(e, TransportError::MessageTooLarge { len, max, .. } if len == (MIB + 3) as u64 && max == MIB as u64),
            "{e:?}"
        );
        assert_eq!(tx.metrics().snapshot().messages_sent, 0);
        tx.send(Message::new(header(b"ok"), pattern(10, 2)))
            .await
            .expect("still usable");
        let m = rx.recv().await.expect("recv").expect("open");
        assert_eq!(m.header.as_slice(), b"ok");
    }

    /// A frame above the receiver's limit is reported with its header and skipped without
    /// buffering; the next message arrives intact.
    pub async fn raw_oversized_frame_is_skipped_by_receiver<B: Backend>(b: &B) {
        let mut listener = b
            .transport(MIB)
            .listen(&b.listen_addr())
            .await
            .expect("listen");
        let addr = listener.local_addr().expect("addr");
        let conn = b.transport(8 * MIB).connect(&addr).await.expect("connect");
        let (mut tx, _rx) = conn.split();
        let server = listener.accept().await.expect("accept");
        let (_stx, mut srx) = server.split();
        let sender = tokio::spawn(async move {
            tx.send(Message::new(header(b"huge"), pattern(2 * MIB, 3)))
                .await
                .expect("send huge");
            tx.send(Message::new(header(b"next"), pattern(100, 4)))
                .await
                .expect("send next");
            tx
        });
        match srx.recv().await {
            Err(TransportError::MessageTooLarge { len, max, header }) => {
                assert_eq!(len, (2 * MIB + 4) as u64);
                assert_eq!(max, MIB as u64);
                assert_eq!(header.as_slice(), b"huge");
            }
            other => panic!("expected MessageTooLarge, got {other:?}"),
        }
        let next = srx.recv().await.expect("recv").expect("open");
        assert_eq!(next.header.as_slice(), b"next");
        assert_eq!(next.payload, pattern(100, 4));
        let _tx = sender.await.expect("sender");
    }

    /// Closing the sending side is seen as a clean end, not an error.
    pub async fn raw_peer_close_is_clean_end<B: Backend>(b: &B) {
        let mut listener = b
            .transport(MIB)
            .listen(&b.listen_addr())
            .await
            .expect("listen");
        let addr = listener.local_addr().expect("addr");
        let conn = b.transport(MIB).connect(&addr).await.expect("connect");
        let server = listener.accept().await.expect("accept");
        let (mut tx, _rx) = conn.split();
        let (_stx, mut srx) = server.split();
        tx.send(Message::new(header(b"last"), Bytes::new()))
            .await
            .expect("send");
        tx.close().await.expect("close");
        let m = srx.recv().await.expect("recv").expect("the last message");
        assert_eq!(m.header.as_slice(), b"last");
        assert!(srx.recv().await.expect("clean end").is_none());
    }

    /// RPC echo from 0 B to 16 MiB.
    pub async fn rpc_echo_sizes<B: Backend>(b: &B) {
        let srv = start_server(b, 32 * MIB).await;
        let c = client(b, &srv.addr, 32 * MIB).await;
        for (i, n) in [0, 1, 100, 4096, 65536, 256 << 10, 500_000, MIB, 16 * MIB]
            .into_iter()
            .enumerate()
        {
            let p = pattern(n, i as u64);
            let r = c.call(method::ECHO, p.clone()).await.expect("echo");
            assert!(r == p, "echo of {n} bytes differs");
        }
        let r = c
            .call(
                method::GIVE,
                Bytes::copy_from_slice(&(3 * MIB as u64).to_le_bytes()),
            )
            .await
            .expect("give");
        assert_eq!(r, pattern(3 * MIB, 3 * MIB as u64));
    }

    /// Many calls in flight on one connection, answered out of order, each matched to its caller.
    pub async fn rpc_pipelined_concurrency<B: Backend>(b: &B) {
        let srv = start_server(b, 4 * MIB).await;
        let c = client(b, &srv.addr, 4 * MIB).await;
        let mut tasks = vec![];
        for t in 0..32u64 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..40u64 {
                    let mut p = pattern(16 + ((t * 40 + i) % 300) as usize, t * 1000 + i).to_vec();
                    p[0] = ((t + i) % 4) as u8; // sleep 0-3 ms: replies overtake each other
                    let p = Bytes::from(p);
                    let r = c.call(method::SLOW_ECHO, p.clone()).await.expect("call");
                    assert_eq!(r, p, "reply matched to the wrong call");
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        let m = c.metrics().snapshot();
        assert!(m.in_flight_max > 1, "calls were not pipelined: {m:?}");
        assert_eq!(c.in_flight(), 0);
    }

    /// Several client connections served at once.
    pub async fn rpc_many_connections<B: Backend>(b: &B) {
        let srv = start_server(b, 4 * MIB).await;
        let mut tasks = vec![];
        for k in 0..8u64 {
            let c = client(b, &srv.addr, 4 * MIB).await;
            tasks.push(tokio::spawn(async move {
                for i in 0..50u64 {
                    let p = pattern(1000, k * 100 + i);
                    assert_eq!(c.call(method::ECHO, p.clone()).await.expect("call"), p);
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
    }

    /// Oneway calls are delivered, in order, before a later call.
    pub async fn rpc_oneway_in_order<B: Backend>(b: &B) {
        let srv = start_server(b, 4 * MIB).await;
        let c = client(b, &srv.addr, 4 * MIB).await;
        for _ in 0..500 {
            c.oneway(method::COUNT, pattern(64, 1))
                .await
                .expect("oneway");
        }
        let n = c
            .call(method::GET_COUNT, Bytes::new())
            .await
            .expect("count");
        assert_eq!(u64::from_le_bytes(n[..8].try_into().unwrap()), 500);
        // A oneway to an unknown method is dropped silently and breaks nothing.
        c.oneway(999, Bytes::new()).await.expect("oneway");
        assert!(c.call(method::ECHO, Bytes::new()).await.is_ok());
    }

    /// A handler's error status reaches the caller intact.
    pub async fn rpc_error_status<B: Backend>(b: &B) {
        let srv = start_server(b, 4 * MIB).await;
        let c = client(b, &srv.addr, 4 * MIB).await;
        match c.call(method::FAIL, Bytes::new()).await {
            Err(RpcError::Remote(s)) => {
                assert_eq!(s.code, code::APPLICATION + 1);
                assert_eq!(s.message, "it failed, as asked");
            }
            other => panic!("expected a remote error, got {other:?}"),
        }
        assert!(c.call(method::ECHO, Bytes::new()).await.is_ok());
    }

    /// Unknown methods get `UNKNOWN_METHOD`.
    pub async fn rpc_unknown_method<B: Backend>(b: &B) {
        let srv = start_server(b, 4 * MIB).await;
        let c = client(b, &srv.addr, 4 * MIB).await;
        match c.call(4242, Bytes::new()).await {
            Err(RpcError::Remote(s)) => assert_eq!(s.code, code::UNKNOWN_METHOD),
            other => panic!("{other:?}"),
        }
    }

    /// A deadline fails the call on time, cancels the handler on the server, and leaves the
    /// connection usable.
    pub async fn rpc_deadline_cancels_server_work<B: Backend>(b: &B) {
        let srv = start_server(b, 4 * MIB).await;
        let c = client(b, &srv.addr, 4 * MIB).await;
        let start = Instant::now();
        let r = c
            .call_with(
                method::HANG,
                Bytes::new(),
                CallOptions::deadline(Duration::from_millis(200)),
            )
            .await;
        assert!(matches!(r, Err(RpcError::DeadlineExceeded(_))), "{r:?}");
        assert!(
            start.elapsed() < PROMPT,
            "deadline honoured late: {:?}",
            start.elapsed()
        );
        assert!(
            wait_for(&srv.state.cancelled, PROMPT).await,
            "the server never dropped the cancelled handler"
        );
        assert_eq!(c.in_flight(), 0);
        assert!(c.call(method::ECHO, Bytes::new()).await.is_ok());
    }

    /// Dropping a call future cancels it on the server.
    pub async fn rpc_dropped_call_cancels_server_work<B: Backend>(b: &B) {
        let srv = start_server(b, 4 * MIB).await;
        let c = client(b, &srv.addr, 4 * MIB).await;
        let c2 = c.clone();
        let task = tokio::spawn(async move { c2.call(method::HANG, Bytes::new()).await });
        // Dropped once its handler runs (a call dropped before it reaches the server has no
        // handler to cancel).
        wait_until("the HANG handler to start", PROMPT, || {
            srv.state.started.load(Ordering::SeqCst) >= 1
        })
        .await;
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        assert!(
            wait_for(&srv.state.cancelled, PROMPT).await,
            "the server never dropped the cancelled handler"
        );
        assert!(c.call(method::ECHO, Bytes::new()).await.is_ok());
    }

    /// A request above the server's limit gets `MESSAGE_TOO_LARGE`; the connection lives on.
    pub async fn rpc_request_too_large_for_server<B: Backend>(b: &B) {
        let srv = start_server(b, MIB).await;
        let c = client(b, &srv.addr, 8 * MIB).await;
        match c.call(method::ECHO, pattern(2 * MIB, 5)).await {
            Err(RpcError::Remote(s)) => assert_eq!(s.code, code::MESSAGE_TOO_LARGE, "{s:?}"),
            other => panic!("{other:?}"),
        }
        let p = pattern(1000, 6);
        assert_eq!(c.call(method::ECHO, p.clone()).await.expect("next call"), p);
    }

    /// A request above the client's own limit fails at once and sends nothing.
    pub async fn rpc_request_too_large_for_client<B: Backend>(b: &B) {
        let srv = start_server(b, 8 * MIB).await;
        let c = client(b, &srv.addr, MIB).await;
        let before = c.metrics().snapshot();
        let r = c.call(method::ECHO, pattern(2 * MIB, 5)).await;
        assert!(matches!(r, Err(RpcError::RequestTooLarge { .. })), "{r:?}");
        assert_eq!(c.metrics().snapshot().messages_sent, before.messages_sent);
        assert!(c.call(method::ECHO, Bytes::new()).await.is_ok());
    }

    /// A response above the client's limit fails that call only.
    pub async fn rpc_response_too_large_for_client<B: Backend>(b: &B) {
        let srv = start_server(b, 8 * MIB).await;
        let c = client(b, &srv.addr, MIB).await;
        let r = c
            .call(
                method::GIVE,
                Bytes::copy_from_slice(&(2 * MIB as u64).to_le_bytes()),
            )
            .await;
        assert!(matches!(r, Err(RpcError::ResponseTooLarge { .. })), "{r:?}");
        let p = pattern(100, 1);
        assert_eq!(c.call(method::ECHO, p.clone()).await.expect("next"), p);
    }

    /// Malformed RPC headers make the server close that connection (promptly, no hang) and
    /// keep serving others.
    pub async fn rpc_malformed_headers_close_connection<B: Backend>(b: &B) {
        use transport_rpc::{Kind, RpcHeader};
        let srv = start_server(b, MIB).await;
        let good = RpcHeader::new(Kind::Request, method::ECHO, 1, 3).encode();
        let mut bad_magic = good;
        bad_magic[0] = b'X';
        let mut bad_version = good;
        bad_version[2] = 77;
        let mut bad_kind = good;
        bad_kind[3] = 200;
        let wrong_len = RpcHeader::new(Kind::Request, method::ECHO, 1, 5).encode();
        let from_server = RpcHeader::new(Kind::Response, 0, 1, 3).encode();
        let cases: [(&str, &[u8]); 6] = [
            ("bad magic", &bad_magic),
            ("bad version", &bad_version),
            ("unknown kind", &bad_kind),
            ("length mismatch", &wrong_len),
            ("server-only kind", &from_server),
            ("truncated header", &good[..10]),
        ];
        for (what, h) in cases {
            let conn = b.transport(MIB).connect(&srv.addr).await.expect("connect");
            let (mut tx, mut rx) = conn.split();
            tx.send(Message::new(header(h), Bytes::from_static(b"abc")))
                .await
                .expect("send");
            let r = tokio::time::timeout(PROMPT, rx.recv()).await;
            match r {
                Ok(Ok(None)) | Ok(Err(_)) => {}
                Ok(Ok(Some(m))) => panic!("{what}: the server answered {m:?}"),
                Err(_) => panic!("{what}: the server neither answered nor closed"),
            }
        }
        let c = client(b, &srv.addr, MIB).await;
        assert!(
            c.call(method::ECHO, Bytes::new()).await.is_ok(),
            "server still serves"
        );
    }

    /// When the peer closes with calls pending, each fails with a connection error at once,
    /// and so does every later call.
    pub async fn rpc_peer_closes_with_calls_pending<B: Backend>(b: &B) {
        let mut listener = b
            .transport(MIB)
            .listen(&b.listen_addr())
            .await
            .expect("listen");
        let addr = listener.local_addr().expect("addr");
        let c = client(b, &addr, MIB).await;
        let server = listener.accept().await.expect("accept");
        let mut calls = vec![];
        for _ in 0..5 {
            let c = c.clone();
            calls.push(tokio::spawn(async move {
                c.call_with(
                    method::ECHO,
                    Bytes::new(),
                    CallOptions::deadline(Duration::from_secs(60)),
                )
                .await
            }));
        }
        let (stx, mut srx) = server.split();
        for _ in 0..5 {
            srx.recv().await.expect("recv").expect("request");
        }
        let start = Instant::now();
        drop((stx, srx));
        for call in calls {
            let r = call.await.expect("task");
            match r {
                Err(e) if e.is_connection_error() => {}
                other => panic!("expected a connection error, got {other:?}"),
            }
        }
        assert!(start.elapsed() < PROMPT, "pending calls failed late");
        let r = c.call(method::ECHO, Bytes::new()).await;
        assert!(matches!(r, Err(ref e) if e.is_connection_error()), "{r:?}");
    }

    /// Graceful shutdown: a call in flight completes, then the connection closes.
    pub async fn rpc_graceful_shutdown<B: Backend>(b: &B) {
        let srv = start_server(b, MIB).await;
        let c = client(b, &srv.addr, MIB).await;
        let c2 = c.clone();
        let slow = tokio::spawn(async move {
            c2.call(method::SLOW_ECHO, Bytes::from_static(&[250, 1, 2]))
                .await
        });
        // Shut down while the call's handler runs (it holds the call for 250 ms).
        wait_until("the SLOW_ECHO handler to start", PROMPT, || {
            srv.state.started.load(Ordering::SeqCst) >= 1
        })
        .await;
        let start = Instant::now();
        srv.server.shutdown().await;
        assert!(start.elapsed() < PROMPT);
        let r = slow.await.expect("task");
        assert_eq!(
            r.expect("the call in flight completes").as_ref(),
            &[250, 1, 2]
        );
        let r = c.call(method::ECHO, Bytes::new()).await;
        assert!(matches!(r, Err(ref e) if e.is_connection_error()), "{r:?}");
    }

    /// The server process is killed (SIGKILL) while it streams a large response and while
    /// other calls wait: every pending call fails promptly with a typed connection error, never
    /// a hang, a clean end or a short reply. The response cut mid-way fails with
    /// [`TransportError::Truncated`] (how much of how much arrived), and so does every other
    /// call pending on the connection. The kill may also land only once the whole response has
    /// arrived (an RDMA READ of the dying process's memory can finish while its kernel objects
    /// are torn down): then the response is complete and the other calls fail with a
    /// connection error that is not `Truncated`, since nothing was cut.
    pub async fn peer_process_killed_mid_transfer<B: Backend>(b: &B) {
        /// How long the response may take to start arriving (the child makes it first).
        const START_WITHIN: Duration = Duration::from_secs(60);
        let (mut child, addr) = spawn_child_server::<<B::T as Transport>::Addr>(
            "conformance_capabilities",
            CHILD_ENV,
            CHILD_READY,
        )
        .await;
        let c = client(b, &addr, 128 * MIB).await;
        let mut calls = vec![];
        for _ in 0..3 {
            let c = c.clone();
            calls.push(tokio::spawn(async move {
                c.call_with(
                    method::HANG,
                    Bytes::new(),
                    CallOptions::deadline(Duration::from_secs(60)),
                )
                .await
                .map(|_| ())
            }));
        }
        // The large call goes out behind the HANG calls, so the child has read every request
        // before it blocks writing the response. A process killed with unread bytes in its
        // socket makes the kernel reset the connection (TCP RST; ECONNRESET on a Unix socket)
        // instead of ending it after the bytes it sent, and the receiver then gets that I/O
        // error, not the end of the stream it would report as `Truncated`. (A call's request
        // is queued, in order, in the poll that counts it in `in_flight`.)
        wait_until("the HANG requests to be queued", PROMPT, || {
            c.in_flight() == 3
        })
        .await;
        let c2 = c.clone();
        let want = 96 * MIB as u64;
        let give = tokio::spawn(async move {
            c2.call_with(
                method::GIVE_FILLED,
                Bytes::copy_from_slice(&want.to_le_bytes()),
                CallOptions::deadline(Duration::from_secs(60)),
            )
            .await
            .map(|reply| reply.len() as u64)
        });
        // Kill once part of the large response has arrived (nothing else is answered: every
        // byte received belongs to it).
        let start = Instant::now();
        while c.metrics().snapshot().bytes_received < MIB as u64 {
            if give.is_finished() {
                panic!("the large call ended before the kill: {:?}", give.await);
            }
            if let Some(i) = calls.iter().position(|c| c.is_finished()) {
                panic!(
                    "a HANG call ended before the kill: {:?}",
                    calls.remove(i).await
                );
            }
            assert!(
                start.elapsed() < START_WITHIN,
                "the {want}-byte response had not started arriving {START_WITHIN:?} after the \
                 call ({} bytes received)",
                c.metrics().snapshot().bytes_received
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let received_at_kill = c.metrics().snapshot().bytes_received;
        child.kill().await.expect("kill child");
        let (give, hangs) = tokio::time::timeout(PROMPT, async {
            let give = give.await.expect("task");
            let mut hangs = vec![];
            for call in calls {
                hangs.push(call.await.expect("task"));
            }
            (give, hangs)
        })
        .await
        .expect("the pending calls failed promptly after the kill");
        let hang_errors: Vec<RpcError> = hangs
            .into_iter()
            .map(|r| match r {
                Ok(()) => panic!("a HANG call returned although its handler never answers"),
                Err(RpcError::DeadlineExceeded(_)) => panic!("a call waited for its deadline"),
                Err(e) if e.is_connection_error() => e,
                Err(other) => panic!("expected a connection error, got {other:?}"),
            })
            .collect();
        /// The connection's cause, if it is a message cut mid-way.
        fn truncated(e: &RpcError) -> Option<(u64, u64)> {
            match e {
                RpcError::ConnectionLost(t) => match **t {
                    TransportError::Truncated { received, expected } => Some((received, expected)),
                    _ => None,
                },
                _ => None,
            }
        }
        match give {
            // The kill landed before the response was whole: its receive failed, saying so.
            Err(e) => {
                let Some((received, expected)) = truncated(&e) else {
                    panic!(
                        "the response was cut after {received_at_kill} bytes had arrived: \
                         expected a Truncated connection loss, got {e:?}"
                    );
                };
                assert!(
                    expected >= want && received < expected,
                    "Truncated after {received} of {expected} bytes, for a {want}-byte payload"
                );
                for h in &hang_errors {
                    assert_eq!(
                        truncated(h),
                        Some((received, expected)),
                        "a call pending on the connection failed with another cause: {h:?}"
                    );
                }
                eprintln!(
                    "peer killed after {received_at_kill} bytes of a {want}-byte response: \
                     Truncated ({received} of {expected} bytes)"
                );
            }
            // The whole response arrived before the kill landed: it must be complete, and the
            // connection then ended between messages.
            Ok(len) => {
                assert_eq!(len, want, "a response cut short was delivered");
                for h in &hang_errors {
                    assert!(
                        truncated(h).is_none(),
                        "nothing was cut, yet a call failed with {h:?}"
                    );
                }
                eprintln!(
                    "peer killed after {received_at_kill} bytes; the {want}-byte response was \
                     complete before the kill landed; the other calls failed with {:?}",
                    hang_errors.first()
                );
            }
        }
    }
}
