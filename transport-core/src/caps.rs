//! What a backend can do.

/// The capability table of a transport backend (libfabric's `fi_info`, in small).
///
/// `bench` prints it, and code on top of a transport reads it instead of matching on
/// backend names.
///
/// Backends outside this crate start from [`Capabilities::new`] and set what they offer:
///
/// ```
/// let mut caps = transport_core::Capabilities::new("mine", 1 << 20);
/// caps.zero_copy_send = true;
/// assert!(caps.reliable_ordered && !caps.rdma_read);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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

impl Capabilities {
    /// A reliable, ordered backend called `name` that accepts messages up to
    /// `max_message_size` bytes with headers up to [`crate::MAX_HEADER_LEN`], and offers
    /// nothing else: no inline sends, no one-sided operations, no zero-copy, no registered
    /// buffers, no event descriptor. Set the fields for what the backend does offer.
    pub fn new(name: &'static str, max_message_size: usize) -> Capabilities {
        Capabilities {
            name,
            max_message_size,
            max_header_len: crate::MAX_HEADER_LEN,
            inline_size: 0,
            rdma_read: false,
            rdma_write: false,
            zero_copy_send: false,
            zero_copy_recv: false,
            registered_buffers: false,
            event_fd: false,
            reliable_ordered: true,
        }
    }
}
