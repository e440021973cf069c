//! The transport error type.

use crate::message::HeaderBytes;
use std::io;
use std::sync::Arc;

/// Why a transport operation failed.
///
/// Every variant but [`TransportError::MessageTooLarge`] on the receive side leaves the
/// connection unusable; [`TransportError::is_fatal`] tells which is which. A receiver asked
/// again after a fatal error answers [`TransportError::Failed`], which carries the first
/// error; [`TransportError::original`] sees through it:
///
/// ```
/// use transport_core::TransportError;
///
/// # fn handle(e: TransportError) {
/// match e.original() {
///     TransportError::Truncated { received, expected } => {
///         eprintln!("peer died {received} bytes into a {expected}-byte frame")
///     }
///     TransportError::MessageTooLarge { header, .. } => { /* answer `header`, go on */ }
///     other => eprintln!("connection lost: {other}"),
/// }
/// # }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer closed the connection cleanly between two messages.
    Closed,
    /// The peer went away in the middle of a message: the bytes received so far are discarded.
    Truncated {
        /// Bytes of the frame received before the connection ended.
        received: u64,
        /// Bytes the frame announced (prefix included), or 0 when its prefix was incomplete.
        expected: u64,
    },
    /// A message had started arriving and no more of it came for the configured time
    /// (`transport_framed::StreamConfig::frame_timeout`), or its
    /// memory could not be had from the budget in that time: the connection is closed.
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
    MessageTooLarge {
        /// Size of the message (header + payload).
        len: u64,
        /// The configured maximum.
        max: u64,
        /// The header of the rejected message (receive side), empty on the send side.
        header: HeaderBytes,
    },
    /// The byte stream does not carry this framing (wrong magic, version or lengths).
    Malformed(&'static str),
    /// The operation needs something the backend does not offer.
    Unsupported(&'static str),
    /// The address could not be parsed or resolved.
    InvalidAddress {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An operating-system error.
    Io(io::Error),
    /// A backend-specific failure (a verbs work completion error, a protocol violation by the
    /// peer, a failed registration, ...), kept as the backend's own typed error: see
    /// [`TransportError::backend_error`] to get it back.
    Backend(BackendError),
    /// The connection failed earlier with the error inside (its [`source`]), and every
    /// operation on it since reports that: a stream receiver asked again after a fatal error
    /// (see `transport_framed::StreamReceiver`) answers this. Shared, so that
    /// each later call gets the same first error, typed; [`TransportError::original`] gets it
    /// back.
    ///
    /// [`source`]: std::error::Error::source
    Failed(Arc<TransportError>),
}

impl std::fmt::Display for TransportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportError::Closed => f.write_str("connection closed by peer"),
            TransportError::Truncated { received, expected } => write!(
                f,
                "connection lost in the middle of a message ({received} of {expected} bytes received)"
            ),
            TransportError::Stalled {
                received,
                expected,
                after,
            } => write!(
                f,
                "no progress for {after:?} in the middle of a message ({received} of {expected} bytes received)"
            ),
            TransportError::MessageTooLarge { len, max, .. } => {
                write!(f, "message of {len} bytes exceeds the limit of {max} bytes")
            }
            TransportError::Malformed(what) => write!(f, "malformed frame: {what}"),
            TransportError::Unsupported(what) => write!(f, "not supported by this transport: {what}"),
            TransportError::InvalidAddress { addr, reason } => {
                write!(f, "invalid address `{addr}`: {reason}")
            }
            TransportError::Io(e) => write!(f, "I/O error: {e}"),
            TransportError::Backend(e) => std::fmt::Display::fmt(e, f),
            TransportError::Failed(first) => write!(f, "the connection failed earlier: {first}"),
        }
    }
}

impl std::error::Error for TransportError {
    /// The I/O error behind [`TransportError::Io`], the backend error's own source behind
    /// [`TransportError::Backend`], and the first error behind [`TransportError::Failed`]
    /// (as a `TransportError`: `source().and_then(|s| s.downcast_ref::<TransportError>())`).
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TransportError::Io(e) => Some(e),
            TransportError::Backend(e) => std::error::Error::source(e),
            TransportError::Failed(first) => Some(&**first),
            _ => None,
        }
    }
}

impl From<io::Error> for TransportError {
    fn from(e: io::Error) -> TransportError {
        TransportError::Io(e)
    }
}

impl TransportError {
    /// False only for errors after which the same connection can still send and receive.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, TransportError::MessageTooLarge { .. })
    }

    /// The error the connection first failed with: for [`TransportError::Failed`] the error
    /// inside it, otherwise `self`.
    pub fn original(&self) -> &TransportError {
        let mut e = self;
        while let TransportError::Failed(first) = e {
            e = first;
        }
        e
    }

    /// A copy of this error (`TransportError` is not `Clone`: an [`io::Error`] is not), for
    /// code that returns an error and also keeps it to report again, as
    /// [`TransportError::Failed`] (`Arc::new(e.duplicate())`).
    ///
    /// Every variant copies exactly, except that an [`TransportError::Io`] error whose
    /// `io::Error` carries a custom inner error (`io::Error::new(kind, inner)`, not an OS
    /// error) is copied as its kind and message: `inner` cannot be shared.
    pub fn duplicate(&self) -> TransportError {
        match self {
            TransportError::Closed => TransportError::Closed,
            &TransportError::Truncated { received, expected } => {
                TransportError::Truncated { received, expected }
            }
            &TransportError::Stalled {
                received,
                expected,
                after,
            } => TransportError::Stalled {
                received,
                expected,
                after,
            },
            &TransportError::MessageTooLarge { len, max, header } => {
                TransportError::MessageTooLarge { len, max, header }
            }
            &TransportError::Malformed(what) => TransportError::Malformed(what),
            &TransportError::Unsupported(what) => TransportError::Unsupported(what),
            TransportError::InvalidAddress { addr, reason } => TransportError::InvalidAddress {
                addr: addr.clone(),
                reason: reason.clone(),
            },
            TransportError::Io(e) => TransportError::Io(duplicate_io(e)),
            TransportError::Backend(b) => TransportError::Backend(b.clone()),
            TransportError::Failed(first) => TransportError::Failed(first.clone()),
        }
    }

    /// Wraps a backend's own error, keeping its type (see [`TransportError::backend_error`]).
    pub fn backend(e: impl std::error::Error + Send + Sync + 'static) -> TransportError {
        TransportError::Backend(BackendError::new(e))
    }

    /// The backend's error of type `E` behind [`TransportError::Backend`] (also when the
    /// connection [`Failed`](TransportError::Failed) earlier with it), if that is what this
    /// is: `e.backend_error::<transport_verbs::VerbsError>()`.
    pub fn backend_error<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self.original() {
            TransportError::Backend(b) => b.downcast_ref(),
            _ => None,
        }
    }
}

/// An equal `io::Error`: exact for OS errors and bare kinds; one with a custom inner error keeps
/// its kind and message.
fn duplicate_io(e: &io::Error) -> io::Error {
    match (e.raw_os_error(), e.get_ref()) {
        (Some(code), _) => io::Error::from_raw_os_error(code),
        (None, None) if e.to_string() == io::Error::from(e.kind()).to_string() => {
            io::Error::from(e.kind())
        }
        (None, _) => io::Error::new(e.kind(), e.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    #[test]
    fn failed_shows_and_sources_the_first_error() {
        let first = Arc::new(TransportError::Truncated {
            received: 3,
            expected: 10,
        });
        let e = TransportError::Failed(first.clone());
        assert!(e.is_fatal());
        assert_eq!(
            e.to_string(),
            "the connection failed earlier: connection lost in the middle of a message \
             (3 of 10 bytes received)"
        );
        let source = e.source().and_then(|s| s.downcast_ref::<TransportError>());
        assert!(source.is_some_and(|s| std::ptr::eq(s, &*first)));
        let twice = TransportError::Failed(Arc::new(e));
        assert!(std::ptr::eq(twice.original(), &*first));
        assert!(matches!(
            TransportError::Closed.original(),
            TransportError::Closed
        ));
    }

    #[test]
    fn backend_errors_are_found_behind_failed() {
        let e = TransportError::Failed(Arc::new(TransportError::backend(io::Error::other(
            "completion error",
        ))));
        assert!(e.backend_error::<io::Error>().is_some());
    }

    #[test]
    fn duplicates_are_equal_and_os_errors_exact() {
        let os = TransportError::Io(io::Error::from_raw_os_error(104));
        let TransportError::Io(copy) = os.duplicate() else {
            panic!()
        };
        assert_eq!(copy.raw_os_error(), Some(104));
        assert_eq!(
            copy.to_string(),
            io::Error::from_raw_os_error(104).to_string()
        );
        let bare = TransportError::from(io::Error::from(io::ErrorKind::WriteZero));
        assert_eq!(bare.duplicate().to_string(), bare.to_string());
        let custom = TransportError::Io(io::Error::new(io::ErrorKind::InvalidData, "tls alert"));
        let TransportError::Io(copy) = custom.duplicate() else {
            panic!()
        };
        assert_eq!(
            (copy.kind(), copy.to_string()),
            (io::ErrorKind::InvalidData, "tls alert".to_string())
        );
        let stalled = TransportError::Stalled {
            received: 1,
            expected: 2,
            after: std::time::Duration::from_secs(3),
        };
        assert!(matches!(
            stalled.duplicate(),
            TransportError::Stalled {
                received: 1,
                expected: 2,
                after
            } if after.as_secs() == 3
        ));
        let big = TransportError::MessageTooLarge {
            len: 5,
            max: 4,
            header: HeaderBytes::from(*b"hd"),
        };
        assert!(matches!(
            big.duplicate(),
            TransportError::MessageTooLarge { len: 5, max: 4, header } if header.as_slice() == b"hd"
        ));
    }
}
