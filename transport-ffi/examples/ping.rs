//! The Rust twin of `examples/c/ping.c`, for the C ABI's cost: the same calls through the
//! Rust API, shaped as the ABI runs them (each call blocked on from the main thread, which
//! drives the runtime: `call`) and as a Rust program would (a task on the runtime:
//! `call-async`).
//!
//! ```text
//! ping serve URI                           method 1 echoes; until standard input ends
//! ping call|call-async URI [CALLS [SIZE]]  CALLS calls (20000) of SIZE bytes (0)
//! ```
//! URIs: `unix:PATH`, `tcp://HOST:PORT`.

use bytes::{BufMut, Bytes};
use std::io::Read;
use std::time::{Duration, Instant};
use transport_core::{Connection, Listener, MessageSender, Transport};
use transport_rpc::{
    CallOptions, ClientConfig, Request, RpcClient, RpcServer, ServerConfig, Status,
};
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};

type Error = Box<dyn std::error::Error>;

async fn echo(r: Request) -> Result<Bytes, Status> {
    match r.method {
        1 => Ok(r.payload),
        m => Err(Status::unknown_method(m)),
    }
}

/// Serves until standard input ends.
fn serve<T: Transport>(
    rt: &tokio::runtime::Runtime,
    t: T,
    addr: T::Addr,
    uri: impl Fn(String) -> String,
) -> Result<(), Error> {
    let listener = rt.block_on(t.listen(&addr))?;
    println!("listening {}", uri(listener.local_addr()?.to_string()));
    let server = RpcServer::new(echo, ServerConfig::default());
    let serving = rt.spawn({
        let server = server.clone();
        async move { server.serve(listener).await }
    });
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    rt.block_on(server.shutdown());
    rt.block_on(serving)??;
    Ok(())
}

/// `calls` calls after 1000 warm-up ones; the time per call.
fn call<C: Connection>(
    rt: &tokio::runtime::Runtime,
    conn: C,
    calls: u64,
    size: usize,
    blocking: bool,
) -> Result<Duration, Error>
where
    C::Sender: MessageSender + Sync,
{
    let _in_rt = rt.enter();
    let client = std::sync::Arc::new(RpcClient::new(conn, ClientConfig::default()));
    // As the C client's: written once in the connection's pool, not copied again.
    let payload = {
        let mut b = client.alloc(size);
        b.put_bytes(0, size);
        b.freeze()
    };
    let opts = || CallOptions::deadline(Duration::from_secs(10));
    let check = |b: &Bytes| -> Result<(), Error> {
        if b.len() != size {
            return Err(format!("{} bytes back, {size} sent", b.len()).into());
        }
        Ok(())
    };
    let per_call = if blocking {
        let mut start = Instant::now();
        for i in 0..1000 + calls {
            if i == 1000 {
                start = Instant::now();
            }
            check(&rt.block_on(client.call_with(1, payload.clone(), opts()))?)?;
        }
        start.elapsed()
    } else {
        let c = client.clone();
        let run = rt.spawn(async move {
            let mut start = Instant::now();
            for i in 0..1000 + calls {
                if i == 1000 {
                    start = Instant::now();
                }
                let b = c.call_with(1, payload.clone(), opts()).await;
                match b {
                    Ok(b) if b.len() == size => {}
                    Ok(b) => return Err(format!("{} bytes back, {size} sent", b.len())),
                    Err(e) => return Err(e.to_string()),
                }
            }
            Ok(start.elapsed())
        });
        rt.block_on(run)??
    };
    let per_call = per_call / calls.max(1) as u32;
    rt.block_on(client.close())?;
    Ok(per_call)
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: ping serve URI | ping call|call-async URI [CALLS [SIZE]]";
    let (mode, uri) = match args.as_slice() {
        [m, u, ..] => (m.as_str(), u.as_str()),
        _ => return Err(usage.into()),
    };
    let calls: u64 = args.get(2).map_or(Ok(20_000), |s| s.parse())?;
    let size: usize = args.get(3).map_or(Ok(0), |s| s.parse())?;
    // As the C ABI builds them: a runtime the calling thread drives for the client
    // (`tp_runtime_new(0, ..)`), one worker thread for the server (`tp_runtime_new(1, ..)`),
    // both with the spin-before-park hook.
    let mut builder = if mode == "serve" {
        let mut b = tokio::runtime::Builder::new_multi_thread();
        b.worker_threads(1);
        b
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let rt = builder
        .enable_all()
        .on_thread_park(transport_core::spin::park_hook(
            transport_core::spin::DEFAULT_BUDGET,
        ))
        .build()?;
    let per_call = match (mode, uri.strip_prefix("unix:"), uri.strip_prefix("tcp://")) {
        ("serve", Some(path), _) => {
            return serve(&rt, UdsTransport::default(), UdsAddr(path.into()), |_| {
                uri.to_string()
            })
        }
        ("serve", _, Some(addr)) => {
            return serve(&rt, TcpTransport::default(), addr.parse()?, |a| {
                format!("tcp://{a}")
            })
        }
        (m @ ("call" | "call-async"), Some(path), _) => {
            let conn = rt.block_on(UdsTransport::default().connect(&UdsAddr(path.into())))?;
            call(&rt, conn, calls, size, m == "call")?
        }
        (m @ ("call" | "call-async"), _, Some(addr)) => {
            let conn = rt.block_on(TcpTransport::default().connect(&addr.parse()?))?;
            call(&rt, conn, calls, size, m == "call")?
        }
        _ => return Err(usage.into()),
    };
    let us = per_call.as_secs_f64() * 1e6;
    println!(
        "{calls} calls of {size} bytes: {us:.2} us per call, {:.1} MB/s",
        size as f64 / us.max(1e-9)
    );
    Ok(())
}
