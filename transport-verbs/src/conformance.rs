//! Verbs as a backend of transport-test's conformance suite (feature `conformance`), with the
//! rule every verbs test suite follows:
//!
//! - a test that needs an RDMA device is marked
//!   `#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]`, so that
//!   `cargo test` on a machine without one lists it as ignored instead of passing it empty;
//! - `cargo test -- --include-ignored` runs it (the soft-RoCE guest of `cargo xtask testbed
//!   verbs` does, or a host with a device), and then a missing device fails it:
//!   [`VerbsBackend::for_this_machine`] panics, naming why.

use std::net::{IpAddr, SocketAddr};
use transport_test::conformance::Backend;

use crate::{VerbsConfig, VerbsTransport};

/// The RDMA device of this machine, addressed by `TB_IP_ADDR` or its RoCE v2 IPv4 GID.
#[derive(Debug, Clone, Copy)]
pub struct VerbsBackend {
    ip: IpAddr,
}

impl VerbsBackend {
    /// The backend of this machine's RDMA device.
    ///
    /// # Panics
    /// When there is no usable device: a test that needs one is ignored by default and runs
    /// only when asked for, so it must not pass without it. Without a device the transport
    /// must report the typed no-device error; anything else panics with what it reported.
    pub fn for_this_machine() -> VerbsBackend {
        if let Err(e) = VerbsTransport::new(VerbsConfig::default()) {
            assert!(
                e.is_no_device(),
                "expected the typed no-device error: {e:?}"
            );
            panic!(
                "this test needs an RDMA device ({e}); `cargo xtask testbed verbs` runs it in \
                 the soft-RoCE guest"
            );
        }
        let ip = match std::env::var("TB_IP_ADDR") {
            Ok(s) => s.parse().expect("TB_IP_ADDR is an IP address"),
            Err(_) => crate::local_rdma_ip()
                .expect("set TB_IP_ADDR to the RDMA interface's IP (no RoCE v2 IPv4 GID)"),
        };
        VerbsBackend { ip }
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
