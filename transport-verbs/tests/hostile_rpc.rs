//! transport-core's RPC-level hostile-peer cases (`transport_test::hostile_tests!`), against
//! verbs: a reused request id, a peer that closes with calls parked in handlers, request bytes
//! past the per-connection and server budgets, an idle connection.
//!
//! Like the conformance suite, every case needs an RDMA device and is ignored by default;
//! `cargo xtask testbed verbs` runs them in the soft-RoCE guest (`--include-ignored`). The
//! byte-level cases (announced lengths, stalled frames) are the verbs engine's own:
//! `tests/hostile.rs`.

use transport_verbs::conformance::VerbsBackend;

transport_test::hostile_tests!(
    VerbsBackend::for_this_machine(),
    #[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
);
