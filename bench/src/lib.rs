//! The `bench` tool's library: workloads shared by the binary and its tests.

pub mod c_abi;
pub mod scenarios;
