//! transport-core's hostile-peer suite, against Unix-domain sockets.

use transport_uds::conformance::UdsBackend;

transport_core::hostile_tests!(UdsBackend);
transport_core::hostile_stream_tests!(UdsBackend);
