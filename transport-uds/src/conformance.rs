//! Unix-domain sockets as a backend of transport-core's conformance and hostile-peer suites
//! (feature `conformance`).

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::UnixStream;
use transport_core::conformance::Backend;
use transport_core::hostile::StreamBackend;
use transport_core::stream::StreamConfig;

use crate::{UdsAddr, UdsConfig, UdsTransport};

/// Unix sockets in a per-process temporary folder, a fresh path per listener.
#[derive(Debug, Clone, Copy, Default)]
pub struct UdsBackend;

impl Backend for UdsBackend {
    type T = UdsTransport;
    fn transport(&self, max_message_size: usize) -> UdsTransport {
        UdsTransport::new(UdsConfig::with_max_message_size(max_message_size))
    }
    fn listen_addr(&self) -> UdsAddr {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!("transport-uds-tests-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create the socket folder");
        UdsAddr(dir.join(format!("s{}.sock", N.fetch_add(1, Ordering::Relaxed))))
    }
}

impl StreamBackend for UdsBackend {
    type Raw = UnixStream;
    fn stream_transport(&self, stream: StreamConfig) -> UdsTransport {
        UdsTransport::new(UdsConfig {
            stream,
            ..UdsConfig::default()
        })
    }
    async fn connect_raw(&self, addr: &UdsAddr) -> std::io::Result<UnixStream> {
        UnixStream::connect(&addr.0).await
    }
}
