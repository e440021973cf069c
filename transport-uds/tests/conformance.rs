//! The transport-core conformance suite, against Unix-domain sockets.

use transport_uds::conformance::UdsBackend;

transport_test::conformance_tests!(UdsBackend);
