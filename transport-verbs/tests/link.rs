//! The link figures (`transport_verbs::link`): a busy-polled SEND ping-pong and an RDMA READ
//! stream through the crate's own binding, served one client after another.

mod common;

use std::time::Duration;

use transport_verbs::link::{LinkClient, LinkServer};
use transport_verbs::{VerbsConfig, VerbsTransport};

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn link_ping_pong_and_read_stream_measure_and_serve_clients_in_turn() {
    let addr = common::listen_addr();
    let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
    let server = LinkServer::start(&verbs, addr).expect("link server");
    let mut rts = Vec::new();
    {
        let mut client = LinkClient::connect(&verbs, server.local_addr()).expect("connect");
        client
            .ping_pong(2000, |rt| rts.push(rt))
            .expect("ping-pong");
        let size = 1 << 20;
        let reads = 100;
        let elapsed = client.read_stream(size, reads).expect("read stream");
        let gbits = (size as f64 * reads as f64 * 8.0) / elapsed.as_secs_f64() / 1e9;
        rts.sort();
        eprintln!(
            "link: SEND ping-pong p50 {:?} (min {:?}, max {:?}); RDMA READ stream 1 MiB x {reads}: {elapsed:?}, {gbits:.3} Gbit/s",
            rts[rts.len() / 2],
            rts[0],
            rts[rts.len() - 1]
        );
        assert!(elapsed > Duration::ZERO);
        // A second stream on the same connection (a fresh exposure) works too.
        client.read_stream(64 << 10, 50).expect("second stream");
    }
    assert_eq!(rts.len(), 2000, "every round trip measured");
    assert!(rts.iter().all(|&rt| rt > Duration::ZERO));
    // The first client left: the server takes the next one.
    let mut next = LinkClient::connect(&verbs, server.local_addr()).expect("next client");
    next.ping_pong(10, |_| {}).expect("next client's pings");
    drop(next);
    drop(server);
    // Every connection of the transport is gone once the server stopped (teardown is
    // synchronous for link connections).
    assert_eq!(
        verbs.memory_use().connections,
        0,
        "{:?}",
        verbs.memory_use()
    );
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_read_stream_refuses_sizes_beyond_its_limit() {
    let addr = common::listen_addr();
    let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
    let server = LinkServer::start(&verbs, addr).expect("link server");
    let mut client = LinkClient::connect(&verbs, server.local_addr()).expect("connect");
    assert!(
        client.read_stream(0, 1).is_err(),
        "an empty stream is refused"
    );
    assert!(
        client.read_stream((64 << 20) + 1, 1).is_err(),
        "above 64 MiB is refused"
    );
    // The connection still works after the refusals (they never reached the server).
    client.ping_pong(5, |_| {}).expect("pings after refusals");
}
