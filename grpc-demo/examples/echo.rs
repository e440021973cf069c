//! The Echo service over one transport, both ways: tonic through the byte-stream adapter, and
//! the native RPC layer.
//!
//! ```text
//! cargo run -p grpc-demo --example echo -- uds     # or tcp, verbs
//! ```

use bytes::Bytes;
use futures_util::StreamExt;
use grpc_demo::{grpc, native, pb};
use std::error::Error;
use transport_core::{Listener, Transport};
use transport_stream::{ByteStreamConfig, StreamListener};

type Result<T> = std::result::Result<T, Box<dyn Error + Send + Sync>>;

/// Serves Echo with tonic and natively on `transport`, calls each method once, prints what came back.
async fn run<T: Transport + Clone>(transport: T, addr: impl Fn() -> T::Addr) -> Result<()> {
    // gRPC: tonic's server on the adapter's listener, tonic's client through the adapter's connector.
    let listener = StreamListener::bind(&transport, &addr(), ByteStreamConfig::default()).await?;
    let grpc_addr = listener.local_addr()?;
    tokio::spawn(grpc::serve(listener, std::future::pending()));
    let mut client = grpc::connect(transport.clone(), grpc_addr.clone()).await?;

    let reply = client
        .unary(pb::EchoRequest {
            payload: Bytes::from_static(b"hello over gRPC"),
        })
        .await?
        .into_inner();
    println!(
        "gRPC   unary   -> {:?}",
        String::from_utf8_lossy(&reply.payload)
    );
    let mut stream = client
        .server_stream(pb::StreamRequest {
            count: 5,
            size: 1000,
        })
        .await?
        .into_inner();
    let mut n = 0;
    while let Some(r) = stream.message().await? {
        n += r.payload.len();
    }
    println!("gRPC   stream  -> {n} bytes in 5 replies");
    let requests = futures_util::stream::iter((0..3).map(|i| pb::EchoRequest {
        payload: Bytes::from(format!("bidi {i}")),
    }));
    let replies: Vec<_> = client.bidi(requests).await?.into_inner().collect().await;
    println!("gRPC   bidi    -> {} replies", replies.len());

    // Native RPC: the transport's own listener and connection, one message per call.
    let listener = transport.listen(&addr()).await?;
    let native_addr = listener.local_addr()?;
    let server = native::server();
    tokio::spawn({
        let s = server.clone();
        async move { s.serve(listener).await }
    });
    let client = native::NativeEcho::new(transport.connect(&native_addr).await?);
    let reply = client
        .unary(Bytes::from_static(b"hello over native RPC"))
        .await?;
    println!("native unary   -> {:?}", String::from_utf8_lossy(&reply));
    let fetched = futures_util::future::try_join_all((0..5).map(|_| client.fetch(1000))).await?;
    let n: usize = fetched.iter().map(|b| b.len()).sum();
    println!("native fetch   -> {n} bytes in 5 pipelined calls");
    server.shutdown().await;
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let which = std::env::args().nth(1).unwrap_or_else(|| "uds".into());
    match pick(&which).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("echo over {which}: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn pick(which: &str) -> Result<()> {
    match which {
        "uds" => {
            let dir = tempfile::tempdir()?;
            let n = std::sync::atomic::AtomicU32::new(0);
            let base = dir.path().to_path_buf();
            run(transport_uds::UdsTransport::default(), move || {
                let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                transport_uds::UdsAddr(base.join(format!("echo{i}.sock")))
            })
            .await
        }
        "tcp" => {
            run(transport_tcp::TcpTransport::default(), || {
                "127.0.0.1:0".parse().expect("address")
            })
            .await
        }
        "verbs" => {
            let ip = transport_verbs::local_rdma_ip()?;
            let t = transport_verbs::VerbsTransport::new(transport_verbs::VerbsConfig::default())?;
            run(t, move || std::net::SocketAddr::new(ip, 0)).await
        }
        other => Err(format!("unknown transport `{other}` (uds, tcp, verbs)").into()),
    }
}
