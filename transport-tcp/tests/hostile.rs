//! transport-core's hostile-peer suite, against TCP on loopback.

use transport_tcp::conformance::TcpBackend;

transport_test::hostile_tests!(TcpBackend);
transport_test::hostile_stream_tests!(TcpBackend);
