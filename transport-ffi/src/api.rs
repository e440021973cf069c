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
use transport_core::rpc::Request;
use transport_core::{HeaderBytes, Message, SendBuffer, MAX_HEADER_LEN};

/// A runtime: the threads that drive the connections opened with it. Every handle keeps its
/// runtime alive, so `tp_runtime_free` may come before the handles are freed.
pub struct tp_runtime {
    rt: Arc<Runtime>,
    /// Threads of its own drive the connections (`threads` > 0).
    background: bool,
}

/// A listener (`tp_listen`).
pub struct tp_listener {
    rt: Arc<Runtime>,
    background: bool,
    inner: Arc<dyn AnyListener>,
    uri: CString,
    /// Accepting in the background, once `tp_listener_fd` was asked.
    fed: LazyFeed<Accepted>,
}

/// A message connection (`tp_connect`, `tp_accept`). One thread may send while another
/// receives; sends (and receives) from several threads take turns.
pub struct tp_conn {
    rt: Arc<Runtime>,
    background: bool,
    inner: Arc<dyn AnyConn>,
    /// Receiving in the background, once `tp_conn_fd` was asked.
    fed: LazyFeed<Received>,
}

impl tp_conn {
    fn new(rt: Arc<Runtime>, background: bool, inner: Arc<dyn AnyConn>) -> tp_conn {
        tp_conn {
            rt,
            background,
            inner,
            fed: LazyFeed::new(),
        }
    }

    /// The background receiver's feed, started now if it was not (it needs runtime threads).
    fn fed(&self) -> Result<Arc<Fed<Received>>, Failure> {
        self.fed
            .start(self.background, "a connection's descriptor", || {
                self.inner.clone().feed(&self.rt)
            })
    }
}

impl tp_listener {
    /// The background acceptor's feed, started now if it was not (it needs runtime threads).
    fn fed(&self) -> Result<Arc<Fed<Accepted>>, Failure> {
        self.fed
            .start(self.background, "a listener's descriptor", || {
                self.inner.clone().feed(&self.rt)
            })
    }
}

/// A background feed, started on first use (a descriptor asked, a non-blocking take).
struct LazyFeed<T>(Mutex<Option<Arc<Fed<T>>>>);

impl<T> LazyFeed<T> {
    fn new() -> LazyFeed<T> {
        LazyFeed(Mutex::new(None))
    }

    /// The feed, if started.
    fn current(&self) -> Option<Arc<Fed<T>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The feed, started now with `start` if it was not; refused without runtime threads.
    fn start(
        &self,
        background: bool,
        what: &str,
        start: impl FnOnce() -> Result<Fed<T>, Failure>,
    ) -> Result<Arc<Fed<T>>, Failure> {
        let mut fed = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = &*fed {
            return Ok(f.clone());
        }
        if !background {
            return Err(no_background(what));
        }
        let f = Arc::new(start()?);
        *fed = Some(f.clone());
        Ok(f)
    }
}

/// Writes the feed's descriptor to `fd`.
///
/// # Safety
/// `fd` is NULL or writable.
unsafe fn put_fd<T: Clone>(fed: &Fed<T>, fd: *mut i32) -> Result<(), Failure> {
    if fd.is_null() {
        return Err(Failure::arg("fd is NULL"));
    }
    // SAFETY: not NULL; the caller promises room for one int.
    unsafe { fd.write(fed.feed.raw_fd()) };
    Ok(())
}

/// The next item of a started feed, waiting up to `timeout_ms` (a blocking call).
fn take_within<T: Clone>(fed: &Fed<T>, timeout_ms: i32) -> Result<T, Failure> {
    handles::not_in_runtime()?;
    fed.feed
        .take(timeout(timeout_ms))
        .map_err(|e| Failure::new(tp_status::TP_ERR_IO, e.to_string()))?
        .ok_or_else(|| timed_out(timeout_ms))
}

/// Why a runtime without threads cannot serve `what`.
fn no_background(what: &str) -> Failure {
    Failure::new(
        tp_status::TP_ERR_UNSUPPORTED,
        format!("{what} needs a runtime with threads (tp_runtime_new(1 or more, ..))"),
    )
}

/// A received message (`tp_recv`) or an RPC reply (`tp_rpc_call`): its bytes stay valid
/// until `tp_message_free`.
pub struct tp_message {
    msg: Message,
}

/// A send buffer from a connection's pool (`tp_buffer_alloc`): registered memory on verbs,
/// sent without a copy by `tp_send_buffer`.
pub struct tp_buffer {
    buf: SendBuffer,
    data: *mut u8,
    capacity: usize,
}

/// An RPC client (`tp_rpc_connect`); calls from several threads are in flight together.
pub struct tp_rpc_client {
    rt: Arc<Runtime>,
    inner: Box<dyn AnyRpcClient>,
}

/// A serving RPC server (`tp_rpc_serve`).
pub struct tp_rpc_server {
    rt: Arc<Runtime>,
    inner: Box<dyn AnyRpcServer>,
    uri: CString,
}

/// Where a handler puts its response (`tp_reply_set`); valid during the handler's call only.
pub struct tp_reply {
    slot: ReplySlot,
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

/// A server's handler: answers one call. `request` (`request_len` bytes) is valid during the
/// call. Put the response with `tp_reply_set` (none: an empty response) and return 0, or
/// return a non-zero code (an application error, seen by the caller as `TP_ERR_REMOTE`).
/// It runs on the runtime's threads, possibly on several at once with the same `user`:
/// `user` and what it points to must be safe to use from any thread. It must not block for
/// long, and must not call the blocking functions (they return `TP_ERR_UNSUPPORTED`).
pub type tp_rpc_handler = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        method: u32,
        request: *const u8,
        request_len: usize,
        reply: *mut tp_reply,
    ) -> i32,
>;

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

/// Listens at `uri` (`tcp://127.0.0.1:0` picks a free port: see `tp_listener_uri`).
///
/// # Safety
/// `rt` a live runtime, `uri` a C string, `settings` NULL or valid, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_listen(
    rt: *const tp_runtime,
    uri: *const c_char,
    settings: *const tp_settings,
    out: *mut *mut tp_listener,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (rt, uri, s) = unsafe {
            (
                handle(rt, "rt")?,
                text(uri, "uri")?,
                self::settings(settings)?,
            )
        };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let (inner, uri) = handles::listen(&rt.rt, Endpoint::parse(uri)?, s)?;
        let l = tp_listener {
            rt: rt.rt.clone(),
            background: rt.background,
            inner,
            uri,
            fed: LazyFeed::new(),
        };
        // SAFETY: `out` checked above.
        unsafe { give(out, l) }
    })
}

/// The URI a listener is bound to (with the port it picked); valid until it is freed.
///
/// # Safety
/// `l` is NULL or a live listener.
#[no_mangle]
pub unsafe extern "C" fn tp_listener_uri(l: *const tp_listener) -> *const c_char {
    // SAFETY: per this function's contract.
    match unsafe { l.as_ref() } {
        Some(l) => l.uri.as_ptr(),
        None => c"".as_ptr(),
    }
}

/// Waits for the next connection, up to `timeout_ms` (negative: no limit).
///
/// # Safety
/// `l` a live listener, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_accept(
    l: *const tp_listener,
    timeout_ms: i32,
    out: *mut *mut tp_conn,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let l = unsafe { handle(l, "listener")? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let inner = match l.fed.current() {
            Some(fed) => take_within(&fed, timeout_ms)??,
            None => l.inner.accept(&l.rt, timeout(timeout_ms))?,
        };
        // SAFETY: `out` checked above.
        unsafe { give(out, tp_conn::new(l.rt.clone(), l.background, inner)) }
    })
}

fn timed_out(ms: i32) -> Failure {
    Failure::new(
        tp_status::TP_ERR_TIMED_OUT,
        format!("nothing within {ms} ms"),
    )
}

/// A descriptor for the caller's event loop (poll, epoll, select): readable while a
/// connection waits to be taken with `tp_try_accept` (or after the listener failed: the
/// next take reports it). From this call on the listener accepts in the background (up to
/// 64 connections wait), which needs a runtime with threads. The descriptor belongs to the
/// listener: do not close it.
///
/// # Safety
/// `l` a live listener, `fd` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_listener_fd(l: *const tp_listener, fd: *mut i32) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let l = unsafe { handle(l, "listener")? };
        // SAFETY: per this function's contract.
        unsafe { put_fd(&*l.fed()?, fd) }
    })
}

/// The next connection if one waits: `TP_ERR_WOULD_BLOCK` when none does (poll
/// `tp_listener_fd`'s descriptor). A failed accept of one connection is its error, and the
/// listener goes on. Starts background accepting as `tp_listener_fd` does.
///
/// # Safety
/// `l` a live listener, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_try_accept(l: *const tp_listener, out: *mut *mut tp_conn) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let l = unsafe { handle(l, "listener")? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let fed = l.fed()?;
        let inner = fed.feed.try_take().ok_or_else(would_block)??;
        // SAFETY: `out` checked above.
        unsafe { give(out, tp_conn::new(l.rt.clone(), l.background, inner)) }
    })
}

fn would_block() -> Failure {
    Failure::new(tp_status::TP_ERR_WOULD_BLOCK, "nothing there yet")
}

/// Frees a listener (NULL: nothing); it stops listening.
///
/// # Safety
/// `l` is NULL or a live listener, not used again.
#[no_mangle]
pub unsafe extern "C" fn tp_listener_free(l: *mut tp_listener) {
    if !l.is_null() {
        // SAFETY: the caller gives back a handle from tp_listen, once.
        let l = unsafe { Box::from_raw(l) };
        let rt = l.rt.clone();
        drop(l);
        drop_runtime(rt);
    }
}

/// Connects to a listener at `uri`, waiting up to `timeout_ms` (negative: no limit).
///
/// # Safety
/// `rt` a live runtime, `uri` a C string, `settings` NULL or valid, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_connect(
    rt: *const tp_runtime,
    uri: *const c_char,
    settings: *const tp_settings,
    timeout_ms: i32,
    out: *mut *mut tp_conn,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (rt, uri, s) = unsafe {
            (
                handle(rt, "rt")?,
                text(uri, "uri")?,
                self::settings(settings)?,
            )
        };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let inner = handles::connect(&rt.rt, Endpoint::parse(uri)?, s, timeout(timeout_ms))?;
        // SAFETY: `out` checked above.
        unsafe { give(out, tp_conn::new(rt.rt.clone(), rt.background, inner)) }
    })
}

/// The header of a message, checked.
fn header(bytes: &[u8]) -> Result<HeaderBytes, Failure> {
    HeaderBytes::new(bytes).ok_or_else(|| {
        Failure::arg(format!(
            "a {}-byte header is over TP_MAX_HEADER_LEN ({MAX_HEADER_LEN})",
            bytes.len()
        ))
    })
}

/// Sends one message: `header` (at most `TP_MAX_HEADER_LEN` bytes) and `payload`, copied.
/// Returns when the transport has taken it, or `TP_ERR_TIMED_OUT` after `timeout_ms`
/// (negative: no limit; then the message may still go out with the next send).
///
/// # Safety
/// `c` a live connection; `header`/`payload` NULL with length 0, or readable for their lengths.
#[no_mangle]
pub unsafe extern "C" fn tp_send(
    c: *const tp_conn,
    header: *const u8,
    header_len: usize,
    payload: *const u8,
    payload_len: usize,
    timeout_ms: i32,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (c, h, p) = unsafe {
            (
                handle(c, "conn")?,
                bytes_at(header, header_len, "header")?,
                bytes_at(payload, payload_len, "payload")?,
            )
        };
        let max = c.inner.max_message_size();
        if h.len().saturating_add(p.len()) > max {
            return Err(Failure::new(
                tp_status::TP_ERR_TOO_LARGE,
                format!(
                    "a {}-byte message over the limit of {max}",
                    h.len() + p.len()
                ),
            ));
        }
        let msg = Message::new(self::header(h)?, copy_in(c.inner.pool().alloc(p.len()), p));
        c.inner.send(&c.rt, msg, timeout(timeout_ms))
    })
}

/// A buffer of at least `capacity` bytes from the connection's pool, to fill and send with
/// `tp_send_buffer` (no copy). NULL when `c` is NULL or `capacity` is over the connection's
/// message limit.
///
/// # Safety
/// `c` is NULL or a live connection.
#[no_mangle]
pub unsafe extern "C" fn tp_buffer_alloc(c: *const tp_conn, capacity: usize) -> *mut tp_buffer {
    let mut made = std::ptr::null_mut();
    let status = guard(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "conn")? };
        let max = c.inner.max_message_size();
        if capacity > max {
            return Err(Failure::new(
                tp_status::TP_ERR_TOO_LARGE,
                format!("a {capacity}-byte buffer over the message limit of {max}"),
            ));
        }
        let mut buf = c.inner.pool().alloc(capacity);
        let data = buf
            .fill(capacity)
            .ok_or_else(|| Failure::new(tp_status::TP_ERR_INTERNAL, "the pool's buffer is short"))?
            .as_mut_ptr();
        made = Box::into_raw(Box::new(tp_buffer {
            buf,
            data,
            capacity,
        }));
        Ok(())
    });
    if status == tp_status::TP_OK {
        made
    } else {
        std::ptr::null_mut()
    }
}

/// The writable bytes of a buffer (`tp_buffer_capacity` of them); NULL for a NULL buffer.
///
/// # Safety
/// `b` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn tp_buffer_data(b: *mut tp_buffer) -> *mut u8 {
    // SAFETY: per this function's contract.
    unsafe { b.as_ref() }.map_or(std::ptr::null_mut(), |b| b.data)
}

/// How many bytes a buffer holds (0 for NULL).
///
/// # Safety
/// `b` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn tp_buffer_capacity(b: *const tp_buffer) -> usize {
    // SAFETY: per this function's contract.
    unsafe { b.as_ref() }.map_or(0, |b| b.capacity)
}

/// Frees a buffer that was not sent (NULL: nothing).
///
/// # Safety
/// `b` is NULL or a live buffer, not used again.
#[no_mangle]
pub unsafe extern "C" fn tp_buffer_free(b: *mut tp_buffer) {
    if !b.is_null() {
        // SAFETY: the caller gives back a buffer from tp_buffer_alloc, once.
        drop(unsafe { Box::from_raw(b) });
    }
}

/// Sends the first `len` bytes of `buffer` as the payload, without copying them, with
/// `header`. The buffer is taken whatever the outcome: do not use or free it afterwards.
///
/// # Safety
/// `c` a live connection; `buffer` NULL or a live buffer of `c`'s; `header` NULL with length
/// 0 or readable.
#[no_mangle]
pub unsafe extern "C" fn tp_send_buffer(
    c: *const tp_conn,
    header: *const u8,
    header_len: usize,
    buffer: *mut tp_buffer,
    len: usize,
    timeout_ms: i32,
) -> tp_status {
    // Taken first, so that it is freed on every path.
    let buffer = (!buffer.is_null()).then(|| {
        // SAFETY: the caller hands over a live buffer from tp_buffer_alloc, once.
        unsafe { Box::from_raw(buffer) }
    });
    guard(|| {
        // SAFETY: per this function's contract.
        let (c, h) = unsafe { (handle(c, "conn")?, bytes_at(header, header_len, "header")?) };
        let b = buffer.ok_or_else(|| Failure::arg("buffer is NULL"))?;
        if len > b.capacity {
            return Err(Failure::arg(format!(
                "len {len} is over the buffer's capacity {}",
                b.capacity
            )));
        }
        let mut payload = b.buf.freeze();
        payload.truncate(len);
        c.inner.send(
            &c.rt,
            Message::new(self::header(h)?, payload),
            timeout(timeout_ms),
        )
    })
}

/// Receives the next message, waiting up to `timeout_ms` (negative: no limit).
/// `TP_ERR_CLOSED` when the peer closed cleanly.
///
/// # Safety
/// `c` a live connection, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_recv(
    c: *const tp_conn,
    timeout_ms: i32,
    out: *mut *mut tp_message,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "conn")? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let msg = match c.fed.current() {
            Some(fed) => take_within(&fed, timeout_ms)??,
            None => c.inner.recv(&c.rt, timeout(timeout_ms))?.ok_or_else(|| {
                Failure::new(tp_status::TP_ERR_CLOSED, "the peer closed the connection")
            })?,
        };
        // SAFETY: `out` checked above.
        unsafe { give(out, tp_message { msg }) }
    })
}

/// A descriptor for the caller's event loop (poll, epoll, select): readable while a message
/// waits to be taken with `tp_try_recv`, and for good once the connection ended or failed
/// (the next take reports it). From this call on the connection receives in the background
/// (up to 64 messages wait; then the peer's sends wait), which needs a runtime with threads;
/// `tp_recv` then takes from the same queue. The descriptor belongs to the connection: do
/// not close it.
///
/// # Safety
/// `c` a live connection, `fd` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_conn_fd(c: *const tp_conn, fd: *mut i32) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "conn")? };
        // SAFETY: per this function's contract.
        unsafe { put_fd(&*c.fed()?, fd) }
    })
}

/// The next message if one waits: `TP_ERR_WOULD_BLOCK` when none does (poll `tp_conn_fd`'s
/// descriptor), `TP_ERR_CLOSED` (or the connection's error) once it ended. Starts background
/// receiving as `tp_conn_fd` does.
///
/// # Safety
/// `c` a live connection, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_try_recv(c: *const tp_conn, out: *mut *mut tp_message) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "conn")? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let fed = c.fed()?;
        let msg = fed.feed.try_take().ok_or_else(would_block)??;
        // SAFETY: `out` checked above.
        unsafe { give(out, tp_message { msg }) }
    })
}

/// The largest message (header + payload) the connection sends.
///
/// # Safety
/// `c` is NULL (0) or a live connection.
#[no_mangle]
pub unsafe extern "C" fn tp_conn_max_message_size(c: *const tp_conn) -> usize {
    // SAFETY: per this function's contract.
    unsafe { c.as_ref() }.map_or(0, |c| c.inner.max_message_size())
}

/// Closes the sending direction: the peer receives the end (`TP_ERR_CLOSED`) after the
/// messages sent before.
///
/// # Safety
/// `c` a live connection.
#[no_mangle]
pub unsafe extern "C" fn tp_close(c: *const tp_conn) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "conn")? };
        c.inner.close(&c.rt)
    })
}

/// Frees a connection (NULL: nothing); an unclosed connection is dropped (the peer sees it
/// end).
///
/// # Safety
/// `c` is NULL or a live connection, not used again (no call on it in flight).
#[no_mangle]
pub unsafe extern "C" fn tp_conn_free(c: *mut tp_conn) {
    if !c.is_null() {
        // SAFETY: the caller gives back a handle from tp_connect or tp_accept, once.
        let c = unsafe { Box::from_raw(c) };
        let rt = c.rt.clone();
        drop(c);
        drop_runtime(rt);
    }
}

/// A message's header; its length in `*len` (when `len` is not NULL).
///
/// # Safety
/// `m` is NULL or a live message; `len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tp_message_header(m: *const tp_message, len: *mut usize) -> *const u8 {
    // SAFETY: per this function's contract.
    let bytes = unsafe { m.as_ref() }.map_or(&[][..], |m| m.msg.header.as_slice());
    // SAFETY: per this function's contract.
    if let Some(len) = unsafe { len.as_mut() } {
        *len = bytes.len();
    }
    bytes.as_ptr()
}

/// A message's payload; its length in `*len` (when `len` is not NULL).
///
/// # Safety
/// `m` is NULL or a live message; `len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tp_message_payload(m: *const tp_message, len: *mut usize) -> *const u8 {
    // SAFETY: per this function's contract.
    let bytes = unsafe { m.as_ref() }.map_or(&[][..], |m| &m.msg.payload[..]);
    // SAFETY: per this function's contract.
    if let Some(len) = unsafe { len.as_mut() } {
        *len = bytes.len();
    }
    bytes.as_ptr()
}

/// Frees a message (NULL: nothing); on verbs its receive buffer goes back to the pool.
///
/// # Safety
/// `m` is NULL or a live message, not used again.
#[no_mangle]
pub unsafe extern "C" fn tp_message_free(m: *mut tp_message) {
    if !m.is_null() {
        // SAFETY: the caller gives back a message from tp_recv or tp_rpc_call, once.
        drop(unsafe { Box::from_raw(m) });
    }
}

/// Connects an RPC client to a server at `uri`, waiting up to `timeout_ms` (negative: no
/// limit).
///
/// # Safety
/// `rt` a live runtime, `uri` a C string, `settings` NULL or valid, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_connect(
    rt: *const tp_runtime,
    uri: *const c_char,
    settings: *const tp_settings,
    timeout_ms: i32,
    out: *mut *mut tp_rpc_client,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (rt, uri, s) = unsafe {
            (
                handle(rt, "rt")?,
                text(uri, "uri")?,
                self::settings(settings)?,
            )
        };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let inner = handles::rpc_connect(&rt.rt, Endpoint::parse(uri)?, s, timeout(timeout_ms))?;
        // SAFETY: `out` checked above.
        unsafe {
            give(
                out,
                tp_rpc_client {
                    rt: rt.rt.clone(),
                    inner,
                },
            )
        }
    })
}

/// Calls `method` with `request` (copied) and waits up to `timeout_ms` (negative: no limit)
/// for the reply, given in `*reply` (free it with `tp_message_free`). A handler's error is
/// `TP_ERR_REMOTE`.
///
/// # Safety
/// `c` a live client; `request` NULL with length 0 or readable; `reply` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_call(
    c: *const tp_rpc_client,
    method: u32,
    request: *const u8,
    request_len: usize,
    timeout_ms: i32,
    reply: *mut *mut tp_message,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (c, req) = unsafe {
            (
                handle(c, "client")?,
                bytes_at(request, request_len, "request")?,
            )
        };
        if reply.is_null() {
            return Err(Failure::arg("reply is NULL"));
        }
        let payload = c.inner.call(&c.rt, method, req, timeout(timeout_ms))?;
        let msg = Message::new(HeaderBytes::EMPTY, payload);
        // SAFETY: `reply` checked above.
        unsafe { give(reply, tp_message { msg }) }
    })
}

/// Sends a oneway call (no reply); returns when the transport has taken it.
///
/// # Safety
/// `c` a live client; `request` NULL with length 0 or readable.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_oneway(
    c: *const tp_rpc_client,
    method: u32,
    request: *const u8,
    request_len: usize,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (c, req) = unsafe {
            (
                handle(c, "client")?,
                bytes_at(request, request_len, "request")?,
            )
        };
        c.inner.oneway(&c.rt, method, req)
    })
}

/// Closes and frees a client (NULL: nothing): calls in flight fail, the connection ends.
///
/// # Safety
/// `c` is NULL or a live client, not used again (no call on it in flight).
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_client_free(c: *mut tp_rpc_client) {
    if !c.is_null() {
        // SAFETY: the caller gives back a handle from tp_rpc_connect, once.
        let c = unsafe { Box::from_raw(c) };
        let _ = c.inner.close(&c.rt);
        let rt = c.rt.clone();
        drop(c);
        drop_runtime(rt);
    }
}

/// `user` as the handler receives it: the caller promised it may be used from any thread.
#[derive(Clone, Copy)]
struct UserData(*mut c_void);
// SAFETY: tp_rpc_serve's contract makes the caller promise that `user` may be used from any
// thread; this library only passes it back to the caller's handler.
unsafe impl Send for UserData {}
// SAFETY: as above.
unsafe impl Sync for UserData {}

/// Serves RPC calls at `uri` with `handler` (called with `user`) on the runtime's threads.
/// The server's URI (its port, for port 0) is `tp_rpc_server_uri`.
///
/// # Safety
/// `rt` a live runtime, `uri` a C string, `settings` NULL or valid, `out` writable; `handler`
/// follows `tp_rpc_handler`'s rules, and `user` stays valid until `tp_rpc_server_free` returns.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_serve(
    rt: *const tp_runtime,
    uri: *const c_char,
    settings: *const tp_settings,
    handler: tp_rpc_handler,
    user: *mut c_void,
    out: *mut *mut tp_rpc_server,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (rt, uri, s) = unsafe {
            (
                handle(rt, "rt")?,
                text(uri, "uri")?,
                self::settings(settings)?,
            )
        };
        let handler = handler.ok_or_else(|| Failure::arg("handler is NULL"))?;
        if !rt.background {
            return Err(Failure::new(
                tp_status::TP_ERR_UNSUPPORTED,
                "a server needs a runtime with threads (tp_runtime_new(1 or more, ..))",
            ));
        }
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let user = UserData(user);
        let serve = move |req: Request| {
            let user = user;
            async move { call_handler(handler, user, req) }
        };
        let (inner, uri) = handles::rpc_serve(&rt.rt, Endpoint::parse(uri)?, s, serve)?;
        // SAFETY: `out` checked above.
        unsafe {
            give(
                out,
                tp_rpc_server {
                    rt: rt.rt.clone(),
                    inner,
                    uri,
                },
            )
        }
    })
}

type CHandler = unsafe extern "C" fn(*mut c_void, u32, *const u8, usize, *mut tp_reply) -> i32;

/// One call of the C handler, off the runtime's cooperative budget (`block_in_place`).
fn call_handler(
    handler: CHandler,
    user: UserData,
    req: Request,
) -> Result<Bytes, transport_core::rpc::Status> {
    let (method, payload) = (req.method, req.payload.clone());
    let mut reply = tp_reply {
        slot: ReplySlot {
            alloc: Box::new(move |n| req.alloc(n)),
            payload: None,
        },
    };
    let code = tokio::task::block_in_place(|| {
        // SAFETY: the handler's contract (tp_rpc_handler): `payload` and `reply` are valid
        // for the call; `user` is the caller's, promised usable from any thread.
        unsafe { handler(user.0, method, payload.as_ptr(), payload.len(), &mut reply) }
    });
    if code != 0 {
        return Err(handler_status(code));
    }
    Ok(reply.slot.payload.take().unwrap_or_default())
}

/// Sets a handler's response: `len` bytes at `data`, copied. A second call replaces the first.
///
/// # Safety
/// `reply` NULL or the handler's reply; `data` NULL with `len` 0, or readable.
#[no_mangle]
pub unsafe extern "C" fn tp_reply_set(
    reply: *mut tp_reply,
    data: *const u8,
    len: usize,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (r, d) = unsafe {
            (
                reply
                    .as_mut()
                    .ok_or_else(|| Failure::arg("reply is NULL"))?,
                bytes_at(data, len, "data")?,
            )
        };
        r.slot.payload = Some(copy_in((r.slot.alloc)(d.len()), d));
        Ok(())
    })
}

/// The URI a server listens at (with the port it picked); valid until it is freed.
///
/// # Safety
/// `s` is NULL or a live server.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_server_uri(s: *const tp_rpc_server) -> *const c_char {
    // SAFETY: per this function's contract.
    match unsafe { s.as_ref() } {
        Some(s) => s.uri.as_ptr(),
        None => c"".as_ptr(),
    }
}

/// Stops a server gracefully (running handlers finish) and frees it (NULL: nothing).
///
/// # Safety
/// `s` is NULL or a live server, not used again; not called from a handler.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_server_free(s: *mut tp_rpc_server) {
    if !s.is_null() {
        // SAFETY: the caller gives back a handle from tp_rpc_serve, once.
        let s = unsafe { Box::from_raw(s) };
        let _ = s.inner.shutdown(&s.rt);
        let rt = s.rt.clone();
        drop(s);
        drop_runtime(rt);
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
