//! Where a same-CPU round trip's time goes, layer by layer: a 1-byte ping-pong over a Unix
//! socket pair with blocking `std` sockets (the OS), the same over bare tokio sockets on a
//! current-thread runtime (the floor of any tokio-based connection), over this crate's
//! connection (raw), and an RPC `void o()` call. Both ends are pinned to one CPU (or to two,
//! with `split`), each layer measured in turn, several rounds.
//!
//! ```sh
//! cargo run --release -p transport-uds --example latency_floor [-- ROUND_TRIPS [same|split]]
//! ```

use bytes::Bytes;
use std::io::{Read, Write};
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport_core::{Connection, HeaderBytes, Message, MessageReceiver, MessageSender};
use transport_rpc::blocking::{BlockingClient, BlockingConfig, BlockingServer};
use transport_rpc::{ClientConfig, Request, RpcClient, RpcServer, ServerConfig, Status};
use transport_uds::UdsConnection;

const WARMUP: usize = 1000;
const ROUNDS: usize = 5;

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it, and
    // sched_setaffinity reads exactly size_of::<cpu_set_t>() bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs `serve` on a thread pinned to `cpu` and `client` here (pinned to CPU 0); returns
/// the client's µs per round trip.
fn measure(cpu: usize, serve: impl FnOnce() + Send + 'static, client: impl FnOnce() -> f64) -> f64 {
    let server = std::thread::spawn(move || {
        pin(cpu);
        serve()
    });
    pin(0);
    let us = client();
    server.join().expect("server thread");
    us
}

fn os(n: usize, cpu: usize) -> f64 {
    let (mut a, mut b) = std::os::unix::net::UnixStream::pair().expect("pair");
    let serve = move || {
        let mut x = [0u8; 1];
        while b.read_exact(&mut x).is_ok() {
            b.write_all(&x).expect("write");
        }
    };
    measure(cpu, serve, move || {
        let mut x = [0u8; 1];
        let mut t = Instant::now();
        for i in 0..WARMUP + n {
            if i == WARMUP {
                t = Instant::now();
            }
            a.write_all(&x).expect("write");
            a.read_exact(&mut x).expect("read");
        }
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    })
}

fn bare_tokio(n: usize, cpu: usize) -> f64 {
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
    a.set_nonblocking(true).expect("nonblocking");
    b.set_nonblocking(true).expect("nonblocking");
    let serve = move || {
        runtime().block_on(async move {
            let mut b = tokio::net::UnixStream::from_std(b).expect("register");
            let mut x = [0u8; 1];
            while b.read_exact(&mut x).await.is_ok() {
                b.write_all(&x).await.expect("write");
            }
        })
    };
    measure(cpu, serve, move || {
        runtime().block_on(async move {
            let mut a = tokio::net::UnixStream::from_std(a).expect("register");
            let mut x = [0u8; 1];
            let mut t = Instant::now();
            for i in 0..WARMUP + n {
                if i == WARMUP {
                    t = Instant::now();
                }
                a.write_all(&x).await.expect("write");
                a.read_exact(&mut x).await.expect("read");
            }
            t.elapsed().as_secs_f64() * 1e6 / n as f64
        })
    })
}

/// A connected pair of this crate's connections, each to be registered on the runtime of
/// the thread that uses it.
fn connections() -> (
    std::os::unix::net::UnixStream,
    std::os::unix::net::UnixStream,
) {
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
    a.set_nonblocking(true).expect("nonblocking");
    b.set_nonblocking(true).expect("nonblocking");
    (a, b)
}

fn connection(s: std::os::unix::net::UnixStream) -> UdsConnection {
    let s = tokio::net::UnixStream::from_std(s).expect("register");
    UdsConnection::new(s, "uds", Default::default(), "pair".into())
}

fn raw(n: usize, cpu: usize) -> f64 {
    let (a, b) = connections();
    let serve = move || {
        runtime().block_on(async move {
            let (mut tx, mut rx) = connection(b).split();
            while let Ok(Some(m)) = rx.recv().await {
                tx.send(m).await.expect("send");
            }
        })
    };
    measure(cpu, serve, move || {
        runtime().block_on(async move {
            let (mut tx, mut rx) = connection(a).split();
            let mut t = Instant::now();
            for i in 0..WARMUP + n {
                if i == WARMUP {
                    t = Instant::now();
                }
                let ping = Message::new(HeaderBytes::from([1u8]), Bytes::new());
                tx.send(ping).await.expect("send");
                rx.recv().await.expect("recv").expect("a reply");
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            tx.close().await.expect("close");
            us
        })
    })
}

/// The async RPC server answering `void o()` on `b`, for [`measure`].
fn serve_rpc(b: std::os::unix::net::UnixStream) -> impl FnOnce() + Send + 'static {
    move || {
        runtime().block_on(async move {
            let handler = |_: Request| async move { Ok::<_, Status>(Bytes::new()) };
            let server = RpcServer::new(handler, ServerConfig::default());
            let _ = server.serve_connection(connection(b)).await;
        })
    }
}

fn rpc(n: usize, cpu: usize) -> f64 {
    let (a, b) = connections();
    let serve = serve_rpc(b);
    measure(cpu, serve, move || {
        let rt = runtime();
        let us = rt.block_on(async move {
            let client = RpcClient::new(connection(a), ClientConfig::default());
            let mut t = Instant::now();
            for i in 0..WARMUP + n {
                if i == WARMUP {
                    t = Instant::now();
                }
                client.call(1, Bytes::new()).await.expect("call");
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            client.close().await.expect("close");
            us
        });
        // The client, and with it the connection, ends with the runtime.
        drop(rt);
        us
    })
}

/// `transport_rpc::blocking`'s client against the async RPC server.
fn blocking_client_rpc(n: usize, cpu: usize) -> f64 {
    let (a, b) = connections();
    measure(cpu, serve_rpc(b), move || blocking_calls(a, n))
}

/// `transport_rpc::blocking` at both ends: the client, and the server serving the
/// connection on its own thread.
fn blocking_rpc(n: usize, cpu: usize) -> f64 {
    let (a, b) = connections();
    let rt = runtime();
    let handle = rt.handle().clone();
    let serve = move || {
        let handler = |_: Request| async move { Ok::<_, Status>(Bytes::new()) };
        let server = BlockingServer::new(
            handler,
            ServerConfig::default(),
            BlockingConfig::default(),
            handle,
        );
        let _ = server.serve_connection(b);
        drop(rt);
    };
    measure(cpu, serve, move || blocking_calls(a, n))
}

fn blocking_calls(a: std::os::unix::net::UnixStream, n: usize) -> f64 {
    let mut client = BlockingClient::new(a, BlockingConfig::default()).expect("client");
    let mut t = Instant::now();
    for i in 0..WARMUP + n {
        if i == WARMUP {
            t = Instant::now();
        }
        client.call(1, &[]).expect("call");
    }
    t.elapsed().as_secs_f64() * 1e6 / n as f64
}

/// A layer's measurement: round trips, server CPU -> µs per round trip.
type Layer = fn(usize, usize) -> f64;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .map(|s| s.parse().expect("ROUND_TRIPS is a number"))
        .unwrap_or(50_000);
    let cpu = match args.next().as_deref() {
        None | Some("same") => 0,
        Some("split") => 1,
        Some(other) => panic!("placement is same or split, not {other}"),
    };
    let layers: [(&str, Layer); 6] = [
        ("os (blocking std sockets)", os),
        ("bare tokio UnixStream", bare_tokio),
        ("raw (UdsConnection)", raw),
        ("rpc (void o())", rpc),
        ("blocking client, rpc server", blocking_client_rpc),
        ("blocking rpc (both ends)", blocking_rpc),
    ];
    let mut results = vec![Vec::new(); layers.len()];
    for _ in 0..ROUNDS {
        for (i, (_, f)) in layers.iter().enumerate() {
            results[i].push(f(n, cpu));
        }
    }
    let os_us = median(results[0].clone());
    println!("{n} round trips x {ROUNDS} rounds, server on CPU {cpu}, client on CPU 0; median µs per round trip");
    for ((name, _), r) in layers.iter().zip(results) {
        let m = median(r);
        println!("  {name:<28} {m:7.2} µs  {:.2}x os", m / os_us);
    }
}
