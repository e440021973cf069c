//! The transport error type.

use crate::message::HeaderBytes;
use std::io;

/// Why a transport operation failed.
///
/// Every variant but [`TransportError::MessageTooLarge`] on the receive side leaves the
/// connection unusable; [`TransportError::is_fatal`] tells which is which.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer closed the connection cleanly between two messages.
    #[error("connection closed by peer")]
    Closed,
    /// The peer went away in the middle of a message: the bytes received so far are discarded.
    #[error(
        "connection lost in the middle of a message ({received} of {expected} bytes received)"
    )]
    Truncated {
        /// Bytes of the frame received before the connection ended.
        received: u64,
        /// Bytes the frame announced (prefix included), or 0 when its prefix was incomplete.
        expected: u64,
    },
    /// A message (header + payload) is larger than the configured maximum.
    ///
    /// On send nothing was written. On receive the frame was skipped without buffering its
    /// payload; `header` holds its header so that a protocol on top can answer it, and the
    /// connection stays usable.
    #[error("message of {len} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// Size of the message (header + payload).
        len: u64,
        /// The configured maximum.
        max: u64,
        /// The header of the rejected message (receive side), empty on the send side.
        header: HeaderBytes,
    },
    /// The byte stream does not carry this framing (wrong magic, version or lengths).
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
    /// The operation needs something the backend does not offer.
    #[error("not supported by this transport: {0}")]
    Unsupported(&'static str),
    /// The address could not be parsed or resolved.
    #[error("invalid address `{addr}`: {reason}")]
    InvalidAddress {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An operating-system error.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// A backend-specific failure (for example a verbs work completion error), already worded.
    #[error("{0}")]
    Backend(String),
}

impl TransportError {
    /// False only for errors after which the same connection can still send and receive.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, TransportError::MessageTooLarge { .. })
    }
}
