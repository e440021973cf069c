//! The transport-core conformance suite, against TCP on loopback.

use transport_tcp::conformance::TcpBackend;

transport_test::conformance_tests!(TcpBackend);
