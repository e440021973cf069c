//! RPC throughput over verbs, for comparison with perftest on the same device.
//!
//! Starts an RPC server and a client in this process (two connections on one RDMA device, as
//! `ib_send_bw` does with its server and client), then measures:
//! - `oneway`: one-way RPCs of `--size` bytes (what `ib_send_bw` measures: one direction),
//! - `echo`: RPCs whose reply carries the request payload back (both directions).
//!
//! Payloads are built once in registered send buffers (`RpcClient::alloc`) and reused, so the
//! transport copies nothing and registers nothing per call (the metrics printed show it).
//!
//! ```text
//! rpc_echo [--addr IP] [--size BYTES] [--calls N] [--inflight K] [--mode oneway|echo|both]
//!          [--busy-poll] [--eager-limit BYTES] [--recv-depth N]
//! ```
//! In the soft-RoCE guest: `cargo xtask testbed run --file target/release/examples/rpc_echo --
//! '/mnt/host/bin/rpc_echo --addr $TB_IP_ADDR'` (see the crate docs for the perftest pairing).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::{BufMut, Bytes};
use transport_core::{Connection, Listener, Transport};
use transport_rpc::{ClientConfig, Request, RpcClient, RpcServer, ServerConfig, Status};
use transport_verbs::{VerbsConfig, VerbsTransport};

const ECHO: u32 = 1;
const SINK: u32 = 2;
const COUNT: u32 = 3;

struct Args {
    addr: Option<String>,
    size: usize,
    calls: u64,
    inflight: usize,
    mode: String,
    busy_poll: bool,
    eager_limit: Option<usize>,
    recv_depth: Option<usize>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        addr: std::env::var("TB_IP_ADDR").ok(),
        size: 65536,
        calls: 2000,
        inflight: 16,
        mode: "both".into(),
        busy_poll: false,
        eager_limit: None,
        recv_depth: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--addr" => a.addr = Some(val()?),
            "--size" => a.size = val()?.parse().map_err(|e| format!("--size: {e}"))?,
            "--calls" => a.calls = val()?.parse().map_err(|e| format!("--calls: {e}"))?,
            "--inflight" => a.inflight = val()?.parse().map_err(|e| format!("--inflight: {e}"))?,
            "--mode" => a.mode = val()?,
            "--busy-poll" => a.busy_poll = true,
            "--recv-depth" => {
                a.recv_depth = Some(val()?.parse().map_err(|e| format!("--recv-depth: {e}"))?)
            }
            "--eager-limit" => {
                a.eager_limit = Some(val()?.parse().map_err(|e| format!("--eager-limit: {e}"))?)
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if !["oneway", "echo", "both"].contains(&a.mode.as_str()) {
        return Err(format!(
            "--mode must be oneway, echo or both, not {}",
            a.mode
        ));
    }
    if a.inflight == 0 || a.calls == 0 {
        return Err("--inflight and --calls must be positive".into());
    }
    Ok(a)
}

fn payload(client: &RpcClient<transport_verbs::VerbsSender>, size: usize, seed: u8) -> Bytes {
    let mut b = client.alloc(size);
    for i in 0..size {
        b.put_u8((i as u8).wrapping_add(seed));
    }
    b.freeze()
}

fn report(mode: &str, a: &Args, secs: f64, directions: u64, m: transport_core::MetricsSnapshot) {
    let bytes = a.calls * a.size as u64;
    let gbits = bytes as f64 * 8.0 / secs / 1e9;
    println!(
        "rpc_echo: mode={mode} size={} eager_limit={} recv_depth={} busy_poll={} calls={} inflight={} secs={secs:.3} calls_per_s={:.0} \
         payload_gbits={gbits:.3} wire_gbits={:.3} copied={} registrations={} doorbells={} \
         completions={} credit_stalls={}",
        a.size,
        a.eager_limit.unwrap_or(VerbsConfig::default().eager_limit),
        a.recv_depth.unwrap_or(VerbsConfig::default().recv_depth),
        a.busy_poll,
        a.calls,
        a.inflight,
        a.calls as f64 / secs,
        gbits * directions as f64,
        m.payload_bytes_copied,
        m.registrations,
        m.doorbells,
        m.completions,
        m.credit_stalls,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rpc_echo: {e}");
            std::process::exit(2);
        }
    };
    let mut cfg = VerbsConfig::default();
    cfg.busy_poll = a.busy_poll;
    cfg.eager_limit = a.eager_limit.unwrap_or(cfg.eager_limit);
    cfg.recv_depth = a.recv_depth.unwrap_or(cfg.recv_depth);
    let verbs = match VerbsTransport::new(cfg) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("rpc_echo: {e}");
            std::process::exit(if e.is_no_device() { 3 } else { 1 });
        }
    };
    let Some(ip) = a.addr.clone() else {
        eprintln!("rpc_echo: give --addr IP of the RDMA interface (or set TB_IP_ADDR)");
        std::process::exit(2);
    };
    let addr: SocketAddr = SocketAddr::new(ip.parse().expect("IP address"), 0);
    let mut listener = verbs.listen(&addr).await.expect("listen");
    let addr = listener.local_addr().expect("addr");
    let count = Arc::new(AtomicU64::new(0));
    let c2 = count.clone();
    let server = RpcServer::new(
        move |r: Request| {
            if r.method == SINK {
                c2.fetch_add(1, Ordering::Relaxed);
            }
            let count = c2.clone();
            async move {
                match r.method {
                    ECHO => Ok::<_, Status>(r.payload),
                    COUNT => Ok(Bytes::copy_from_slice(
                        &count.load(Ordering::Relaxed).to_le_bytes(),
                    )),
                    _ => Ok(Bytes::new()),
                }
            }
        },
        ServerConfig::default(),
    );
    let conn = verbs.connect(&addr).await.expect("connect");
    let sconn = listener.accept().await.expect("accept");
    tokio::spawn(async move { server.serve_connection(sconn).await });
    let _ = conn.capabilities();
    let client = Arc::new(RpcClient::new(conn, ClientConfig::default()));
    let bufs: Vec<Bytes> = (0..a.inflight)
        .map(|i| payload(&client, a.size, i as u8))
        .collect();
    // Warm-up: buffers registered, caches filled.
    for b in &bufs {
        assert_eq!(&client.call(ECHO, b.clone()).await.expect("warm-up"), b);
    }

    if a.mode == "oneway" || a.mode == "both" {
        let before = client.metrics().snapshot();
        let base = u64::from_le_bytes(
            client.call(COUNT, Bytes::new()).await.expect("count")[..8]
                .try_into()
                .unwrap(),
        );
        let start = Instant::now();
        for i in 0..a.calls {
            client
                .oneway(SINK, bufs[i as usize % bufs.len()].clone())
                .await
                .expect("oneway");
        }
        let n = u64::from_le_bytes(
            client.call(COUNT, Bytes::new()).await.expect("count")[..8]
                .try_into()
                .unwrap(),
        );
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(n - base, a.calls, "every oneway arrived");
        report("oneway", &a, secs, 1, client.metrics().snapshot() - before);
    }
    if a.mode == "echo" || a.mode == "both" {
        // Warm-up at full concurrency too: every buffer the pipeline needs gets registered now.
        echo_phase(&client, &bufs, 4 * a.inflight as u64).await;
        let before = client.metrics().snapshot();
        let start = Instant::now();
        echo_phase(&client, &bufs, a.calls).await;
        let secs = start.elapsed().as_secs_f64();
        report("echo", &a, secs, 2, client.metrics().snapshot() - before);
    }
}

/// `calls` echo RPCs, one task per buffer (so `bufs.len()` calls in flight).
async fn echo_phase(
    client: &Arc<RpcClient<transport_verbs::VerbsSender>>,
    bufs: &[Bytes],
    calls: u64,
) {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for b in bufs {
        let b = b.clone();
        let client = client.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            while next.fetch_add(1, Ordering::Relaxed) < calls {
                let r = client.call(ECHO, b.clone()).await.expect("echo");
                assert_eq!(r.len(), b.len());
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
}
