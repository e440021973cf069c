//! Status codes, the thread's last error message, and the guard every entry point runs in
//! (no panic crosses the boundary).

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use transport_core::TransportError;
use transport_rpc::RpcError;

/// What a call returned. `TP_OK` is 0; every other value is an error, described by
/// `tp_last_error()` on the calling thread.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tp_status {
    /// Success.
    TP_OK = 0,
    /// A NULL handle or buffer, a size over a limit, a URI that does not parse.
    TP_ERR_INVALID_ARGUMENT = 1,
    /// The peer closed the connection cleanly, or this side closed it.
    TP_ERR_CLOSED = 2,
    /// The time limit given to the call passed.
    TP_ERR_TIMED_OUT = 3,
    /// A message over the connection's (or the peer's) size limit; nothing was sent.
    TP_ERR_TOO_LARGE = 4,
    /// The operation is not possible here (for example a blocking call from a handler).
    TP_ERR_UNSUPPORTED = 5,
    /// An operating-system or device error; the connection is unusable.
    TP_ERR_IO = 6,
    /// The peer broke the protocol (bad framing, a malformed reply); the connection is unusable.
    TP_ERR_PROTOCOL = 7,
    /// The RPC server answered the call with an error status (see `tp_last_error()`).
    TP_ERR_REMOTE = 8,
    /// A `verbs://` URI on a machine without a usable RDMA device.
    TP_ERR_NO_DEVICE = 9,
    /// A bug inside the library (a caught panic); the handle involved should be freed.
    TP_ERR_INTERNAL = 10,
    /// Nothing is there yet (`tp_try_recv`, `tp_try_accept`): poll the handle's descriptor.
    TP_ERR_WOULD_BLOCK = 11,
}

/// An error on its way out: the code and what to tell.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) status: tp_status,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(status: tp_status, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }

    /// A bad argument.
    pub(crate) fn arg(message: impl Into<String>) -> Failure {
        Failure::new(tp_status::TP_ERR_INVALID_ARGUMENT, message)
    }
}

impl From<TransportError> for Failure {
    fn from(e: TransportError) -> Failure {
        let status = match e.original() {
            TransportError::Closed => tp_status::TP_ERR_CLOSED,
            TransportError::MessageTooLarge { .. } => tp_status::TP_ERR_TOO_LARGE,
            TransportError::Malformed(_) | TransportError::Truncated { .. } => {
                tp_status::TP_ERR_PROTOCOL
            }
            TransportError::Unsupported(_) => tp_status::TP_ERR_UNSUPPORTED,
            TransportError::InvalidAddress { .. } => tp_status::TP_ERR_INVALID_ARGUMENT,
            TransportError::Stalled { .. } => tp_status::TP_ERR_TIMED_OUT,
            _ => tp_status::TP_ERR_IO,
        };
        Failure::new(status, e.to_string())
    }
}

impl From<RpcError> for Failure {
    fn from(e: RpcError) -> Failure {
        let status = match &e {
            RpcError::Remote(_) => tp_status::TP_ERR_REMOTE,
            RpcError::DeadlineExceeded(_) => tp_status::TP_ERR_TIMED_OUT,
            RpcError::ConnectionClosed | RpcError::ClientClosed => tp_status::TP_ERR_CLOSED,
            RpcError::RequestTooLarge { .. } | RpcError::ResponseTooLarge { .. } => {
                tp_status::TP_ERR_TOO_LARGE
            }
            RpcError::Protocol(_) => tp_status::TP_ERR_PROTOCOL,
            _ => tp_status::TP_ERR_IO,
        };
        Failure::new(status, e.to_string())
    }
}

thread_local! {
    /// The calling thread's last error; `None` after a success (no allocation on the fast path).
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Records `message` as this thread's last error (`None`: the last call succeeded).
fn set_last(message: Option<&str>) {
    LAST_ERROR.with(|l| {
        let mut l = l.borrow_mut();
        match message {
            // An interior NUL would cut the C string short: show it instead.
            Some(m) => *l = Some(CString::new(m.replace('\0', "\\0")).unwrap_or_default()),
            None if l.is_some() => *l = None,
            None => {}
        }
    });
}

/// This thread's last error message ("" when the last call succeeded), valid until the
/// thread's next call into the library.
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|l| match &*l.borrow() {
        Some(c) => c.as_ptr(),
        None => c"".as_ptr(),
    })
}

/// Runs one entry point: its error becomes the status and this thread's message, and a panic
/// becomes `TP_ERR_INTERNAL` instead of unwinding into C.
pub(crate) fn guard(f: impl FnOnce() -> Result<(), Failure>) -> tp_status {
    let outcome = catch_unwind(AssertUnwindSafe(f));
    match outcome {
        Ok(Ok(())) => {
            set_last(None);
            tp_status::TP_OK
        }
        Ok(Err(e)) => {
            set_last(Some(&e.message));
            e.status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_last(Some(&format!("internal error: {what}")));
            tp_status::TP_ERR_INTERNAL
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: the pointer is this thread's CString, alive until the next set_last.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn an_error_sets_the_status_and_the_message_and_success_clears_it() {
        let s = guard(|| Err(Failure::arg("uri is NULL")));
        assert_eq!(s, tp_status::TP_ERR_INVALID_ARGUMENT);
        assert_eq!(last(), "uri is NULL");
        assert_eq!(guard(|| Ok(())), tp_status::TP_OK);
        assert_eq!(last(), "");
    }

    #[test]
    fn a_panic_is_an_internal_error_not_an_unwind() {
        let s = guard(|| panic!("boom"));
        assert_eq!(s, tp_status::TP_ERR_INTERNAL);
        assert!(last().contains("boom"), "{}", last());
    }

    #[test]
    fn transport_errors_map_to_their_codes() {
        let f = Failure::from(TransportError::Closed);
        assert_eq!(f.status, tp_status::TP_ERR_CLOSED);
        let f = Failure::from(TransportError::MessageTooLarge {
            len: 10,
            max: 5,
            header: Default::default(),
        });
        assert_eq!(f.status, tp_status::TP_ERR_TOO_LARGE);
        assert_eq!(
            Failure::from(TransportError::Malformed("bad magic")).status,
            tp_status::TP_ERR_PROTOCOL
        );
    }
}
