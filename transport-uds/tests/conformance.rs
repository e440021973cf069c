//! The transport-core conformance suite, against Unix-domain sockets.

use transport_uds::conformance::UdsBackend;

transport_core::conformance_tests!(UdsBackend);
