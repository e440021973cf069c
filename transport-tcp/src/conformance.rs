//! TCP on loopback as a backend of transport-core's conformance suite (feature `conformance`).

use std::net::SocketAddr;
use transport_core::conformance::Backend;

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
