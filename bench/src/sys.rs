//! CPU placement and CPU time, through `nix` (no unsafe here).

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::sys::resource::{getrusage, UsageWho};
use nix::unistd::Pid;
use std::time::Duration;

/// Where a verbs transport with settings `c` posts its receive buffers, in words.
pub fn verbs_receive(c: &transport_verbs::VerbsConfig) -> String {
    if c.srq_depth == 0 {
        format!(
            "own receive queues ({} buffers of {} bytes per connection)",
            c.recv_depth,
            c.recv_buf_size()
        )
    } else {
        format!(
            "shared receive queue ({} buffers of {} bytes per device, growing to {} when it runs \
             low; {} credits per connection)",
            c.srq_depth,
            c.recv_buf_size(),
            c.srq_max_depth.max(c.srq_depth),
            c.recv_depth
        )
    }
}

/// How a verbs transport with settings `c` waits for completions, in words.
pub fn verbs_polling(c: &transport_verbs::VerbsConfig) -> String {
    if c.busy_poll {
        "busy (the CQ is always polled; a CPU per connection driver)".to_string()
    } else if c.poll_spin.is_zero() {
        "events (every wait arms the completion channel and sleeps)".to_string()
    } else {
        let together = match c.poll_together_from {
            usize::MAX => "never polled together".to_string(),
            n => format!("polled together by one task per thread from {n} waiting receivers"),
        };
        format!(
            "adaptive (CQ polled for {} µs after activity, then completion events; {together})",
            c.poll_spin.as_micros()
        )
    }
}

/// RNR NAKs the RDMA devices of this machine have received (the sender side of "no receive
/// buffer posted"), summed over every port's `hw_counters`: rxe's `rcvd_rnr_err`, mlx5's
/// `rnr_nak_retry_err`. `None` where no such counter can be read.
pub fn rnr_naks() -> Option<u64> {
    rnr_naks_in(std::path::Path::new("/sys/class/infiniband"))
}

/// [`rnr_naks`] under `root` (`/sys/class/infiniband`).
pub fn rnr_naks_in(root: &std::path::Path) -> Option<u64> {
    let mut total = None;
    for dev in std::fs::read_dir(root).ok()?.flatten() {
        let Ok(ports) = std::fs::read_dir(dev.path().join("ports")) else {
            continue;
        };
        for port in ports.flatten() {
            for name in ["rcvd_rnr_err", "rnr_nak_retry_err"] {
                let f = port.path().join("hw_counters").join(name);
                if let Some(n) = std::fs::read_to_string(&f)
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                {
                    *total.get_or_insert(0) += n;
                }
            }
        }
    }
    total
}

/// A current-thread tokio runtime with everything enabled and, with a spin budget
/// (`--spin-us`; zero: none), the spin-before-park hook of `transport_core::spin`.
pub fn runtime(spin: Duration) -> std::io::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_current_thread();
    b.enable_all();
    if !spin.is_zero() {
        b.on_thread_park(transport_core::spin::park_hook(spin));
    }
    b.build()
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

/// Starts a thread named `name`, pinned to `core` (if any), that runs `f`; returns once the
/// thread is pinned, or why it could not be.
pub fn spawn_pinned<T: Send + 'static>(
    name: &str,
    core: Option<usize>,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<std::thread::JoinHandle<Option<T>>, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if let Some(c) = core {
                if let Err(e) = pin_current_thread(c) {
                    let _ = tx.send(Err(e));
                    return None;
                }
            }
            let _ = tx.send(Ok(()));
            Some(f())
        })
        .map_err(|e| format!("{name}: thread: {e}"))?;
    rx.recv()
        .map_err(|_| format!("{name}: the thread died"))??;
    Ok(handle)
}

/// Pins the calling thread to `core`.
pub fn pin_current_thread(core: usize) -> Result<(), String> {
    let mut set = CpuSet::new();
    set.set(core)
        .map_err(|e| format!("cannot pin to CPU {core}: {e}"))?;
    sched_setaffinity(Pid::from_raw(0), &set).map_err(|e| format!("cannot pin to CPU {core}: {e}"))
}

/// What this process has used so far (all threads).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    /// User + system CPU time.
    pub cpu: Duration,
    /// Minor page faults (fresh memory being touched).
    pub minor_faults: u64,
    /// Context switches, voluntary (a thread blocked) and involuntary (it was preempted).
    pub context_switches: u64,
}

impl std::ops::Sub for Usage {
    type Output = Usage;
    fn sub(self, earlier: Usage) -> Usage {
        Usage {
            cpu: self.cpu.saturating_sub(earlier.cpu),
            minor_faults: self.minor_faults.saturating_sub(earlier.minor_faults),
            context_switches: self
                .context_switches
                .saturating_sub(earlier.context_switches),
        }
    }
}

/// This process's resource usage so far (zeros if the kernel does not say).
pub fn usage() -> Usage {
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(u) => {
            let t = |tv: nix::sys::time::TimeVal| {
                Duration::from_secs(tv.tv_sec().max(0) as u64)
                    + Duration::from_micros(tv.tv_usec().max(0) as u64)
            };
            Usage {
                cpu: t(u.user_time()) + t(u.system_time()),
                minor_faults: u.minor_page_faults().max(0) as u64,
                context_switches: (u.voluntary_context_switches().max(0)
                    + u.involuntary_context_switches().max(0))
                    as u64,
            }
        }
        Err(_) => Usage::default(),
    }
}

#[cfg(test)]
mod rnr_tests {
    use super::rnr_naks_in;

    /// The counters of every port of every device are summed, under either provider's name;
    /// a machine without them has none.
    #[test]
    fn rnr_naks_sum_every_port_and_are_none_without_counters() {
        let root = tempfile::tempdir().expect("tempdir");
        assert_eq!(rnr_naks_in(root.path()), None, "no device");
        let port = |dev: &str, p: &str, name: &str, v: &str| {
            let d = root
                .path()
                .join(dev)
                .join("ports")
                .join(p)
                .join("hw_counters");
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join(name), v).expect("write");
        };
        port("rxe0", "1", "rdma_sends", "7\n");
        assert_eq!(rnr_naks_in(root.path()), None, "no RNR counter");
        port("rxe0", "1", "rcvd_rnr_err", "410206\n");
        port("mlx5_0", "1", "rnr_nak_retry_err", "4\n");
        port("mlx5_0", "2", "rnr_nak_retry_err", "not a number\n");
        assert_eq!(rnr_naks_in(root.path()), Some(410_210));
        assert_eq!(rnr_naks_in(&root.path().join("missing")), None);
    }
}
