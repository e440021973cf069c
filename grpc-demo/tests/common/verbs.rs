//! The verbs backend for the per-transport tests (same rules as transport-verbs' conformance
//! tests): with `TRANSPORT_VERBS_REQUIRE_DEVICE=1` (the soft-RoCE guest of `cargo xtask testbed
//! verbs`, or a host with an RDMA device) every case runs for real and a missing device fails
//! it; without it, on a machine with no RDMA device, a case checks that the transport reports
//! the typed no-device error, prints `case not run` and returns.

use std::net::{IpAddr, SocketAddr};
use transport_core::conformance::Backend;
use transport_verbs::{VerbsConfig, VerbsTransport};

pub struct Verbs {
    ip: IpAddr,
}

impl Verbs {
    /// The backend, or `None` (after checking the typed error) on a machine without RDMA.
    pub fn for_this_machine() -> Option<Verbs> {
        let required = std::env::var("TRANSPORT_VERBS_REQUIRE_DEVICE").is_ok_and(|v| v == "1");
        match VerbsTransport::new(VerbsConfig::default()) {
            Ok(_) => {}
            Err(e) if !required => {
                assert!(
                    e.is_no_device(),
                    "expected the typed no-device error: {e:?}"
                );
                eprintln!("verbs: no RDMA device ({e}); case not run");
                return None;
            }
            Err(e) => panic!("TRANSPORT_VERBS_REQUIRE_DEVICE=1 but: {e}"),
        }
        let ip = match std::env::var("TB_IP_ADDR") {
            Ok(s) => s.parse().expect("TB_IP_ADDR is an IP address"),
            Err(_) => {
                let devs = transport_verbs::list_devices().expect("devices");
                let gid = devs
                    .iter()
                    .find_map(|d| d.roce_v2_ipv4_gid().and_then(|g| g.ipv4()))
                    .expect("set TB_IP_ADDR to the RDMA interface's IP (no RoCE v2 IPv4 GID)");
                IpAddr::V4(gid)
            }
        };
        Some(Verbs { ip })
    }
}

impl Backend for Verbs {
    type T = VerbsTransport;
    fn transport(&self, max_message_size: usize) -> VerbsTransport {
        VerbsTransport::new(VerbsConfig::with_max_message_size(max_message_size))
            .expect("verbs transport")
    }
    fn listen_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, 0)
    }
}
