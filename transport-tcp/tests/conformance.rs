//! The transport-core conformance suite, against TCP on loopback.

use std::net::SocketAddr;
use transport_core::conformance::Backend;
use transport_tcp::{TcpConfig, TcpTransport};

struct Tcp;

impl Backend for Tcp {
    type T = TcpTransport;
    fn transport(&self, max_message_size: usize) -> TcpTransport {
        TcpTransport::new(TcpConfig::with_max_message_size(max_message_size))
    }
    fn listen_addr(&self) -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }
}

transport_core::conformance_tests!(Tcp);
