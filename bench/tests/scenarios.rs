//! Plumbing of the middleware scenarios over real transports: the same cases over uds, tcp and
//! verbs (`verbs::` needs an RDMA device and is ignored by default; the soft-RoCE guest of
//! `cargo xtask testbed verbs` runs it with `--include-ignored`). No timing assertions: only
//! what must hold however slow the machine is.

use std::sync::Arc;
use std::time::Duration;

use bench::scenarios::load::{
    method, run_load, LoadConfig, LoadError, Mode, Ping, ScenarioHandler, SendBytes, Slow, Stats,
    Typed, TypedKind, Workload,
};
use bench::scenarios::typed::{elements_for, Element, Fixed, StringDouble, Structured};
use bytes::Bytes;
use std::net::SocketAddr;
use transport_core::{Listener, Transport};
use transport_rpc::{code, ClientConfig, RpcClient, RpcError, RpcServer, ServerConfig};
use transport_tcp::TcpTransport;
use transport_uds::{UdsAddr, UdsTransport};
use transport_verbs::conformance::VerbsBackend;
use transport_verbs::{VerbsConfig, VerbsTransport};

struct Bed<T: Transport> {
    transport: T,
    addr: T::Addr,
    _dir: Option<tempfile::TempDir>,
}

async fn serve<T: Transport>(
    transport: T,
    addr: T::Addr,
    dir: Option<tempfile::TempDir>,
) -> Bed<T> {
    let listener = transport.listen(&addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = RpcServer::new(ScenarioHandler::default(), ServerConfig::default());
    tokio::spawn(async move { server.serve(listener).await });
    Bed {
        transport,
        addr,
        _dir: dir,
    }
}

async fn uds() -> Bed<UdsTransport> {
    let dir = tempfile::tempdir().unwrap();
    let addr = UdsAddr(dir.path().join("s.sock"));
    serve(UdsTransport::default(), addr, Some(dir)).await
}

async fn tcp() -> Bed<TcpTransport> {
    serve(
        TcpTransport::default(),
        "127.0.0.1:0".parse().unwrap(),
        None,
    )
    .await
}

async fn verbs() -> Bed<VerbsTransport> {
    let backend = VerbsBackend::for_this_machine();
    let transport = VerbsTransport::new(VerbsConfig::default()).expect("verbs transport");
    serve(transport, SocketAddr::new(backend.ip(), 0), None).await
}

fn shape(clients: usize, connections: usize, in_flight: usize, ms: u64) -> LoadConfig {
    LoadConfig {
        clients,
        connections,
        max_in_flight_per_connection: in_flight,
        duration: Duration::from_millis(ms),
    }
}

async fn run<T: Transport, W: Workload>(b: &Bed<T>, cfg: &LoadConfig, w: W) -> Stats {
    run_load(&b.transport, &b.addr, cfg, Arc::new(w))
        .await
        .unwrap()
}

async fn every_typed_kind_and_mode_round_trips<T: Transport>(b: Bed<T>) {
    let cfg = shape(1, 1, 16, 100);
    for mode in Mode::ALL {
        for kind in TypedKind::ALL {
            let stats = match kind {
                TypedKind::Strings => {
                    let n = elements_for::<String>(8192);
                    run(&b, &cfg, Typed::<String>::new(kind, mode, n)).await
                }
                TypedKind::StringDoubles => {
                    let n = elements_for::<StringDouble>(8192);
                    run(&b, &cfg, Typed::<StringDouble>::new(kind, mode, n)).await
                }
                TypedKind::Fixed => {
                    let n = elements_for::<Fixed>(8192);
                    run(&b, &cfg, Typed::<Fixed>::new(kind, mode, n)).await
                }
                TypedKind::Structured => {
                    run(&b, &cfg, Typed::<Structured>::new(kind, mode, 1)).await
                }
            };
            assert!(stats.completed > 0, "{kind:?} {mode:?}: nothing completed");
            assert!(stats.mbit_s > 0.0, "{kind:?} {mode:?}");
            if mode != Mode::Oneway {
                assert!(stats.p99_us >= stats.p50_us, "{kind:?} {mode:?}: {stats:?}");
            }
        }
    }
}

async fn byte_sends_and_pings_count_their_bytes<T: Transport>(b: Bed<T>) {
    let cfg = shape(2, 1, 16, 100);
    let ping = run(&b, &cfg, Ping).await;
    assert!(ping.completed > 0);
    assert_eq!(ping.mbit_s, 0.0);
    // Two callers: the fewest and the most calls per caller are theirs, and add up.
    assert!(ping.caller_calls_min >= 1, "{ping:?}");
    assert_eq!(
        ping.caller_calls_min + ping.caller_calls_max,
        ping.completed,
        "{ping:?}"
    );
    assert!(ping.fairness > 0.5 && ping.fairness <= 1.0, "{ping:?}");
    let send = run(&b, &cfg, SendBytes(Bytes::from(vec![7u8; 65536]))).await;
    assert!(send.completed > 0);
    let expected = send.completed as f64 * 65536.0 * 8.0 / send.seconds / 1e6;
    assert!((send.mbit_s - expected).abs() < 1e-6 * expected.max(1.0));
}

/// Most calls that `lanes` calls at a time, each taking at least `each`, can complete in `s`.
fn cap(lanes: u64, each: Duration, s: f64) -> u64 {
    lanes * (s / each.as_secs_f64()).ceil() as u64
}

const SLOW: Duration = Duration::from_millis(200);

/// A slow handler must not serialize clients: ten clients complete more calls than a server
/// running one call at a time ever could. (Bounds, not timings: this holds on a loaded machine
/// as long as a 200 ms call does not take 2 s.)
async fn slow_handlers_run_concurrently_across_clients<T: Transport>(b: Bed<T>) {
    let ten = run(&b, &shape(10, 10, 1, 1000), Slow(SLOW)).await;
    assert!(
        ten.completed > cap(1, SLOW, ten.seconds),
        "10 clients completed only {} in {:.2}s",
        ten.completed,
        ten.seconds
    );
    assert!(ten.mean_us >= SLOW.as_micros() as f64, "{ten:?}");
}

/// "One call per connection, a pool of connections" caps concurrency at the pool size: the
/// tool reproduces the classic ORB failure mode, and the pipelined shape does not have it.
async fn in_flight_limit_and_connection_pool_cap_concurrency<T: Transport>(b: Bed<T>) {
    let pool = run(&b, &shape(8, 2, 1, 1000), Slow(SLOW)).await;
    assert!(pool.completed >= 1);
    assert!(pool.completed <= cap(2, SLOW, pool.seconds), "{pool:?}");
    let pipelined = run(&b, &shape(8, 1, 64, 1000), Slow(SLOW)).await;
    assert!(
        pipelined.completed > cap(2, SLOW, pipelined.seconds),
        "pipelined shape capped like the pool: {pipelined:?}"
    );
}

async fn bad_inputs_give_typed_errors<T: Transport>(b: Bed<T>) {
    let err = run_load(&b.transport, &b.addr, &shape(0, 1, 1, 10), Arc::new(Ping))
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::Config(_)), "{err}");

    let client = RpcClient::new(
        b.transport.connect(&b.addr).await.unwrap(),
        ClientConfig::default(),
    );
    // Garbage where a typed sequence is expected, a short sleep argument, unknown methods.
    let echo_fixed = method::TYPED + 10 * TypedKind::Fixed as u32 + Mode::Echo as u32;
    for (m, payload, want) in [
        (echo_fixed, &[0xffu8; 3][..], code::INVALID_ARGUMENT),
        (method::SLEEP, &[1u8][..], code::INVALID_ARGUMENT),
        (method::TYPED + 99, &[][..], code::UNKNOWN_METHOD),
        (77, &[][..], code::UNKNOWN_METHOD),
    ] {
        match client.call(m, Bytes::copy_from_slice(payload)).await {
            Err(RpcError::Remote(status)) => assert_eq!(status.code, want, "method {m}"),
            other => panic!("method {m}: {other:?}"),
        }
    }
    assert_eq!(Structured::NAME, "structured");
}

/// One module per transport, each running every case above.
macro_rules! scenario_tests {
    ($module:ident, $bed:ident $(, #[$attr:meta])*) => {
        mod $module {
            scenario_tests!(@cases [$(#[$attr])*] $bed;
                every_typed_kind_and_mode_round_trips,
                byte_sends_and_pings_count_their_bytes,
                slow_handlers_run_concurrently_across_clients,
                in_flight_limit_and_connection_pool_cap_concurrency,
                bad_inputs_give_typed_errors
            );
        }
    };
    (@cases $attrs:tt $bed:ident; $($case:ident),*) => {
        $( scenario_tests!(@case $attrs $bed; $case); )*
    };
    (@case [$(#[$attr:meta])*] $bed:ident; $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $case() {
            super::$case(super::$bed().await).await;
        }
    };
}

scenario_tests!(uds, uds);
scenario_tests!(tcp, tcp);
scenario_tests!(verbs, verbs, #[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]);
