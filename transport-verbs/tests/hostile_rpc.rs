//! transport-core's RPC-level hostile-peer cases (`transport_core::hostile_tests!`), against
//! verbs: a reused request id, a peer that closes with calls parked in handlers, request bytes
//! past the per-connection and server budgets, an idle connection.
//!
//! Like the conformance suite, with `TRANSPORT_VERBS_REQUIRE_DEVICE=1` (the soft-RoCE guest of
//! `cargo xtask testbed verbs`) every case runs for real; on a machine without an RDMA device
//! each case checks the typed no-device error and returns, and the guest run checks that all
//! of them passed there. The byte-level cases (announced lengths, stalled frames) are the verbs
//! engine's own: `tests/hostile.rs`.

use transport_verbs::conformance::VerbsBackend;

transport_core::hostile_tests!(match VerbsBackend::for_this_machine() {
    Some(b) => b,
    None => return,
});
