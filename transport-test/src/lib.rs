//! # transport-test
//!
//! The suites every transport backend runs, written once against `transport-core`'s traits
//! and `transport-rpc` (as libfabric's and UCX's test suites run against every provider, and
//! as tower-test serves tower's services). A backend implements [`conformance::Backend`] (how
//! to build its transport and a fresh address) and expands the suites in a test file:
//!
//! - [`conformance_tests!`]: connect / listen / accept, messages in order and whole, limits,
//!   errors, RPC calls, oneways, deadlines and cancellation, metrics.
//! - [`hostile_tests!`] and [`hostile_stream_tests!`]: a peer that lies, stalls, floods or dies
//!   mid-message gets a typed error, never a hang, panic or unbounded allocation.
//!
//! Backends take this crate as a dev-dependency (or behind a `conformance` feature, to export
//! their [`conformance::Backend`] for other crates' tests).

pub mod conformance;
pub mod hostile;
