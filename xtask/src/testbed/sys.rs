//! The test bed's only `unsafe` code: process-group kill, parent-death signal and an inherited
//! descriptor for QEMU.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Starts the command in its own process group and asks the kernel to SIGKILL it when the
/// spawning thread dies, so no QEMU outlives an interrupted or crashed `cargo xtask`.
pub fn own_group_dying_with_parent(cmd: &mut Command) {
    cmd.process_group(0);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which is
    // async-signal-safe; it touches no memory shared with the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// SIGKILLs the whole process group `pgid` (the child's pid, see [`own_group_dying_with_parent`]).
pub fn kill_group(pgid: u32) {
    let Ok(pgid) = i32::try_from(pgid) else {
        return;
    };
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill(2) with a negative pid signals exactly that process group; the group was
    // created for our own child, and the call has no memory-safety preconditions.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// Makes the child find `fd` (kept open by the parent until the spawn) as descriptor `as_fd`,
/// open across exec (the parent's copy stays close-on-exec).
pub fn pass_fd<F: AsRawFd + Send + Sync + 'static>(
    cmd: &mut Command,
    fd: std::sync::Arc<F>,
    as_fd: i32,
) {
    // SAFETY: the closure runs in the forked child before exec and only calls dup2(2), which
    // is async-signal-safe; `fd` is kept alive by the `Arc` the closure owns (the command lives
    // until after the spawn), so the descriptor it reads is open. dup2 leaves the new
    // descriptor without FD_CLOEXEC.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd.as_raw_fd(), as_fd) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
