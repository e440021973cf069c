//! The transport error type.

use crate::message::HeaderBytes;
use std::io;
use std::sync::Arc;

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
    /// A message had started arriving and no more of it came for the configured time
    /// ([`StreamConfig::frame_timeout`](crate::stream::StreamConfig::frame_timeout)), or its
    /// memory could not be had from the budget in that time: the connection is closed.
    #[error(
        "no progress for {after:?} in the middle of a message ({received} of {expected} bytes received)"
    )]
    Stalled {
        /// Bytes of the frame received so far.
        received: u64,
        /// Bytes the frame announced (prefix included), or 0 when its prefix was incomplete.
        expected: u64,
        /// The time limit that passed.
        after: std::time::Duration,
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
    /// A backend-specific failure (a verbs work completion error, a protocol violation by the
    /// peer, a failed registration, ...), kept as the backend's own typed error: see
    /// [`TransportError::backend_error`] to get it back.
    #[error(transparent)]
    Backend(BackendError),
}

impl TransportError {
    /// False only for errors after which the same connection can still send and receive.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, TransportError::MessageTooLarge { .. })
    }

    /// Wraps a backend's own error, keeping its type (see [`TransportError::backend_error`]).
    pub fn backend(e: impl std::error::Error + Send + Sync + 'static) -> TransportError {
        TransportError::Backend(BackendError::new(e))
    }

    /// The backend's error of type `E` behind [`TransportError::Backend`], if that is what this
    /// is: `e.backend_error::<transport_verbs::VerbsError>()`.
    pub fn backend_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            TransportError::Backend(b) => b.downcast_ref(),
            _ => None,
        }
    }
}

/// A backend's typed error behind [`TransportError::Backend`]: shared (cheap to clone, so a
/// connection can report the same cause to every pending call) and never turned into text.
///
/// Its `Display` and `source` are the backend error's own.
#[derive(Clone)]
pub struct BackendError(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl BackendError {
    /// Wraps `e`.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> BackendError {
        BackendError(Arc::new(e))
    }

    /// Wraps an error that is already shared.
    pub fn from_arc(e: Arc<dyn std::error::Error + Send + Sync + 'static>) -> BackendError {
        BackendError(e)
    }

    /// The backend error as its own type, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        let e: &(dyn std::error::Error + 'static) = &*self.0;
        e.downcast_ref::<E>()
    }

    /// The backend error.
    pub fn get(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl std::fmt::Debug for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
