//! The `extern "C"` functions: every raw pointer the caller passes is checked here (NULL,
//! lengths) and turned into a reference or a slice before the safe code in `handles` runs.

use crate::handles::{self, copy_in, handler_status, ReplySlot, Settings};
use crate::handles::{Accepted, AnyConn, AnyListener, AnyRpcClient, AnyRpcServer, Fed, Received};
use crate::status::{guard, last_error_ptr, tp_status, Failure};
use crate::uri::Endpoint;
use bytes::Bytes;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::runtime::Runtime;
use transport_core::{HeaderBytes, Message, SendBuffer, MAX_HEADER_LEN};
use transport_rpc::Request;

mod conn;
mod payload;
mod rpc;

pub use conn::*;
pub use payload::*;
pub use rpc::*;

/// A runtime: the threads that drive the connections opened with it. Every handle keeps its
/// runtime alive, so `tp_runtime_free` may come before the handles are freed.
pub struct tp_runtime {
    rt: Arc<Runtime>,
    /// Threads of its own drive the connections (`threads` > 0).
    background: bool,
}

/// Settings for opening a transport. Zero a struct (`tp_settings s = {0};`), set `size` to
/// `sizeof(tp_settings)`, then the fields wanted; a zero field keeps the default.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tp_settings {
    /// `sizeof(tp_settings)` as the caller was compiled with.
    pub size: u32,
    /// Largest message, header + payload, in bytes; 0: the transport's default.
    pub max_message_size: u64,
}

/// The largest header a message can carry, in bytes.
pub const TP_MAX_HEADER_LEN: usize = 64;

const _: () = assert!(TP_MAX_HEADER_LEN == MAX_HEADER_LEN);

fn timeout(ms: i32) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// The C string at `p`, checked.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that lives through the call.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(Failure::arg(format!("{what} is NULL")));
    }
    // SAFETY: not NULL; the caller promises a NUL-terminated string alive during the call.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Failure::arg(format!("{what} is not UTF-8")))
}

/// The `len` bytes at `p` (NULL allowed when `len` is 0), checked.
///
/// # Safety
/// `p` is NULL or points to `len` readable bytes that live through the call.
unsafe fn bytes_at<'a>(p: *const u8, len: usize, what: &str) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Failure::arg(format!(
            "{what} is NULL with a length of {len}"
        )));
    }
    if len > isize::MAX as usize {
        return Err(Failure::arg(format!(
            "{what}: a length of {len} is not possible"
        )));
    }
    // SAFETY: not NULL, length checked against isize::MAX; the caller promises `len` bytes.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// The handle at `p`, checked for NULL.
///
/// # Safety
/// `p` is NULL or a live handle of this type from this library.
unsafe fn handle<'a, T>(p: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: the caller promises NULL or a live handle; NULL is refused here.
    unsafe { p.as_ref() }.ok_or_else(|| Failure::arg(format!("{what} is NULL")))
}

/// The settings at `p` (NULL: the defaults), reading only the fields the caller's header
/// knows (those within its `size`).
///
/// # Safety
/// `p` is NULL or points to at least `size` readable bytes of a `tp_settings` (its first
/// field, `size`, always).
unsafe fn settings(p: *const tp_settings) -> Result<Settings, Failure> {
    if p.is_null() {
        return Ok(Settings::default());
    }
    // SAFETY: not NULL; the caller promises at least the `size` field, the struct's first.
    let size = unsafe { std::ptr::addr_of!((*p).size).read_unaligned() } as usize;
    if size < std::mem::size_of::<u32>() {
        return Err(Failure::arg(
            "tp_settings.size is not set (sizeof(tp_settings))",
        ));
    }
    let has = |end: usize| size >= end;
    let max_end = std::mem::offset_of!(tp_settings, max_message_size) + std::mem::size_of::<u64>();
    let max = if has(max_end) {
        // SAFETY: within the `size` bytes the caller promises.
        let m = unsafe { std::ptr::addr_of!((*p).max_message_size).read_unaligned() };
        (m != 0)
            .then(|| usize::try_from(m))
            .transpose()
            .map_err(|_| Failure::arg("tp_settings.max_message_size is too large"))?
    } else {
        None
    };
    Ok(Settings {
        max_message_size: max,
    })
}

/// The arguments every opening call takes (`tp_listen`, `tp_connect`, `tp_rpc_serve`, ...),
/// checked: the runtime, the URI parsed, the settings read.
///
/// # Safety
/// As for [`handle`], [`text`] and [`settings`].
unsafe fn opening<'a>(
    rt: *const tp_runtime,
    uri: *const c_char,
    settings: *const tp_settings,
) -> Result<(&'a tp_runtime, Endpoint, Settings), Failure> {
    // SAFETY: the caller's promises, passed on.
    let (rt, uri, s) = unsafe {
        (
            handle(rt, "rt")?,
            text(uri, "uri")?,
            self::settings(settings)?,
        )
    };
    Ok((rt, Endpoint::parse(uri)?, s))
}

/// The library's version, for example "0.1.0" (a static string).
#[no_mangle]
pub extern "C" fn tp_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// What the calling thread's last failed call reported ("" after a success). Valid until
/// that thread's next call into the library.
#[no_mangle]
pub extern "C" fn tp_last_error() -> *const c_char {
    last_error_ptr()
}

/// Starts a runtime: what drives the connections opened with it.
///
/// - `threads` 0: the threads that call into the library drive them, each while it waits in a
///   blocking call (a reply wakes the waiting thread itself: the lowest latency). Nothing
///   progresses between calls, so `tp_rpc_serve` needs a runtime with threads.
/// - `threads` N > 0: N threads of the runtime drive them in the background; a blocking call
///   waits for one of them to hand it the result (a cross-thread wake-up per call).
///
/// Either way a thread about to sleep first polls, for up to 50 µs, the sockets it waits on
/// (`transport_core::spin`), and backs off when that does not pay.
///
/// # Safety
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tp_runtime_new(threads: u32, out: *mut *mut tp_runtime) -> tp_status {
    guard(|| {
        let mut builder = if threads == 0 {
            tokio::runtime::Builder::new_current_thread()
        } else {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(threads as usize);
            b
        };
        let rt = builder
            .enable_all()
            .on_thread_park(transport_core::spin::park_hook(
                transport_core::spin::DEFAULT_BUDGET,
            ))
            .build()
            .map_err(|e| Failure::new(tp_status::TP_ERR_IO, format!("runtime: {e}")))?;
        let rt = tp_runtime {
            rt: Arc::new(rt),
            background: threads > 0,
        };
        // SAFETY: the caller promises `out` is NULL or writable.
        unsafe { give(out, rt) }
    })
}

/// Frees a runtime handle (NULL: nothing). Its threads stop when the last handle opened with
/// it is freed too.
///
/// # Safety
/// `rt` is NULL or a live runtime handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tp_runtime_free(rt: *mut tp_runtime) {
    if !rt.is_null() {
        // SAFETY: the caller gives back a handle from tp_runtime_new, once.
        let rt = unsafe { Box::from_raw(rt) };
        drop_runtime(rt.rt);
    }
}

/// Drops a runtime reference on a thread of its own when it is the last one and the caller is
/// a runtime thread (tokio refuses to drop a runtime there).
fn drop_runtime(rt: Arc<Runtime>) {
    if tokio::runtime::Handle::try_current().is_ok() && Arc::strong_count(&rt) == 1 {
        std::thread::spawn(move || drop(rt));
    } else {
        drop(rt);
    }
}

/// Gives a new handle to `out`, or frees it if `out` cannot take it.
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn give<T>(out: *mut *mut T, v: T) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::arg("out is NULL"));
    }
    // SAFETY: not NULL; the caller promises room for one pointer.
    unsafe { out.write(Box::into_raw(Box::new(v))) };
    Ok(())
}

/// What `make` returns, boxed for the caller; NULL (and the last error set) when it fails:
/// for the functions that return a handle instead of a status.
fn hand_out<T>(make: impl FnOnce() -> Result<T, Failure>) -> *mut T {
    let mut made = std::ptr::null_mut();
    let status = guard(|| {
        made = Box::into_raw(Box::new(make()?));
        Ok(())
    });
    if status == tp_status::TP_OK {
        made
    } else {
        std::ptr::null_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_read_only_the_fields_the_caller_knows() {
        // SAFETY: NULL is allowed.
        let none = unsafe { settings(std::ptr::null()) }.unwrap();
        assert_eq!(none.max_message_size, None);
        // A caller whose header knew only `size`: four bytes, nothing past them is read.
        let old: u32 = 4;
        // SAFETY: four readable bytes, `size` says so.
        let s = unsafe { settings((&old as *const u32).cast()) }.unwrap();
        assert_eq!(s.max_message_size, None);
        let full = tp_settings {
            size: std::mem::size_of::<tp_settings>() as u32,
            max_message_size: 1 << 20,
        };
        // SAFETY: a whole tp_settings.
        let s = unsafe { settings(&full) }.unwrap();
        assert_eq!(s.max_message_size, Some(1 << 20));
        let zero = tp_settings {
            max_message_size: 0,
            ..full
        };
        // SAFETY: a whole tp_settings.
        assert_eq!(unsafe { settings(&zero) }.unwrap().max_message_size, None);
        let unset = tp_settings { size: 0, ..full };
        // SAFETY: a whole tp_settings.
        let e = unsafe { settings(&unset) }.unwrap_err();
        assert_eq!(e.status, tp_status::TP_ERR_INVALID_ARGUMENT);
    }

    #[test]
    fn null_handles_and_pointers_are_argument_errors() {
        let mut conn = std::ptr::null_mut();
        // SAFETY: NULL runtime and URI are what is tested; `conn` is writable.
        let s = unsafe {
            tp_connect(
                std::ptr::null(),
                c"tcp://127.0.0.1:1".as_ptr(),
                std::ptr::null(),
                0,
                &mut conn,
            )
        };
        assert_eq!(s, tp_status::TP_ERR_INVALID_ARGUMENT);
        assert!(conn.is_null(), "nothing written on an error");
        let mut rt = std::ptr::null_mut();
        // SAFETY: `rt` is writable.
        assert_eq!(unsafe { tp_runtime_new(1, &mut rt) }, tp_status::TP_OK);
        // SAFETY: a live runtime, a NULL URI.
        let s = unsafe { tp_connect(rt, std::ptr::null(), std::ptr::null(), 0, &mut conn) };
        assert_eq!(s, tp_status::TP_ERR_INVALID_ARGUMENT);
        // SAFETY: a live runtime, a NULL out-pointer.
        let s = unsafe {
            tp_listen(
                rt,
                c"tcp://127.0.0.1:0".as_ptr(),
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(s, tp_status::TP_ERR_INVALID_ARGUMENT);
        // SAFETY: NULL handles everywhere.
        unsafe {
            assert_eq!(
                tp_recv(std::ptr::null(), 0, std::ptr::null_mut()),
                tp_status::TP_ERR_INVALID_ARGUMENT
            );
            assert!(tp_buffer_alloc(std::ptr::null(), 1).is_null());
            assert_eq!(tp_buffer_capacity(std::ptr::null()), 0);
            let mut n = 7;
            tp_message_payload(std::ptr::null(), &mut n);
            assert_eq!(n, 0);
            tp_message_free(std::ptr::null_mut());
            tp_conn_free(std::ptr::null_mut());
            tp_runtime_free(rt);
        }
    }
}
