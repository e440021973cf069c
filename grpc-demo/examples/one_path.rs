//! One framework path alone in its process, for counting what it costs per call with
//! `strace -f -c` or callgrind (the difference of two call counts cancels set-up):
//!
//! ```text
//! one_path PATH TRANSPORT CALLS
//!   native uds|tcp   native RPC (transport_rpc)
//!   tarpc  uds|tcp   tarpc on the transport's messages (transport-tarpc)
//!   serde  tcp       tarpc on its own serde_transport (bincode, length-delimited)
//!   tarpc  mem       tarpc on an in-memory channel: tarpc's own work, no I/O at all
//! ```
//!
//! CALLS echoes of 64 bytes (after 200 warm-up calls, and one 1 MiB echo on the sockets),
//! client and server in this process on one current-thread runtime, as `bench scenario
//! framework` runs them; prints the calls per second.

use grpc_demo::compare::{
    measure_native, measure_tarpc, measure_tarpc_serde_tcp, CompareConfig, Error, Figures,
};
use grpc_demo::tarpc_echo::{serve_all, TarpcEchoClient};
use std::sync::Arc;
use std::time::{Duration, Instant};
use transport_tarpc::Payload;
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path, transport, calls] = &args[..] else {
        return Err("usage: one_path native|tarpc|serde uds|tcp|mem CALLS".into());
    };
    let calls: usize = calls.parse()?;
    let cfg = CompareConfig {
        small_calls: calls,
        large_calls: 1,
        ..Default::default()
    };
    let dir = tempfile::tempdir()?;
    let uds = || Arc::new(UdsTransport::new(Default::default()));
    let tcp = || Arc::new(TcpTransport::new(Default::default()));
    let uds_addr = UdsAddr::from(dir.path().join("s"));
    let tcp_addr: std::net::SocketAddr = "127.0.0.1:0".parse()?;
    let f = match (path.as_str(), transport.as_str()) {
        ("native", "uds") => measure_native(uds(), uds_addr, &cfg).await?,
        ("tarpc", "uds") => measure_tarpc(uds(), uds_addr, &cfg).await?,
        ("native", "tcp") => measure_native(tcp(), tcp_addr, &cfg).await?,
        ("tarpc", "tcp") => measure_tarpc(tcp(), tcp_addr, &cfg).await?,
        ("serde", "tcp") => measure_tarpc_serde_tcp(&cfg).await?,
        ("tarpc", "mem") => tarpc_in_memory(calls).await?,
        _ => return Err("path and transport: native|tarpc uds|tcp, serde tcp, tarpc mem".into()),
    };
    println!("{path} {transport}: {:.0} calls/s", f.small_calls_per_s);
    Ok(())
}

/// tarpc's echo over its in-memory channel transport: every cost but I/O.
async fn tarpc_in_memory(calls: usize) -> Result<Figures, Error> {
    let (client_side, server_side) = tarpc::transport::channel::unbounded();
    let server = tokio::spawn(serve_all(futures_util::stream::iter([server_side])));
    let client = TarpcEchoClient::new(tarpc::client::Config::default(), client_side).spawn();
    let payload = bytes::Bytes::from_static(&[7u8; 64]);
    let call = || {
        let mut ctx = tarpc::context::current();
        ctx.deadline = Instant::now() + Duration::from_secs(120);
        client.unary(ctx, Payload(payload.clone()))
    };
    for _ in 0..200 {
        call().await?;
    }
    let start = Instant::now();
    for _ in 0..calls {
        let reply = call().await?;
        if reply.len() != payload.len() {
            return Err(format!("echo returned {} bytes, sent 64", reply.len()).into());
        }
    }
    let elapsed = start.elapsed();
    server.abort();
    Ok(Figures {
        small_calls_per_s: calls as f64 / elapsed.as_secs_f64(),
        large_mb_per_s: 0.0,
    })
}
