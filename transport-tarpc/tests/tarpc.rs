//! tarpc over every backend: the same cases per transport (`tarpc_tests!` lines at the end;
//! the verbs line runs in the soft-RoCE guest, `cargo xtask testbed verbs`).

use bytes::Bytes;
use futures_util::{future, SinkExt, StreamExt};
use std::time::{Duration, Instant};
use tarpc::client::RpcError;
use tarpc::context::{self, Context};
use tarpc::server::{BaseChannel, Channel};
use transport_core::{Connection, HeaderBytes, Listener, Message, MessageSender, Transport};
use transport_tarpc::{Error, MessageTransport, Payload};
use transport_test::conformance::{pattern, Backend, PROMPT};

use transport_tcp::conformance::TcpBackend as Tcp;
use transport_uds::conformance::UdsBackend as Uds;
use transport_verbs::conformance::VerbsBackend;

const MIB: usize = 1 << 20;

#[tarpc::service]
trait Echo {
    /// Nothing in, nothing out.
    async fn ping();
    /// The bytes back.
    async fn echo(data: Bytes) -> Bytes;
}

#[derive(Clone)]
struct EchoServer;

#[tarpc::service]
trait Blob {
    /// The payload back, as it came (a slice of the request's message).
    async fn echo(data: Payload) -> Payload;
}

#[derive(Clone)]
struct BlobServer;

impl Blob for BlobServer {
    async fn echo(self, _: Context, data: Payload) -> Payload {
        data
    }
}

impl Echo for EchoServer {
    async fn ping(self, _: Context) {}
    async fn echo(self, _: Context, data: Bytes) -> Bytes {
        data
    }
}

/// A context whose deadline leaves room for large calls in the emulated guest.
fn ctx() -> Context {
    let mut c = context::current();
    c.deadline = Instant::now() + Duration::from_secs(60);
    c
}

/// A transport of `b` with messages up to `max` bytes, listening; its address.
async fn listen<B: Backend>(
    b: &B,
    max: usize,
) -> (
    B::T,
    <B::T as Transport>::Listener,
    <B::T as Transport>::Addr,
) {
    let t = b.transport(max);
    let l = t.listen(&b.listen_addr()).await.unwrap();
    let addr = l.local_addr().unwrap();
    (t, l, addr)
}

/// Serves [`EchoServer`] on every connection `listener` accepts, each request on a task.
fn serve_echo<L: Listener>(listener: L) -> tokio::task::JoinHandle<()> {
    tokio::spawn(
        transport_tarpc::incoming(listener)
            .filter_map(|t| future::ready(t.ok()))
            .for_each(|t| {
                let requests = BaseChannel::with_defaults(t).execute(EchoServer.serve());
                tokio::spawn(requests.for_each(|call| async {
                    tokio::spawn(call);
                }));
                future::ready(())
            }),
    )
}

/// A generated client over a new connection to `addr`.
async fn client<T: Transport>(t: &T, addr: &T::Addr) -> EchoClient {
    let transport = transport_tarpc::connect(t, addr).await.unwrap();
    EchoClient::new(tarpc::client::Config::default(), transport).spawn()
}

/// Calls from many tasks on one connection, of sizes from nothing to past the eager and
/// inline limits, each get their own reply, byte-exact.
async fn concurrent_calls_each_get_their_own_reply<B: Backend>(b: &B) {
    let (t, l, addr) = listen(b, 4 * MIB).await;
    let server = serve_echo(l);
    let c = client(&t, &addr).await;
    c.ping(ctx()).await.unwrap();
    let sizes = [0, 1, 100, 4096, 70_000, 300_000];
    let tasks: Vec<_> = (0..16)
        .map(|task| {
            let c = c.clone();
            tokio::spawn(async move {
                for (i, &n) in sizes.iter().cycle().skip(task).take(12).enumerate() {
                    let data = pattern(n, (task * 31 + i) as u64);
                    let back = c.echo(ctx(), data.clone()).await.unwrap();
                    assert!(back == data, "task {task} call {i}: {n} bytes differ");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    server.abort();
}

/// An 8 MiB echo: one message each way, whole.
async fn a_large_echo_round_trips<B: Backend>(b: &B) {
    let (t, l, addr) = listen(b, 9 * MIB).await;
    let server = serve_echo(l);
    let c = client(&t, &addr).await;
    let data = pattern(8 * MIB, 5);
    let back = c.echo(ctx(), data.clone()).await.unwrap();
    assert!(back == data, "8 MiB differ");
    server.abort();
}

/// An item over the peer's message limit fails in `start_send` with `TooLarge`, nothing of
/// it reaches the peer, and the next item goes through.
async fn an_item_over_the_limit_fails_before_sending<B: Backend>(b: &B) {
    let max = 64 << 10;
    let (t, mut l, addr) = listen(b, max).await;
    let (conn, accepted) = tokio::join!(t.connect(&addr), l.accept());
    let mut tx: MessageTransport<_, (), Bytes> = MessageTransport::new(conn.unwrap());
    let mut rx: MessageTransport<_, Bytes, ()> = MessageTransport::new(accepted.unwrap());
    assert_eq!(tx.max_item_size(), max);
    match tx.send(Bytes::from(vec![1; max])).await {
        Err(Error::TooLarge { len, max: m }) => assert!(len > max && m == max, "{len} {m}"),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let small = pattern(1000, 9);
    tx.send(small.clone()).await.unwrap();
    tx.close().await.unwrap();
    let got = tokio::time::timeout(PROMPT, rx.next()).await.unwrap();
    assert!(
        got.unwrap().unwrap() == small,
        "the small item after the refused one"
    );
    let end = tokio::time::timeout(PROMPT, rx.next()).await.unwrap();
    assert!(end.is_none(), "exactly one item arrived, then the end");
}

/// A peer that sends messages that are not this service's items (a header that is not an
/// item, a payload beside a header-form item that takes none, bytes after the value, a value
/// cut short, a length past the message) gets a typed error for each; the next well-formed
/// item still decodes, and a clean close ends the stream.
async fn messages_not_of_this_service_are_typed_errors<B: Backend>(b: &B) {
    let (t, mut l, addr) = listen(b, MIB).await;
    let (conn, accepted) = tokio::join!(t.connect(&addr), l.accept());
    let (mut raw, _raw_rx) = conn.unwrap().split();
    let mut rx: MessageTransport<_, Vec<u32>, ()> = MessageTransport::new(accepted.unwrap());
    let good = postcard::to_allocvec(&vec![1u32, 2, 3]).unwrap();
    let mut trailing = good.clone();
    trailing.push(0);
    let sent = [
        Message::new(HeaderBytes::new(b"hdr").unwrap(), Bytes::from(good.clone())),
        Message::new(HeaderBytes::new(&good).unwrap(), Bytes::from_static(b"xy")),
        Message::new(HeaderBytes::EMPTY, Bytes::from(trailing)),
        Message::new(
            HeaderBytes::EMPTY,
            Bytes::from(good[..good.len() - 1].to_vec()),
        ),
        Message::new(
            HeaderBytes::EMPTY,
            Bytes::from_static(&[0xff, 0xff, 0xff, 0x7f]),
        ),
        Message::new(HeaderBytes::EMPTY, Bytes::from(good)),
    ];
    for m in sent {
        raw.send(m).await.unwrap();
    }
    raw.close().await.unwrap();
    let mut got = Vec::new();
    while let Some(item) = tokio::time::timeout(PROMPT, rx.next()).await.unwrap() {
        got.push(item);
    }
    assert_eq!(got.len(), 6, "{got:?}");
    assert!(matches!(got[0], Err(Error::Decode(_))), "{got:?}");
    assert!(matches!(got[1], Err(Error::TrailingBytes(2))), "{got:?}");
    assert!(matches!(got[2], Err(Error::TrailingBytes(1))), "{got:?}");
    assert!(matches!(got[3], Err(Error::Decode(_))), "{got:?}");
    assert!(matches!(got[4], Err(Error::Decode(_))), "{got:?}");
    assert_eq!(got[5].as_ref().unwrap(), &vec![1, 2, 3]);
}

/// A server that drops the connection with a call outstanding: the client's call fails
/// promptly instead of waiting for its deadline.
async fn the_client_sees_the_server_go<B: Backend>(b: &B) {
    let (t, mut l, addr) = listen(b, MIB).await;
    let server = tokio::spawn(async move {
        let conn = l.accept().await.unwrap();
        let mut rx: transport_tarpc::ServerTransport<_, EchoRequest, EchoResponse> =
            MessageTransport::new(conn);
        let first = rx.next().await;
        assert!(matches!(first, Some(Ok(_))), "the request arrives");
        drop(rx);
    });
    let c = client(&t, &addr).await;
    let call = tokio::time::timeout(PROMPT, c.echo(ctx(), Bytes::from_static(b"lost")))
        .await
        .expect("the call did not end after the server dropped the connection");
    assert!(
        matches!(call, Err(RpcError::Shutdown) | Err(RpcError::Channel(_))),
        "{call:?}"
    );
    server.await.unwrap();
}

/// Items are encoded into the transport's pool: 1 MiB items are sent without a payload copy
/// when the pool serves that size (registered memory on verbs, the heap on sockets).
async fn large_items_are_sent_from_the_pool_without_a_copy<B: Backend>(b: &B) {
    let (t, mut l, addr) = listen(b, 2 * MIB).await;
    let (conn, accepted) = tokio::join!(t.connect(&addr), l.accept());
    let conn = conn.unwrap();
    let metrics = conn.metrics();
    let mut tx: MessageTransport<_, (), Bytes> = MessageTransport::new(conn);
    let mut rx: MessageTransport<_, Bytes, ()> = MessageTransport::new(accepted.unwrap());
    let reader = tokio::spawn(async move {
        let mut n = 0;
        while let Some(item) = rx.next().await {
            assert!(item.unwrap() == pattern(MIB, n as u64), "item {n} differs");
            n += 1;
        }
        n
    });
    for i in 0..8u64 {
        tx.feed(pattern(MIB, i)).await.unwrap();
    }
    tx.close().await.unwrap();
    assert_eq!(reader.await.unwrap(), 8);
    assert_eq!(
        metrics.snapshot().payload_bytes_copied,
        0,
        "the sender copied payload bytes"
    );
}

/// A `Payload` beside a small envelope travels apart from it: the envelope in the transport
/// header, the payload as the message's payload (built in the pool: no copy on any backend
/// once it is too large to go inline; verbs copies a payload of a few bytes into the work
/// request by design, its inline send); a generated client and server carry payloads whole,
/// from nothing to 1 MiB.
async fn payloads_travel_apart_from_a_small_envelope<B: Backend>(b: &B) {
    let (t, mut l, addr) = listen(b, 2 * MIB).await;
    let (conn, accepted) = tokio::join!(t.connect(&addr), l.accept());
    let conn = conn.unwrap();
    let metrics = conn.metrics();
    let mut tx: MessageTransport<_, (), (u64, Payload)> = MessageTransport::new(conn);
    let pool = tx.buffer_pool();
    let (_raw_tx, mut raw_rx) = accepted.unwrap().split();
    let mut copied_before_large = 0;
    for (i, n) in [0, 1, 4096, MIB].into_iter().enumerate() {
        if n == 4096 {
            copied_before_large = metrics.snapshot().payload_bytes_copied;
        }
        let data = pattern(n, i as u64);
        let mut buf = pool.alloc(n);
        bytes::BufMut::put_slice(&mut buf, &data);
        tx.send((i as u64, Payload(buf.freeze()))).await.unwrap();
        let m = tokio::time::timeout(PROMPT, transport_core::MessageReceiver::recv(&mut raw_rx))
            .await
            .unwrap()
            .unwrap()
            .expect("a message");
        assert_eq!(
            m.header.as_slice(),
            [i as u8, 0],
            "the id and an empty stand-in"
        );
        assert!(m.payload == data, "{n} bytes differ");
    }
    assert!(
        copied_before_large <= 1,
        "more than the 1-byte payload's inline copy: {copied_before_large}"
    );
    assert_eq!(
        metrics.snapshot().payload_bytes_copied,
        copied_before_large,
        "the sender copied the 4 KiB or the 1 MiB payload"
    );

    let (t, l, addr) = listen(b, 2 * MIB).await;
    let server = tokio::spawn(
        transport_tarpc::incoming(l)
            .filter_map(|t| future::ready(t.ok()))
            .for_each(|t| {
                let requests = BaseChannel::with_defaults(t).execute(BlobServer.serve());
                tokio::spawn(requests.for_each(|call| call));
                future::ready(())
            }),
    );
    let transport = transport_tarpc::connect(&t, &addr).await.unwrap();
    let c = BlobClient::new(tarpc::client::Config::default(), transport).spawn();
    for n in [0, 100, 70_000, MIB] {
        let data = pattern(n, n as u64);
        let back = c.echo(ctx(), Payload(data.clone())).await.unwrap();
        assert!(back.0 == data, "{n} bytes differ");
    }
    server.abort();
}

macro_rules! tarpc_tests {
    ($module:ident, $backend:expr $(, #[$attr:meta])*) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            transport_test::backend_cases!([super::] $backend, $(#[$attr])*;
                concurrent_calls_each_get_their_own_reply,
                a_large_echo_round_trips,
                an_item_over_the_limit_fails_before_sending,
                messages_not_of_this_service_are_typed_errors,
                the_client_sees_the_server_go,
                large_items_are_sent_from_the_pool_without_a_copy,
                payloads_travel_apart_from_a_small_envelope);
        }
    };
}

tarpc_tests!(tcp, Tcp);
tarpc_tests!(uds, Uds);
tarpc_tests!(
    verbs,
    VerbsBackend::for_this_machine(),
    #[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
);
