//! Memory per connection: what an idle connection keeps registered is bounded, and the
//! registered pool belongs to the device (shared by the transport's connections), not to each
//! connection.

mod common;

use std::time::{Duration, Instant};

use transport_core::{Listener, MessageSender, Transport};
use transport_verbs::{VerbsConfig, VerbsTransport};

/// Send slots of one connection (`send_depth` × 128 bytes) plus its posted receive buffers.
fn per_connection_bound(cfg: &VerbsConfig) -> usize {
    cfg.send_depth * 128 + cfg.recv_depth * cfg.recv_buf_size()
}

#[test]
fn idle_connections_keep_at_most_their_bound_registered() {
    let Some(addr) = common::listen_addr_or_skip("memory") else {
        return;
    };
    common::run(async move {
        let cfg = VerbsConfig::default();
        let bound = per_connection_bound(&cfg);
        let verbs = VerbsTransport::new(cfg).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut pairs = Vec::new();
        for _ in 0..4 {
            pairs.push(common::open_pair(&verbs, &mut listener, addr).await);
        }
        let (m0, rss0) = (verbs.memory_use(), common::rss());
        const MORE: usize = 16;
        for _ in 0..MORE {
            pairs.push(common::open_pair(&verbs, &mut listener, addr).await);
        }
        let (m1, rss1) = (verbs.memory_use(), common::rss());
        // Both ends of every pair are connections of this transport.
        assert_eq!(m1.connections, 2 * pairs.len(), "{m1:?}");
        let added = 2 * MORE;
        let registered = (m1.registered_bytes - m0.registered_bytes) / added;
        let held = m1.per_connection_bytes / m1.connections;
        let resident = rss1.saturating_sub(rss0) / added;
        eprintln!(
            "per idle connection: {registered} bytes registered ({held} held for itself: send \
             slots + posted receive buffers; bound {bound}), {resident} bytes resident; \
             transport total {} bytes registered for {} connections",
            m1.registered_bytes, m1.connections
        );
        assert_eq!(held, bound, "what a connection holds for itself");
        assert!(
            registered <= bound + bound / 20,
            "each idle connection added {registered} registered bytes, bound {bound}"
        );
        drop(pairs);
        // Teardown runs in the background; it ends within a bounded time.
        let deadline = Instant::now() + Duration::from_secs(30);
        while verbs.memory_use().connections > 0 {
            assert!(Instant::now() < deadline, "{:?}", verbs.memory_use());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(verbs.memory_use().per_connection_bytes, 0);
    });
}

#[test]
fn a_new_connection_reuses_the_buffers_a_closed_one_returned() {
    let Some(addr) = common::listen_addr_or_skip("memory_shared_pool") else {
        return;
    };
    common::run(async move {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let p = common::open_pair(&verbs, &mut listener, addr).await;
        let first = p.client.0.metrics().registrations.get();
        drop(p);
        let deadline = Instant::now() + Duration::from_secs(30);
        while verbs.memory_use().connections > 0 {
            assert!(Instant::now() < deadline, "{:?}", verbs.memory_use());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let p = common::open_pair(&verbs, &mut listener, addr).await;
        let second = p.client.0.metrics().registrations.get();
        eprintln!("registrations: first connection {first}, next one after it closed {second}");
        // The first registered its send slots and its receive buffers; the next one takes the
        // receive buffers from the device's pool and registers only its own send slots.
        assert!(first > 1, "first connection: {first} registrations");
        assert_eq!(second, 1, "the next connection registered {second} regions");
    });
}
