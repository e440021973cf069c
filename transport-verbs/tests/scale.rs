//! Many connections in one process: a thousand verbs connections (both ends in this process,
//! so two thousand queue pairs) on one transport with the default settings, each making a
//! call, with no error; the memory each idle connection holds is measured and bounded.
//!
//! Receive buffers live in the device's shared receive queue (128 buffers of 64 KiB + headers
//! by default, 8 MiB, grown to its cap of 1024, 64 MiB, by two thousand connections), so a
//! connection registers only its send slots (128 × 128 bytes). With 64
//! buffers of its own per connection (4 MiB), a thousand pairs would need 8 GiB.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_verbs::{VerbsConfig, VerbsTransport};

const PAIRS: usize = 1000;

/// File descriptors this process has open right now.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Most file descriptors a thousand connection pairs may add: the device's completion channel
/// and rdma_cm channel, the runtime's, a few to spare. Each connection has none of its own
/// (its CQ's events come through the device's channel; a channel per connection would make
/// 2000 endpoints need 2000 descriptors and a raised `RLIMIT_NOFILE`).
const FDS_FOR_ALL: usize = 16;

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_thousand_connections_each_make_a_call_without_error() {
    let addr = common::listen_addr();
    common::run(async move {
        let mut cfg = VerbsConfig::default();
        let mut paths = common::device_paths(&cfg, addr.ip());
        if paths.srq_depth == 0 {
            // Each connection posts receive buffers of its own (registration exposure, iWARP):
            // with the defaults' 64 × 64 KiB that is 8 GB for 2000 connections, so the
            // fewest and smallest buffers the protocol allows here.
            cfg.recv_depth = 4;
            cfg.eager_limit = 4000;
            paths = common::device_paths(&cfg, addr.ip());
        }
        let own_recv = if paths.srq_depth == 0 {
            (paths.recv_depth + 1) * cfg.recv_buf_size() // one spare beyond the credits
        } else {
            0
        };
        let per_conn_bound = cfg.send_depth * 128 + own_recv;
        let buf_size = cfg.recv_buf_size();
        let verbs = VerbsTransport::new(cfg).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let (rss0, fds0, started) = (common::rss(), open_fds(), Instant::now());
        let mut pairs = Vec::with_capacity(PAIRS);
        for i in 0..PAIRS {
            let conn = verbs
                .connect(&addr)
                .await
                .unwrap_or_else(|e| panic!("connection {i}: {e}"));
            let server = listener.accept().await.expect("accept");
            pairs.push((conn.split(), server.split()));
        }
        let setup = started.elapsed();
        eprintln!("{PAIRS} connection pairs set up in {setup:?}");
        // Every client makes a call: its request, the server's reply.
        let started = Instant::now();
        for (i, ((tx, rx), (stx, srx))) in pairs.iter_mut().enumerate() {
            let body = Bytes::from(format!("call {i}"));
            tx.send(Message::new(HeaderBytes::from([1u8]), body.clone()))
                .await
                .unwrap_or_else(|e| panic!("send {i}: {e}"));
            let req = srx.recv().await.expect("server recv").expect("open");
            stx.send(req).await.expect("reply");
            let reply = rx.recv().await.expect("client recv").expect("open");
            assert_eq!(reply.payload, body, "connection {i} got another's reply");
        }
        let calls = started.elapsed();
        let m = verbs.memory_use();
        let resident = common::rss().saturating_sub(rss0);
        let fds = open_fds().saturating_sub(fds0);
        assert_eq!(m.connections, 2 * PAIRS, "{m:?}");
        let held = m.per_connection_bytes / m.connections;
        eprintln!(
            "{PAIRS} connection pairs set up in {setup:?}, one call each in {calls:?}; per \
             connection: {held} bytes registered for itself (bound {per_conn_bound}), {} bytes \
             resident; {fds} file descriptors opened for all of them; transport: {} bytes \
             registered in all, {} of them in the shared receive queue",
            resident / m.connections,
            m.registered_bytes,
            m.shared_receive_bytes
        );
        common::srq_refilled(&verbs, buf_size).await;
        assert!(held <= per_conn_bound, "{held} > {per_conn_bound}");
        assert!(
            fds <= FDS_FOR_ALL,
            "{fds} file descriptors opened for {} connections",
            m.connections
        );
        if paths.srq_depth > 0 {
            assert!(
                held <= 64 << 10,
                "{held} bytes registered per connection with the defaults"
            );
        }
        let started = Instant::now();
        drop(pairs);
        let deadline = started + Duration::from_secs(60);
        while verbs.memory_use().connections > 0 {
            assert!(Instant::now() < deadline, "{:?}", verbs.memory_use());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!(
            "{PAIRS} connection pairs torn down in {:?}",
            started.elapsed()
        );
    });
}
