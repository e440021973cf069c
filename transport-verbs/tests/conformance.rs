//! The transport-core conformance suite, against verbs.
//!
//! With `TRANSPORT_VERBS_REQUIRE_DEVICE=1` (the soft-RoCE guest of `cargo xtask testbed verbs`,
//! or a host with an RDMA device) every case runs for real and a missing device fails it.
//! Without it, on a machine with no RDMA device, each case checks that the transport reports the
//! typed no-device error and returns (it prints that it did; `cargo xtask testbed verbs`
//! checks that the guest ran all of them).

use transport_verbs::conformance::VerbsBackend;

transport_core::conformance_tests!(match VerbsBackend::for_this_machine() {
    Some(b) => b,
    None => return,
});
