//! The RPC client and the server calling a C handler.

use super::*;

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
        let (rt, ep, s) = unsafe { opening(rt, uri, settings)? };
        if out.is_null() {
            return Err(Failure::arg("out is NULL"));
        }
        let inner = handles::rpc_connect(&rt.rt, ep, s, timeout(timeout_ms))?;
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
        let payload = copy_in(c.inner.alloc(req.len()), req);
        // SAFETY: per this function's contract.
        unsafe { call(c, method, payload, timeout_ms, reply) }
    })
}

/// Calls `method` with `request` (not copied, and still the caller's), as `tp_rpc_call`
/// does.
///
/// # Safety
/// `c` a live client; `request` a live payload; `reply` writable.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_call_payload(
    c: *const tp_rpc_client,
    method: u32,
    request: *const tp_payload,
    timeout_ms: i32,
    reply: *mut *mut tp_message,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (c, req) = unsafe { (handle(c, "client")?, handle(request, "request")?) };
        // SAFETY: per this function's contract.
        unsafe { call(c, method, req.bytes.clone(), timeout_ms, reply) }
    })
}

/// The call behind `tp_rpc_call` and `tp_rpc_call_payload`.
///
/// # Safety
/// `reply` NULL or writable.
unsafe fn call(
    c: &tp_rpc_client,
    method: u32,
    payload: Bytes,
    timeout_ms: i32,
    reply: *mut *mut tp_message,
) -> Result<(), Failure> {
    if reply.is_null() {
        return Err(Failure::arg("reply is NULL"));
    }
    let payload = c.inner.call(&c.rt, method, payload, timeout(timeout_ms))?;
    let msg = Message::new(HeaderBytes::EMPTY, payload);
    // SAFETY: `reply` checked above.
    unsafe { give(reply, tp_message { msg }) }
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
        let payload = copy_in(c.inner.alloc(req.len()), req);
        c.inner.oneway(&c.rt, method, payload)
    })
}

/// Sends a oneway call with `request` (not copied, and still the caller's).
///
/// # Safety
/// `c` a live client; `request` a live payload.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_oneway_payload(
    c: *const tp_rpc_client,
    method: u32,
    request: *const tp_payload,
) -> tp_status {
    guard(|| {
        // SAFETY: per this function's contract.
        let (c, req) = unsafe { (handle(c, "client")?, handle(request, "request")?) };
        c.inner.oneway(&c.rt, method, req.bytes.clone())
    })
}

/// A buffer of at least `capacity` bytes from the client connection's pool (registered
/// memory on verbs), to fill and freeze into a request (`tp_buffer_freeze`). NULL when `c`
/// is NULL or `capacity` is over the largest request payload.
///
/// # Safety
/// `c` is NULL or a live client.
#[no_mangle]
pub unsafe extern "C" fn tp_rpc_buffer_alloc(
    c: *const tp_rpc_client,
    capacity: usize,
) -> *mut tp_buffer {
    hand_out(|| {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "client")? };
        tp_buffer::new(capacity, c.inner.max_payload(), |n| c.inner.alloc(n))
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
        let (rt, ep, s) = unsafe { opening(rt, uri, settings)? };
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
        let (inner, uri) = handles::rpc_serve(&rt.rt, ep, s, serve)?;
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
) -> Result<Bytes, transport_rpc::Status> {
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
