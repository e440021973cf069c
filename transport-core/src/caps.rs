//! What a backend can do.

/// The capability table of a transport backend (libfabric's `fi_info`, in small).
///
/// `bench` prints it, and code on top of a transport reads it instead of matching on
/// backend names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Short backend name: `tcp`, `uds`, `verbs`.
    pub name: &'static str,
    /// Largest message (header + payload) this endpoint accepts, in bytes.
    pub max_message_size: usize,
    /// Largest header, in bytes (see [`crate::MAX_HEADER_LEN`]).
    pub max_header_len: usize,
    /// Payloads up to this size are sent inline with the work request (0: no inline sends).
    pub inline_size: usize,
    /// One-sided RDMA READ is available.
    pub rdma_read: bool,
    /// One-sided RDMA WRITE is available.
    pub rdma_write: bool,
    /// Payloads in buffers from [`crate::BufferPool::alloc`] are sent without a user-space copy.
    pub zero_copy_send: bool,
    /// Received payloads are handed over without a user-space copy.
    pub zero_copy_recv: bool,
    /// Buffers are registered with the NIC (verbs).
    pub registered_buffers: bool,
    /// Progress is driven by a pollable file descriptor (socket or completion channel).
    pub event_fd: bool,
    /// Messages are delivered reliably and in order.
    pub reliable_ordered: bool,
}
