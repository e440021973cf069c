//! The classic middleware scenarios (issue 7): typed payloads through serde, many concurrent
//! clients with trivial and slow handlers, and the client's connection / in-flight shape.
//!
//! These are transport-generic: each runs over any [`transport_core::Transport`] against a
//! server running [`load::ScenarioHandler`].

pub mod load;
pub mod typed;
