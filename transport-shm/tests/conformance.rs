//! The transport-core conformance suite, against shared-memory connections.

use std::sync::atomic::{AtomicU64, Ordering};

use transport_shm::conn::ShmConfig;
use transport_shm::ShmTransport;
use transport_test::conformance::Backend;
use transport_uds::UdsAddr;

/// Shared-memory connections set up over Unix sockets in one temporary folder, a fresh path
/// per listener.
#[derive(Debug, Clone, Copy, Default)]
struct ShmBackend;

impl Backend for ShmBackend {
    type T = ShmTransport;
    fn transport(&self, max_message_size: usize) -> ShmTransport {
        ShmTransport::new(ShmConfig::with_max_message_size(max_message_size))
    }
    fn listen_addr(&self) -> UdsAddr {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join("transport-shm-tests");
        std::fs::create_dir_all(&dir).expect("create the socket folder");
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{}-{n}.sock", std::process::id()));
        UdsAddr(path)
    }
}

transport_test::conformance_tests!(ShmBackend);
