//! The zero-copy claim, counted: after warm-up, a run of large RPCs (eager 64 KiB and
//! rendezvous 1 MiB) copies no payload byte and registers no memory, on either side.

mod common;

use bytes::{BufMut, Bytes};
use transport_core::{Connection, Listener, Transport};
use transport_rpc::{ClientConfig, Request, RpcClient, RpcServer, ServerConfig, Status};
use transport_verbs::{VerbsConfig, VerbsTransport};

const ECHO: u32 = 1;

async fn echo_round(client: &RpcClient<transport_verbs::VerbsSender>, size: usize, seed: u8) {
    // Built with slice copies: byte-by-byte loops are slow in debug builds under TCG.
    let mut pattern = vec![0u8; size];
    for (i, chunk) in pattern.chunks_mut(4096).enumerate() {
        chunk.fill((i as u8).wrapping_mul(31).wrapping_add(seed));
        chunk[0] = seed;
    }
    let mut buf = client.alloc(size);
    assert!(
        buf.is_backend_memory(),
        "verbs hands out registered send buffers"
    );
    buf.put_slice(&pattern); // the user writing its payload, not a transport copy
    let payload: Bytes = buf.freeze();
    let reply = client.call(ECHO, payload.clone()).await.expect("echo");
    assert!(reply == payload, "echo of {size} bytes differs");
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn large_rpcs_copy_nothing_and_register_no_buffer_per_call() {
    let addr = common::listen_addr();
    common::run(async move {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let conn = verbs.connect(&addr).await.expect("connect");
        let server_conn = listener.accept().await.expect("accept");
        let server_metrics = server_conn.metrics();
        let server = RpcServer::new(
            |r: Request| async move { Ok::<_, Status>(r.payload) },
            ServerConfig::default(),
        );
        tokio::spawn(async move { server.serve_connection(server_conn).await });
        let client = RpcClient::new(conn, ClientConfig::default());

        let sizes = [64 << 10, 1 << 20];
        // Warm-up: until two rounds in a row register nothing on either side (at most 20
        // rounds). How many buffers are alive at once, and so how large the shared pool
        // grows, depends on when each side's driver returns the buffers of finished
        // transfers: a fixed number of rounds can leave the pool one buffer short.
        let mut clean = 0;
        for round in 0..20u8 {
            let before = (client.metrics().snapshot(), server_metrics.snapshot());
            for &n in &sizes {
                echo_round(&client, n, round).await;
            }
            let grew = client.metrics().snapshot().registrations > before.0.registrations
                || server_metrics.snapshot().registrations > before.1.registrations;
            clean = if grew { 0 } else { clean + 1 };
            if clean == 2 {
                break;
            }
        }
        assert_eq!(clean, 2, "the pools still grew after 20 warm-up rounds");
        let c0 = client.metrics().snapshot();
        let s0 = server_metrics.snapshot();
        const CALLS: u8 = 12;
        for round in 0..CALLS {
            for &n in &sizes {
                echo_round(&client, n, round.wrapping_add(100)).await;
            }
        }
        let c = client.metrics().snapshot() - c0;
        let s = server_metrics.snapshot() - s0;
        println!("zero_copy: client delta {c:?}");
        println!("zero_copy: server delta {s:?}");
        let payload_bytes = CALLS as u64 * sizes.iter().sum::<usize>() as u64;
        assert!(
            c.bytes_sent >= payload_bytes,
            "the payloads went out: {c:?}"
        );
        assert!(s.bytes_received >= payload_bytes, "and arrived: {s:?}");
        assert_eq!(
            c.payload_bytes_copied, 0,
            "client copied payload bytes: {c:?}"
        );
        assert_eq!(
            s.payload_bytes_copied, 0,
            "server copied payload bytes: {s:?}"
        );
        // Buffers come from the shared pool, which grows when a transfer needs one while the
        // others are still in flight or not yet given back by their driver. That timing
        // differs from run to run: even after a clean warm-up the client's pool can grow by
        // one buffer in this window.
        // What must hold is that calls do not register: at most one growth in 24 calls each.
        assert!(
            c.registrations <= 1,
            "client registered memory per call after warm-up: {c:?}"
        );
        assert!(
            s.registrations <= 1,
            "server registered memory per call after warm-up: {s:?}"
        );
        assert!(c.doorbells > 0 && c.completions > 0, "{c:?}");
        println!(
            "zero_copy: {} RPCs of 64 KiB + 1 MiB: 0 payload bytes copied, registrations {} \
             client / {} server (client doorbells {}, completions {}, credit stalls {})",
            2 * CALLS as u32,
            c.registrations,
            s.registrations,
            c.doorbells,
            c.completions,
            c.credit_stalls
        );
    });
}
