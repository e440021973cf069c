//! Listeners, connections, messages and pool buffers: blocking calls with time limits, and
//! descriptors with non-blocking takes for the caller's event loop.

use super::*;

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
    pub(super) msg: Message,
}

/// A send buffer from a connection's pool (`tp_buffer_alloc`): registered memory on verbs,
/// sent without a copy by `tp_send_buffer`.
pub struct tp_buffer {
    buf: SendBuffer,
    data: *mut u8,
    capacity: usize,
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
        let (rt, ep, s) = unsafe { opening(rt, uri, settings)? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let (inner, uri) = handles::listen(&rt.rt, ep, s)?;
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
        let (rt, ep, s) = unsafe { opening(rt, uri, settings)? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let inner = handles::connect(&rt.rt, ep, s, timeout(timeout_ms))?;
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
/// `tp_send_buffer` (no copy), or to freeze into a payload (`tp_buffer_freeze`). NULL when
/// `c` is NULL or `capacity` is over the connection's message limit.
///
/// # Safety
/// `c` is NULL or a live connection.
#[no_mangle]
pub unsafe extern "C" fn tp_buffer_alloc(c: *const tp_conn, capacity: usize) -> *mut tp_buffer {
    hand_out(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "conn")? };
        tp_buffer::new(capacity, c.inner.max_message_size(), |n| {
            c.inner.pool().alloc(n)
        })
    })
}

impl tp_buffer {
    /// A buffer of `capacity` bytes from `alloc`; `TP_ERR_TOO_LARGE` over `max`.
    pub(super) fn new(
        capacity: usize,
        max: usize,
        alloc: impl FnOnce(usize) -> SendBuffer,
    ) -> Result<tp_buffer, Failure> {
        if capacity > max {
            return Err(Failure::new(
                tp_status::TP_ERR_TOO_LARGE,
                format!("a {capacity}-byte buffer over the message limit of {max}"),
            ));
        }
        let mut buf = alloc(capacity);
        let data = buf
            .fill(capacity)
            .ok_or_else(|| Failure::new(tp_status::TP_ERR_INTERNAL, "the pool's buffer is short"))?
            .as_mut_ptr();
        Ok(tp_buffer {
            buf,
            data,
            capacity,
        })
    }

    /// Its first `len` bytes, frozen without a copy.
    pub(super) fn freeze(self, len: usize) -> Result<Bytes, Failure> {
        if len > self.capacity {
            return Err(Failure::arg(format!(
                "len {len} is over the buffer's capacity {}",
                self.capacity
            )));
        }
        let mut bytes = self.buf.freeze();
        bytes.truncate(len);
        Ok(bytes)
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
        let payload = buffer
            .ok_or_else(|| Failure::arg("buffer is NULL"))?
            .freeze(len)?;
        c.inner.send(
            &c.rt,
            Message::new(self::header(h)?, payload),
            timeout(timeout_ms),
        )
    })
}

/// Sends `payload` (not copied, and still the caller's: free it with `tp_payload_free`)
/// with `header`, as `tp_send` does.
///
/// # Safety
/// `c` a live connection; `payload` a live payload; `header` NULL with length 0 or readable.
#[no_mangle]
pub unsafe extern "C" fn tp_send_payload(
    c: *const tp_conn,
    header: *const u8,
    header_len: usize,
    payload: *const tp_payload,
    timeout_ms: i32,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (c, h, p) = unsafe {
            (
                handle(c, "conn")?,
                bytes_at(header, header_len, "header")?,
                handle(payload, "payload")?,
            )
        };
        c.inner.send(
            &c.rt,
            Message::new(self::header(h)?, p.bytes.clone()),
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

/// A connection being made in the background (`tp_connect_start`).
pub struct tp_connecting {
    rt: Arc<Runtime>,
    background: bool,
    fed: Fed<Accepted>,
    finished: std::sync::atomic::AtomicBool,
}

/// Starts connecting to a listener at `uri` without blocking; `tp_connecting_fd` becomes
/// readable when it succeeded or failed, and `tp_connect_finish` gives the connection. Needs
/// a runtime with threads. Free the handle with `tp_connecting_free` (which cancels a connect
/// still in progress).
///
/// # Safety
/// `rt` a live runtime, `uri` a C string, `settings` NULL or valid, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_connect_start(
    rt: *const tp_runtime,
    uri: *const c_char,
    settings: *const tp_settings,
    out: *mut *mut tp_connecting,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (rt, ep, s) = unsafe { opening(rt, uri, settings)? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        if !rt.background {
            return Err(no_background("connecting without blocking"));
        }
        let fed = handles::connect_in_background(&rt.rt, ep, s)?;
        let connecting = tp_connecting {
            rt: rt.rt.clone(),
            background: rt.background,
            fed,
            finished: std::sync::atomic::AtomicBool::new(false),
        };
        // SAFETY: `out` checked above.
        unsafe { give(out, connecting) }
    })
}

/// A descriptor for the caller's event loop: readable once the connect succeeded or failed.
/// It belongs to the handle: do not close it.
///
/// # Safety
/// `c` a live handle, `fd` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_connecting_fd(c: *const tp_connecting, fd: *mut i32) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "connecting")? };
        // SAFETY: per this function's contract.
        unsafe { put_fd(&c.fed, fd) }
    })
}

/// The connection once made: `TP_ERR_WOULD_BLOCK` while still connecting, the connect's
/// error if it failed, `TP_ERR_INVALID_ARGUMENT` once the connection was given out.
///
/// # Safety
/// `c` a live handle, `out` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_connect_finish(
    c: *const tp_connecting,
    out: *mut *mut tp_conn,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "connecting")? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        if c.finished.load(std::sync::atomic::Ordering::Acquire) {
            return Err(Failure::arg("the connection was already given out"));
        }
        let inner = c.fed.feed.try_take().ok_or_else(would_block)??;
        if c.finished.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return Err(Failure::arg("the connection was already given out"));
        }
        // SAFETY: `out` checked above.
        unsafe { give(out, tp_conn::new(c.rt.clone(), c.background, inner)) }
    })
}

/// Frees a connecting handle (NULL: nothing); a connect still in progress is cancelled. A
/// connection already given out by `tp_connect_finish` stays open.
///
/// # Safety
/// `c` is NULL or a live handle, not used again.
#[no_mangle]
pub unsafe extern "C" fn tp_connecting_free(c: *mut tp_connecting) {
    if !c.is_null() {
        // SAFETY: the caller gives back a handle from tp_connect_start, once.
        let c = unsafe { Box::from_raw(c) };
        let rt = c.rt.clone();
        drop(c);
        drop_runtime(rt);
    }
}
