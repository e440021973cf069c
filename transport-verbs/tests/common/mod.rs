//! Shared by the verbs integration tests: find the device or check the typed no-device error.

use std::net::SocketAddr;
use std::time::Duration;
use transport_core::conformance::Backend;
use transport_verbs::conformance::VerbsBackend;

/// The address to listen on (`$TB_IP_ADDR` or the first RoCE v2 IPv4 GID's address, port 0),
/// or `None` on a machine without RDMA after checking that the error is the typed one.
/// With `TRANSPORT_VERBS_REQUIRE_DEVICE=1` a missing device fails the test. The rule is
/// [`VerbsBackend::for_this_machine`]'s, shared with every verbs test suite.
pub fn listen_addr_or_skip(test: &str) -> Option<SocketAddr> {
    let Some(backend) = VerbsBackend::for_this_machine() else {
        eprintln!("{test}: case not run");
        return None;
    };
    Some(backend.listen_addr())
}

/// Runs `f` on a two-worker runtime with a hard time limit.
#[allow(dead_code)] // not every test binary runs async code
pub fn run<F: std::future::Future<Output = ()>>(f: F) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(120), f)
            .await
            .expect("test hung");
    });
    rt.shutdown_timeout(Duration::from_secs(2));
}
