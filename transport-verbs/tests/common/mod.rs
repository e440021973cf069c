//! Shared by the verbs integration tests: find the device or check the typed no-device error.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// The address to listen on (`$TB_IP_ADDR` or the first RoCE v2 IPv4 GID's address, port 0),
/// or `None` on a machine without RDMA after checking that the error is the typed one.
/// With `TRANSPORT_VERBS_REQUIRE_DEVICE=1` a missing device fails the test.
pub fn listen_addr_or_skip(test: &str) -> Option<SocketAddr> {
    let required = std::env::var("TRANSPORT_VERBS_REQUIRE_DEVICE").is_ok_and(|v| v == "1");
    match transport_verbs::list_devices() {
        Ok(_) => {
            let ip: IpAddr = match std::env::var("TB_IP_ADDR") {
                Ok(s) => s.parse().expect("TB_IP_ADDR is an IP address"),
                Err(_) => transport_verbs::local_rdma_ip()
                    .expect("set TB_IP_ADDR to the RDMA interface's IP address"),
            };
            Some(SocketAddr::new(ip, 0))
        }
        Err(e) if !required => {
            assert!(
                e.is_no_device(),
                "expected the typed no-device error: {e:?}"
            );
            eprintln!("{test}: no RDMA device ({e}); case not run");
            None
        }
        Err(e) => panic!("TRANSPORT_VERBS_REQUIRE_DEVICE=1 but: {e}"),
    }
}

/// Runs `f` on a two-worker runtime with a hard time limit.
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
