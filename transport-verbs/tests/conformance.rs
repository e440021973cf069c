//! The transport-core conformance suite, against verbs.
//!
//! Every case needs an RDMA device and is ignored by default: `cargo test` on a machine
//! without one lists them as ignored. `cargo test -- --include-ignored` runs them (the
//! soft-RoCE guest of `cargo xtask testbed verbs` does, and checks that all of them passed),
//! and then a missing device fails them.

use transport_verbs::conformance::VerbsBackend;

transport_test::conformance_tests!(
    VerbsBackend::for_this_machine(),
    #[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
);
