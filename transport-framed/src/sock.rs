//! The one socket system call this crate makes itself: `recv` into uninitialised memory (a
//! read buffer's spare capacity), which `std`'s `Read` cannot do without zeroing it first.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;

/// `recv(fd, dst, flags)`: fills a prefix of `dst` and returns its length (0: the peer closed
/// its side). The bytes written are initialised; the rest of `dst` is left as it was.
pub fn recv_uninit(
    fd: RawFd,
    dst: &mut [MaybeUninit<u8>],
    flags: libc::c_int,
) -> io::Result<usize> {
    // SAFETY: `recv` writes at most `dst.len()` bytes into `dst`, which is valid for writes of
    // that length; it never reads them, so their being uninitialised is fine.
    let n = unsafe { libc::recv(fd, dst.as_mut_ptr().cast(), dst.len(), flags) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}
