//! CPU placement and CPU time, through `nix` (no unsafe here).

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::sys::resource::{getrusage, UsageWho};
use nix::unistd::Pid;
use std::time::Duration;

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

/// Pins the calling thread to `core`.
pub fn pin_current_thread(core: usize) -> Result<(), String> {
    let mut set = CpuSet::new();
    set.set(core)
        .map_err(|e| format!("cannot pin to CPU {core}: {e}"))?;
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| format!("cannot pin to CPU {core}: {e}"))
}

/// User + system CPU time used by this process so far, and its minor page faults.
pub fn cpu_time() -> (Duration, u64) {
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(u) => {
            let t = |tv: nix::sys::time::TimeVal| {
                Duration::from_secs(tv.tv_sec().max(0) as u64)
                    + Duration::from_micros(tv.tv_usec().max(0) as u64)
            };
            (
                t(u.user_time()) + t(u.system_time()),
                u.minor_page_faults().max(0) as u64,
            )
        }
        Err(_) => (Duration::ZERO, 0),
    }
}
