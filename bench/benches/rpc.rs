//! Round trips over UDS and TCP: raw message ping-pong on the backend connection, and an RPC
//! call of `void o()` and of a 64 KB echo through `RpcClient` / `RpcServer`.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::{Duration, Instant};
use tokio::runtime::Runtime;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_rpc::{ClientConfig, Request, RpcClient, RpcServer, ServerConfig, Status};
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Starts an echo RPC server and a raw echo server on their own thread; returns their addresses.
fn servers<T: Transport + Clone>(t: T, rpc_addr: T::Addr, raw_addr: T::Addr) -> (T::Addr, T::Addr) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        runtime().block_on(async move {
            let rpc_l = t.listen(&rpc_addr).await.expect("listen");
            let mut raw_l = t.listen(&raw_addr).await.expect("listen");
            tx.send((rpc_l.local_addr().unwrap(), raw_l.local_addr().unwrap()))
                .unwrap();
            let server = RpcServer::new(
                |r: Request| async move { Ok::<_, Status>(r.payload) },
                ServerConfig::default(),
            );
            tokio::spawn(async move { server.serve(rpc_l).await });
            loop {
                let conn = raw_l.accept().await.expect("accept");
                tokio::spawn(async move {
                    let (mut s, mut r) = conn.split();
                    while let Ok(Some(m)) = r.recv().await {
                        if s.send(m).await.is_err() {
                            break;
                        }
                    }
                });
            }
        })
    });
    rx.recv().expect("server started")
}

fn round_trips<T: Transport + Clone>(
    c: &mut Criterion,
    name: &str,
    t: T,
    rpc: T::Addr,
    raw: T::Addr,
) {
    let (rpc_addr, raw_addr) = servers(t.clone(), rpc, raw);
    let rt = runtime();
    let client = rt.block_on(async {
        RpcClient::new(
            t.connect(&rpc_addr).await.expect("connect"),
            ClientConfig::default(),
        )
    });
    let (mut tx, mut rx) = rt
        .block_on(async { t.connect(&raw_addr).await.expect("connect") })
        .split();

    let mut g = c.benchmark_group(format!("{name}/round_trip"));
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("raw_1B", |b| {
        let one = Bytes::from_static(b"p");
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    tx.send(Message::new(HeaderBytes::EMPTY, one.clone()))
                        .await
                        .unwrap();
                    rx.recv().await.unwrap().unwrap();
                }
                start.elapsed()
            })
        })
    });
    g.bench_function("rpc_void", |b| {
        b.iter_custom(|iters| {
            // In a spawned task, as an application would call.
            let client = client.clone();
            rt.block_on(rt.spawn(async move {
                let start = Instant::now();
                for _ in 0..iters {
                    client.call(0, Bytes::new()).await.unwrap();
                }
                start.elapsed()
            }))
            .unwrap()
        })
    });
    let big = Bytes::from(vec![7u8; 64 << 10]);
    g.throughput(Throughput::Bytes(2 * big.len() as u64));
    g.bench_function("rpc_echo_64KB", |b| {
        b.iter_custom(|iters| {
            let (client, big) = (client.clone(), big.clone());
            rt.block_on(rt.spawn(async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let r = client.call(1, big.clone()).await.unwrap();
                    assert_eq!(r.len(), big.len());
                }
                start.elapsed()
            }))
            .unwrap()
        })
    });
    g.finish();
}

fn rpc(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    round_trips(
        c,
        "uds",
        UdsTransport::default(),
        UdsAddr(dir.path().join("rpc.sock")),
        UdsAddr(dir.path().join("raw.sock")),
    );
    let any = "127.0.0.1:0".parse().expect("addr");
    round_trips(c, "tcp", TcpTransport::default(), any, any);
}

criterion_group!(benches, rpc);
criterion_main!(benches);
