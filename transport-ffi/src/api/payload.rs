//! Payloads: a filled pool buffer frozen once and sent any number of times without a copy.

use super::*;

/// A payload frozen from a pool buffer (`tp_buffer_freeze`): immutable, sent any number of
/// times without a copy (`tp_send_payload`, `tp_rpc_call_payload`, `tp_rpc_oneway_payload`),
/// from any thread; its memory returns to the pool when it is freed and the last send that
/// uses it has completed. Sent on a connection other than the one whose pool it came from, it
/// may be copied (verbs copies memory it has not registered).
pub struct tp_payload {
    pub(super) bytes: Bytes,
}

/// Freezes the first `len` bytes of `buffer` into a payload. The buffer is taken whatever
/// the outcome: do not use or free it afterwards. NULL (see `tp_last_error`) when `buffer` is
/// NULL or `len` is over its capacity.
///
/// # Safety
/// `buffer` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn tp_buffer_freeze(buffer: *mut tp_buffer, len: usize) -> *mut tp_payload {
    // Taken first, so that it is freed on every path.
    let buffer = (!buffer.is_null()).then(|| {
        // SAFETY: the caller hands over a live buffer, once.
        unsafe { Box::from_raw(buffer) }
    });
    hand_out(|| {
        let bytes = buffer
            .ok_or_else(|| Failure::arg("buffer is NULL"))?
            .freeze(len)?;
        Ok(tp_payload { bytes })
    })
}

/// The payload's bytes (`*len` of them; `len` may be NULL), valid until `tp_payload_free`;
/// NULL for a NULL payload.
///
/// # Safety
/// `p` is NULL or a live payload; `len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tp_payload_data(p: *const tp_payload, len: *mut usize) -> *const u8 {
    // SAFETY: per this function's contract.
    let (ptr, n) =
        unsafe { p.as_ref() }.map_or((std::ptr::null(), 0), |p| (p.bytes.as_ptr(), p.bytes.len()));
    if !len.is_null() {
        // SAFETY: not NULL; the caller promises a writable `size_t`.
        unsafe { len.write(n) };
    }
    ptr
}

/// Frees a payload (NULL: nothing). Sends that took it are not affected.
///
/// # Safety
/// `p` is NULL or a live payload, not used again.
#[no_mangle]
pub unsafe extern "C" fn tp_payload_free(p: *mut tp_payload) {
    if !p.is_null() {
        // SAFETY: the caller gives back a payload from tp_buffer_freeze, once.
        drop(unsafe { Box::from_raw(p) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Echoes method 1's request.
    unsafe extern "C" fn echo(
        _: *mut c_void,
        method: u32,
        req: *const u8,
        len: usize,
        reply: *mut tp_reply,
    ) -> i32 {
        if method != 1 {
            return 1;
        }
        // SAFETY: the library passes a live reply and `len` readable bytes.
        (unsafe { tp_reply_set(reply, req, len) } != tp_status::TP_OK) as i32
    }

    fn last_error() -> String {
        // SAFETY: the library's static or thread-local C string.
        unsafe { CStr::from_ptr(tp_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    /// One payload, filled once, goes out three times as a call's request and twice as a
    /// message, each time whole; it stays usable after every send and after its buffer's
    /// connection is gone.
    #[test]
    fn a_payload_is_sent_many_times_without_being_given_up() {
        let dir = tempfile::tempdir().unwrap();
        let uri = CString::new(format!("unix:{}", dir.path().join("p.sock").display())).unwrap();
        let (mut server_rt, mut client_rt) = (std::ptr::null_mut(), std::ptr::null_mut());
        let (mut server, mut client) = (std::ptr::null_mut(), std::ptr::null_mut());
        let data: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        // SAFETY: every pointer below is live or NULL where the contract allows it.
        unsafe {
            assert_eq!(tp_runtime_new(1, &mut server_rt), tp_status::TP_OK);
            assert_eq!(tp_runtime_new(0, &mut client_rt), tp_status::TP_OK);
            let s = tp_rpc_serve(
                server_rt,
                uri.as_ptr(),
                std::ptr::null(),
                Some(echo),
                std::ptr::null_mut(),
                &mut server,
            );
            assert_eq!(s, tp_status::TP_OK, "{}", last_error());
            let s = tp_rpc_connect(client_rt, uri.as_ptr(), std::ptr::null(), 5000, &mut client);
            assert_eq!(s, tp_status::TP_OK, "{}", last_error());

            let buf = tp_rpc_buffer_alloc(client, data.len() + 10);
            assert!(!buf.is_null(), "{}", last_error());
            std::ptr::copy_nonoverlapping(data.as_ptr(), tp_buffer_data(buf), data.len());
            let payload = tp_buffer_freeze(buf, data.len());
            assert!(!payload.is_null(), "{}", last_error());
            let mut n = 0;
            let p = tp_payload_data(payload, &mut n);
            assert_eq!(std::slice::from_raw_parts(p, n), &data[..]);
            for _ in 0..3 {
                let mut reply = std::ptr::null_mut();
                let s = tp_rpc_call_payload(client, 1, payload, 5000, &mut reply);
                assert_eq!(s, tp_status::TP_OK, "{}", last_error());
                let mut n = 0;
                let r = tp_message_payload(reply, &mut n);
                assert_eq!(std::slice::from_raw_parts(r, n), &data[..]);
                tp_message_free(reply);
            }
            assert_eq!(
                tp_rpc_oneway_payload(client, 1, payload),
                tp_status::TP_OK,
                "{}",
                last_error()
            );
            tp_rpc_client_free(client);

            // The same payload, as messages on a connection of another transport.
            let mut listener = std::ptr::null_mut();
            let tcp = c"tcp://127.0.0.1:0";
            assert_eq!(
                tp_listen(server_rt, tcp.as_ptr(), std::ptr::null(), &mut listener),
                tp_status::TP_OK
            );
            let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
            let at = tp_listener_uri(listener);
            assert_eq!(
                tp_connect(server_rt, at, std::ptr::null(), 5000, &mut a),
                tp_status::TP_OK,
                "{}",
                last_error()
            );
            assert_eq!(tp_accept(listener, 5000, &mut b), tp_status::TP_OK);
            for h in [&b"one"[..], b"two"] {
                let s = tp_send_payload(a, h.as_ptr(), h.len(), payload, 5000);
                assert_eq!(s, tp_status::TP_OK, "{}", last_error());
                let mut m = std::ptr::null_mut();
                assert_eq!(tp_recv(b, 5000, &mut m), tp_status::TP_OK);
                let (mut hn, mut pn) = (0, 0);
                let got_h = tp_message_header(m, &mut hn);
                let got_p = tp_message_payload(m, &mut pn);
                assert_eq!(std::slice::from_raw_parts(got_h, hn), h);
                assert_eq!(std::slice::from_raw_parts(got_p, pn), &data[..]);
                tp_message_free(m);
            }
            tp_payload_free(payload);
            tp_conn_free(a);
            tp_conn_free(b);
            tp_listener_free(listener);
            tp_rpc_server_free(server);
            tp_runtime_free(client_rt);
            tp_runtime_free(server_rt);
        }
    }

    #[test]
    fn bad_payload_arguments_are_errors_not_undefined_behaviour() {
        // SAFETY: NULL and out-of-range arguments are what is tested.
        unsafe {
            assert!(tp_buffer_freeze(std::ptr::null_mut(), 0).is_null());
            assert!(last_error().contains("NULL"), "{}", last_error());
            let mut n = 9;
            assert!(tp_payload_data(std::ptr::null(), &mut n).is_null());
            assert_eq!(n, 0);
            tp_payload_free(std::ptr::null_mut());
            assert!(tp_rpc_buffer_alloc(std::ptr::null(), 1).is_null());
            let s = tp_rpc_call_payload(
                std::ptr::null(),
                1,
                std::ptr::null(),
                0,
                std::ptr::null_mut(),
            );
            assert_eq!(s, tp_status::TP_ERR_INVALID_ARGUMENT);
            assert_eq!(
                tp_send_payload(std::ptr::null(), std::ptr::null(), 0, std::ptr::null(), 0),
                tp_status::TP_ERR_INVALID_ARGUMENT
            );
            // A length past the buffer: the buffer is taken (and freed) all the same.
            let buf = Box::into_raw(Box::new(
                tp_buffer::new(16, 16, |n| {
                    transport_core::BufferPool::alloc(&transport_core::HeapPool, n)
                })
                .unwrap(),
            ));
            assert!(tp_buffer_freeze(buf, 17).is_null());
            assert!(last_error().contains("capacity"), "{}", last_error());
            let over = tp_buffer::new(17, 16, |n| {
                transport_core::BufferPool::alloc(&transport_core::HeapPool, n)
            });
            assert_eq!(over.err().unwrap().status, tp_status::TP_ERR_TOO_LARGE);
        }
    }
}
