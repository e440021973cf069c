//! transport-core's hostile-peer suite, against Unix-domain sockets.

use transport_uds::conformance::UdsBackend;

transport_test::hostile_tests!(UdsBackend);
transport_test::hostile_stream_tests!(UdsBackend);
