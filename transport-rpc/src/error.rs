//! RPC statuses and errors.

use super::header::{HeaderError, Kind};
use bytes::{BufMut, Bytes, BytesMut};
use std::sync::Arc;
use std::time::Duration;
use transport_core::TransportError;

/// Status codes carried by [`super::Kind::Error`] responses. Applications use codes from
/// [`code::APPLICATION`] up.
pub mod code {
    /// The server has no handler for the method.
    pub const UNKNOWN_METHOD: u32 = 1;
    /// The request payload was not understood.
    pub const INVALID_ARGUMENT: u32 = 2;
    /// The server's own time limit for the handler passed.
    pub const DEADLINE_EXCEEDED: u32 = 3;
    /// The request exceeds the server's message size limit.
    pub const MESSAGE_TOO_LARGE: u32 = 4;
    /// The handler failed unexpectedly.
    pub const INTERNAL: u32 = 5;
    /// The server is shutting down.
    pub const UNAVAILABLE: u32 = 6;
    /// A request reused the id of a call still in flight on the connection; the call already
    /// running is not affected.
    pub const REQUEST_ID_IN_USE: u32 = 7;
    /// First code free for applications.
    pub const APPLICATION: u32 = 1000;
}

/// Longest status message sent on the wire; longer ones are cut at a char boundary.
pub const MAX_STATUS_MESSAGE: usize = 4096;

/// An error result produced by a handler: a code and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("status {code}: {message}")]
pub struct Status {
    /// See [`code`].
    pub code: u32,
    /// What went wrong.
    pub message: String,
}

impl Status {
    /// A status with a code and message.
    pub fn new(code: u32, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }

    /// No handler for `method`.
    pub fn unknown_method(method: u32) -> Status {
        Status::new(code::UNKNOWN_METHOD, format!("unknown method {method}"))
    }

    /// The answer to a request over the server's message limit (both servers send it).
    pub(crate) fn request_too_large(len: u64, max: u64) -> Status {
        Status::new(
            code::MESSAGE_TOO_LARGE,
            format!("request of {len} bytes exceeds the server limit of {max} bytes"),
        )
    }

    /// The answer to a call whose handler ran past `ServerConfig::handler_timeout`.
    pub(crate) fn handler_timed_out(limit: Duration) -> Status {
        Status::new(
            code::DEADLINE_EXCEEDED,
            format!("handler exceeded the server's limit of {limit:?}"),
        )
    }

    /// The payload form: code (u32 LE) then the UTF-8 message.
    pub fn encode(&self) -> Bytes {
        let mut msg = self.message.as_str();
        if msg.len() > MAX_STATUS_MESSAGE {
            let mut end = MAX_STATUS_MESSAGE;
            while !msg.is_char_boundary(end) {
                end -= 1;
            }
            msg = &msg[..end];
        }
        let mut b = BytesMut::with_capacity(4 + msg.len());
        b.put_u32_le(self.code);
        b.put_slice(msg.as_bytes());
        b.freeze()
    }

    /// Parses the payload form; never fails (a short payload gives [`code::INTERNAL`],
    /// invalid UTF-8 is replaced, the message is bounded by [`MAX_STATUS_MESSAGE`]).
    pub fn decode(payload: &[u8]) -> Status {
        if payload.len() < 4 {
            return Status::new(code::INTERNAL, "malformed error response");
        }
        let code = u32::from_le_bytes(payload[..4].try_into().expect("4 bytes"));
        let text = &payload[4..payload.len().min(4 + MAX_STATUS_MESSAGE)];
        Status::new(code, String::from_utf8_lossy(text).into_owned())
    }
}

/// Why a call failed. Cheap to clone: one connection failure is reported to every pending call.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The server answered with an error status.
    #[error("remote error {}: {}", .0.code, .0.message)]
    Remote(Status),
    /// The call's deadline passed; the server was told to cancel it.
    #[error("deadline of {0:?} exceeded")]
    DeadlineExceeded(Duration),
    /// The peer closed the connection before answering.
    #[error("connection closed by peer before the call completed")]
    ConnectionClosed,
    /// The connection failed (peer died, reset, truncated or malformed stream, ...).
    #[error("connection lost: {0}")]
    ConnectionLost(Arc<TransportError>),
    /// The request is larger than the connection's message limit; nothing was sent.
    #[error("request of {len} bytes exceeds the message limit of {max} bytes")]
    RequestTooLarge {
        /// Request size (header + payload).
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The response was larger than this client's message limit and was discarded.
    #[error("response of {len} bytes exceeds this client's message limit of {max} bytes")]
    ResponseTooLarge {
        /// Response size (header + payload).
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The peer broke the protocol; the connection was closed.
    #[error("protocol violation by peer: {0}")]
    Protocol(ProtocolError),
    /// The client was closed.
    #[error("client closed")]
    ClientClosed,
}

impl RpcError {
    /// True for errors that mean the connection is gone (every later call fails too).
    pub fn is_connection_error(&self) -> bool {
        matches!(
            self,
            RpcError::ConnectionClosed
                | RpcError::ConnectionLost(_)
                | RpcError::Protocol(_)
                | RpcError::ClientClosed
        )
    }
}

impl From<TransportError> for RpcError {
    fn from(e: TransportError) -> Self {
        match e {
            TransportError::MessageTooLarge { len, max, .. } => {
                RpcError::RequestTooLarge { len, max }
            }
            TransportError::Closed => RpcError::ConnectionClosed,
            e => RpcError::ConnectionLost(Arc::new(e)),
        }
    }
}

/// How a peer broke the RPC protocol (see [`RpcError::Protocol`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A message's RPC header is not valid.
    #[error(transparent)]
    Header(#[from] HeaderError),
    /// A message of a kind that side never sends: a server sent a request or a cancel, or a
    /// client sent a response or an error.
    #[error("a {from} sent a {kind:?} message")]
    UnexpectedKind {
        /// Who sent it: `"server"` or `"client"`.
        from: &'static str,
        /// What it sent.
        kind: Kind,
    },
}

impl From<HeaderError> for RpcError {
    fn from(e: HeaderError) -> Self {
        RpcError::Protocol(ProtocolError::Header(e))
    }
}

impl From<ProtocolError> for RpcError {
    fn from(e: ProtocolError) -> Self {
        RpcError::Protocol(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_round_trip_and_bounds() {
        let s = Status::new(code::APPLICATION + 7, "nope ✓");
        assert_eq!(Status::decode(&s.encode()), s);
        assert_eq!(Status::decode(&[1, 2]).code, code::INTERNAL);
        let long = Status::new(9, "é".repeat(MAX_STATUS_MESSAGE));
        let enc = long.encode();
        assert!(enc.len() <= 4 + MAX_STATUS_MESSAGE);
        let dec = Status::decode(&enc);
        assert!(dec.message.chars().all(|c| c == 'é'));
    }
}
