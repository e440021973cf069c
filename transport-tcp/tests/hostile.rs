//! transport-core's hostile-peer suite, against TCP on loopback.

use transport_tcp::conformance::TcpBackend;

transport_core::hostile_tests!(TcpBackend);
transport_core::hostile_stream_tests!(TcpBackend);
