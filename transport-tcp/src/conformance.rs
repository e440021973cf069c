//! TCP on loopback as a backend of transport-test's conformance and hostile-peer suites
//! (feature `conformance`).

use std::net::SocketAddr;
use tokio::net::TcpStream;
use transport_framed::StreamConfig;
use transport_test::conformance::Backend;
use transport_test::hostile::StreamBackend;

use crate::{TcpConfig, TcpTransport};

/// TCP on 127.0.0.1, a fresh port per listener.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpBackend;

impl Backend for TcpBackend {
    type T = TcpTransport;
    fn transport(&self, max_message_size: usize) -> TcpTransport {
        TcpTransport::new(TcpConfig::with_max_message_size(max_message_size))
    }
    fn listen_addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }
}

impl StreamBackend for TcpBackend {
    type Raw = TcpStream;
    fn stream_transport(&self, stream: StreamConfig) -> TcpTransport {
        TcpTransport::new(TcpConfig {
            stream,
            ..TcpConfig::default()
        })
    }
    async fn connect_raw(&self, addr: &SocketAddr) -> std::io::Result<TcpStream> {
        TcpStream::connect(addr).await
    }
}
