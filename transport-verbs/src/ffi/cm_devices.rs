//! librdmacm's list of devices (`rdma_get_devices`), read to make it forget a removed one.
//!
//! librdmacm opens each device it binds an identifier to and keeps that context open after
//! the identifiers go; it closes a device's context only once it has seen the device missing
//! from libibverbs' list, at a re-read of the list (`sync_devices_list`, which
//! `rdma_get_devices` runs), and no identifier uses it any more. A device whose driver cannot
//! disassociate open contexts (rxe, siw) is not released by the kernel until every process
//! has closed them: `rdma link delete` waits for this re-read.

use super::sys;
use std::ffi::CStr;

/// The names of the devices librdmacm lists now. Reading the list makes librdmacm mark the
/// devices gone from libibverbs' list as dead (closed once unused). As a side effect
/// librdmacm opens a context on every present device it has not opened yet.
pub(crate) fn rdma_cm_devices() -> Vec<String> {
    let mut n: std::os::raw::c_int = 0;
    // SAFETY: `n` is a valid out-pointer for the call; the list returned (or null) is owned
    // by us until `rdma_free_devices`.
    let list = unsafe { sys::rdma_get_devices(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut names = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: the list holds `n` context pointers followed by a null; each context stays
        // open (librdmacm holds a reference for the list) until `rdma_free_devices`.
        let ctx = unsafe { *list.add(i) };
        if ctx.is_null() {
            break;
        }
        // SAFETY: `ctx` is a live `ibv_context`; its `device` and the device's name are
        // valid for the context's life, and the name is copied out before the list is freed.
        let name = unsafe {
            let dev = (*ctx).device;
            if dev.is_null() {
                continue;
            }
            let p = sys::ibv_get_device_name(dev);
            if p.is_null() {
                continue;
            }
            CStr::from_ptr(p).to_string_lossy().into_owned()
        };
        names.push(name);
    }
    // SAFETY: `list` came from `rdma_get_devices` and is freed once.
    unsafe { sys::rdma_free_devices(list) };
    names
}
