//! The test bed's only `unsafe` code: process-group kill and parent-death signal for QEMU.

use std::io;
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
