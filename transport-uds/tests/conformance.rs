//! The transport-core conformance suite, against Unix-domain sockets.

use std::sync::atomic::{AtomicU64, Ordering};
use transport_core::conformance::Backend;
use transport_uds::{UdsAddr, UdsConfig, UdsTransport};

struct Uds;

impl Backend for Uds {
    type T = UdsTransport;
    fn transport(&self, max_message_size: usize) -> UdsTransport {
        UdsTransport::new(UdsConfig::with_max_message_size(max_message_size))
    }
    fn listen_addr(&self) -> UdsAddr {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir =
            std::env::temp_dir().join(format!("transport-uds-conformance-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        UdsAddr(dir.join(format!("s{}.sock", N.fetch_add(1, Ordering::Relaxed))))
    }
}

transport_core::conformance_tests!(Uds);
