//! RDMA verbs backend for `transport-core`.
//!
//! Work in progress: see the project README for the plan (issue "verbs backend").
//! What exists today is device discovery ([`device`]): list the RDMA devices with their ports and
//! GID tables, open one, allocate a protection domain and register memory, with one typed error
//! ([`VerbsError`]) that says clearly when there is no RDMA device or no rdma-core.
//!
//! The binding is [`sideway`], which loads libibverbs at run time: a binary built with this crate
//! starts on a machine without rdma-core and reports [`VerbsError::RdmaCoreMissing`].
//! All `unsafe` code of the crate lives in one private module (`ffi`).
//!
//! Without RDMA hardware, the soft-RoCE test bed runs the tests in a QEMU guest with `rdma_rxe`:
//! `cargo xtask testbed verbs` (see `docs/testbed.md`).

pub mod device;
mod error;
mod ffi;

pub use device::{
    list_devices, open_device, open_first_device, Device, DeviceInfo, GidInfo, GidType, LinkLayer,
    PortInfo, PortState, ProtectionDomain, RegisteredBuffer,
};
pub use error::VerbsError;
