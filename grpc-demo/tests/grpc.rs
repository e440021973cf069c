//! tonic over every transport (through transport-stream), and the native RPC twin of the
//! service: the same test bodies per transport.
//!
//! A backend is one `service_tests!(module, BackendExpr)` line; the backend type is the
//! conformance suite's [`Backend`], which every transport's tests implement (verbs too).

use bytes::Bytes;
use grpc_demo::{grpc, native, pattern, pb};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use transport_core::{Listener, Transport};
use transport_stream::{ByteStreamConfig, StreamListener};
use transport_test::conformance::{Backend, PROMPT};

const MAX: usize = 64 << 20;

use transport_tcp::conformance::TcpBackend as Tcp;
use transport_uds::conformance::UdsBackend as Uds;
use transport_verbs::conformance::VerbsBackend;

type Addr<B> = <<B as Backend>::T as Transport>::Addr;

/// A gRPC server on its own runtime: shutting that runtime down drops every connection at
/// once without closing the streams, as a crashing server process would.
struct DoomedServer<A> {
    rt: tokio::runtime::Runtime,
    addr: A,
}

impl<A: Send + 'static> DoomedServer<A> {
    fn kill(self) {
        self.rt.shutdown_background();
    }
}

async fn grpc_server<B: Backend>(b: &B) -> DoomedServer<Addr<B>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = oneshot::channel();
    let t = b.transport(MAX);
    let listen = b.listen_addr();
    rt.spawn(async move {
        let l = StreamListener::bind(&t, &listen, ByteStreamConfig::default())
            .await
            .unwrap();
        tx.send(l.local_addr().unwrap()).unwrap();
        grpc::serve(l, std::future::pending()).await
    });
    DoomedServer {
        addr: rx.await.unwrap(),
        rt,
    }
}

async fn grpc_unary_sizes<B: Backend>(b: &B) {
    let server = grpc_server(b).await;
    let mut client = grpc::connect(b.transport(MAX), server.addr.clone())
        .await
        .unwrap();
    for (i, size) in [0, 1, 1000, 64 << 10, 3 << 20].into_iter().enumerate() {
        let payload = pattern(size, i as u64);
        let reply = client
            .unary(pb::EchoRequest {
                payload: payload.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(reply.payload == payload, "echo of {size} bytes differs");
    }
    server.kill();
}

async fn grpc_server_stream<B: Backend>(b: &B) {
    let server = grpc_server(b).await;
    let mut client = grpc::connect(b.transport(MAX), server.addr.clone())
        .await
        .unwrap();
    let expect = pattern(10_000, 7);
    let mut stream = client
        .server_stream(pb::StreamRequest {
            count: 300,
            size: 10_000,
        })
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while let Some(reply) = stream.message().await.unwrap() {
        assert_eq!(reply.seq, n);
        assert!(reply.payload == expect, "reply {n} differs");
        n += 1;
    }
    assert_eq!(n, 300);
    server.kill();
}

async fn grpc_bidi<B: Backend>(b: &B) {
    let server = grpc_server(b).await;
    let mut client = grpc::connect(b.transport(MAX), server.addr.clone())
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(4);
    let sender = tokio::spawn(async move {
        for i in 0..100u64 {
            let payload = pattern(i as usize * 997, i);
            tx.send(pb::EchoRequest { payload }).await.unwrap();
        }
    });
    let mut replies = client
        .bidi(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut n = 0u64;
    while let Some(r) = replies.message().await.unwrap() {
        assert_eq!(r.seq, n);
        assert!(
            r.payload == pattern(n as usize * 997, n),
            "bidi reply {n} differs"
        );
        n += 1;
    }
    assert_eq!(n, 100);
    sender.await.unwrap();
    server.kill();
}

async fn grpc_concurrent_unary<B: Backend>(b: &B) {
    let server = grpc_server(b).await;
    let client = grpc::connect(b.transport(MAX), server.addr.clone())
        .await
        .unwrap();
    let calls = (0..64u64).map(|i| {
        let mut c = client.clone();
        async move {
            let payload = pattern(1000 + i as usize, i);
            let r = c
                .unary(pb::EchoRequest {
                    payload: payload.clone(),
                })
                .await
                .unwrap();
            r.into_inner().payload == payload
        }
    });
    let ok = futures_util::future::join_all(calls).await;
    assert!(ok.iter().all(|&x| x), "a concurrent echo differs");
    server.kill();
}

/// The server dies while streaming: the client's stream ends in a `tonic::Status` error
/// (not a hang, not a clean end), and later calls fail promptly too.
async fn grpc_server_dies_mid_stream<B: Backend>(b: &B) {
    let server = grpc_server(b).await;
    let mut client = grpc::connect(b.transport(MAX), server.addr.clone())
        .await
        .unwrap();
    let mut stream = client
        .server_stream(pb::StreamRequest {
            count: u32::MAX,
            size: 64 << 10,
        })
        .await
        .unwrap()
        .into_inner();
    for _ in 0..10 {
        stream.message().await.unwrap().expect("stream item");
    }
    server.kill();
    let end = tokio::time::timeout(PROMPT, async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue, // items already in flight
                other => break other,
            }
        }
    })
    .await
    .expect("client stream hung after the server died");
    let status = end.expect_err("a dead server must end the stream with an error, not cleanly");
    assert_ne!(status.code(), tonic::Code::Ok);

    let next = tokio::time::timeout(PROMPT, client.unary(pb::EchoRequest::default()))
        .await
        .expect("unary call hung after the server died");
    assert!(next.is_err(), "a call to a dead server succeeded");
}

/// The client dies mid-stream: the server notices (its stream is dropped) and keeps serving
/// other clients.
async fn grpc_client_dies_mid_stream<B: Backend>(b: &B) {
    let server = grpc_server(b).await;
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = oneshot::channel();
    let (t, addr) = (b.transport(MAX), server.addr.clone());
    client_rt.spawn(async move {
        let mut c = grpc::connect(t, addr).await.unwrap();
        let mut s = c
            .server_stream(pb::StreamRequest {
                count: u32::MAX,
                size: 64 << 10,
            })
            .await
            .unwrap()
            .into_inner();
        s.message().await.unwrap().unwrap();
        tx.send(()).unwrap();
        std::future::pending::<()>().await;
    });
    rx.await.unwrap();
    client_rt.shutdown_background();

    let mut other = grpc::connect(b.transport(MAX), server.addr.clone())
        .await
        .unwrap();
    let r = tokio::time::timeout(
        PROMPT,
        other.unary(pb::EchoRequest {
            payload: "still up".into(),
        }),
    )
    .await
    .expect("server stuck after a client died")
    .unwrap();
    assert_eq!(r.into_inner().payload, "still up");
    server.kill();
}

/// The same service on the native RPC layer: unary, pipelined fetches (the streaming call's
/// equivalent) and a server death that fails calls with a typed error.
async fn native_service<B: Backend>(b: &B) {
    let t = b.transport(MAX);
    let listener = t.listen(&b.listen_addr()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = native::server();
    let serving = tokio::spawn({
        let s = server.clone();
        async move { s.serve(listener).await }
    });
    let client = native::NativeEcho::new(t.connect(&addr).await.unwrap());
    for size in [0, 1, 64 << 10, 3 << 20] {
        let p = pattern(size, 3);
        assert!(
            client.unary(p.clone()).await.unwrap() == p,
            "echo of {size} differs"
        );
    }
    let fetches = (0..100).map(|_| client.fetch(10_000));
    let expect = pattern(10_000, 7);
    for r in futures_util::future::join_all(fetches).await {
        assert!(r.unwrap() == expect, "fetched payload differs");
    }
    server.shutdown().await;
    serving.await.unwrap().unwrap();
    let r = tokio::time::timeout(PROMPT, client.unary(Bytes::from_static(b"x")))
        .await
        .expect("call hung after the server shut down");
    assert!(r.is_err(), "call succeeded on a closed server");
}

macro_rules! service_tests {
    ($module:ident, $backend:expr $(, #[$attr:meta])*) => {
        mod $module {
            use super::*;
            transport_test::backend_cases!([super::] $backend, $(#[$attr])*;
                grpc_unary_sizes,
                grpc_server_stream,
                grpc_bidi,
                grpc_concurrent_unary,
                grpc_server_dies_mid_stream,
                grpc_client_dies_mid_stream,
                native_service
            );
        }
    };
}

service_tests!(tcp, Tcp);
service_tests!(uds, Uds);
service_tests!(
    verbs,
    VerbsBackend::for_this_machine(),
    #[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
);
