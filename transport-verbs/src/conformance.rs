//! Verbs as a backend of transport-core's conformance suite (feature `conformance`), with the
//! rule every verbs test suite follows:
//!
//! - with `TRANSPORT_VERBS_REQUIRE_DEVICE=1` (the soft-RoCE guest of `cargo xtask testbed verbs`,
//!   or a host with an RDMA device) every case runs for real and a missing device fails it;
//! - without it, on a machine with no RDMA device, [`VerbsBackend::for_this_machine`] checks that
//!   the transport reports the typed no-device error, prints `case not run` (which the guest
//!   run treats as a failure) and returns `None`.

use std::net::{IpAddr, SocketAddr};
use transport_core::conformance::Backend;

use crate::{VerbsConfig, VerbsTransport};

/// The RDMA device of this machine, addressed by `TB_IP_ADDR` or its RoCE v2 IPv4 GID.
#[derive(Debug, Clone, Copy)]
pub struct VerbsBackend {
    ip: IpAddr,
}

impl VerbsBackend {
    /// The backend, or `None` (after checking the typed error) on a machine without RDMA.
    ///
    /// # Panics
    /// When `TRANSPORT_VERBS_REQUIRE_DEVICE=1` and there is no usable device, or when the
    /// transport fails with anything but the typed no-device error: a test must not pass then.
    pub fn for_this_machine() -> Option<VerbsBackend> {
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
            Err(_) => crate::local_rdma_ip()
                .expect("set TB_IP_ADDR to the RDMA interface's IP (no RoCE v2 IPv4 GID)"),
        };
        Some(VerbsBackend { ip })
    }

    /// The device's IP address.
    pub fn ip(&self) -> IpAddr {
        self.ip
    }
}

impl Backend for VerbsBackend {
    type T = VerbsTransport;
    fn transport(&self, max_message_size: usize) -> VerbsTransport {
        VerbsTransport::new(VerbsConfig::with_max_message_size(max_message_size))
            .expect("verbs transport")
    }
    fn listen_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, 0)
    }
}
