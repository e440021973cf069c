//! Spinning before sleeping: a runtime thread about to park first polls the sockets its
//! receivers wait on, for a bounded time.
//!
//! When the peer runs on another CPU, a reply often arrives a few microseconds after the
//! runtime ran out of work; parking in `epoll_wait` then costs a sleep and a cross-CPU wake-up
//! (on a VM, ~90 µs per round trip for everyone, blocking sockets included). With the hook
//! from [`park_hook`] installed in a tokio runtime (`Builder::on_thread_park`), the thread
//! first polls (`poll(2)`, zero timeout, yielding the CPU between polls) the sockets that
//! stream receivers on it are waiting on, for at most the budget; as soon as one is readable
//! it returns and the runtime's `epoll_wait` finds the event without sleeping.
//!
//! It costs CPU only after activity: a thread parks once per wake-up, so an idle process spins
//! once (one budget) and then sleeps. Spins that keep finding nothing (the peer shares this
//! CPU, or it is slow) make the thread skip spinning for a growing number of parks.
//!
//! ```no_run
//! use std::time::Duration;
//! let rt = tokio::runtime::Builder::new_current_thread()
//!     .enable_all()
//!     .on_thread_park(transport_core::spin::park_hook(Duration::from_micros(50)))
//!     .build()
//!     .unwrap();
//! ```

use std::cell::Cell;
use std::future::{poll_fn, Future};
use std::os::fd::RawFd;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

/// Set once any hook exists: receivers register their sockets only then.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Spins in a row that found nothing before a thread starts skipping spins.
const FAILS_BEFORE_SKIPPING: u32 = 4;
/// Most parks skipped after failed spins.
const MAX_SKIP: u32 = 1024;

type Waiting = Arc<Mutex<Vec<RawFd>>>;

thread_local! {
    static WAITING: Waiting = Arc::default();
    static FAILS: Cell<u32> = const { Cell::new(0) };
    static SKIP: Cell<u32> = const { Cell::new(0) };
}

fn lock(w: &Waiting) -> std::sync::MutexGuard<'_, Vec<RawFd>> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

/// The function to pass to tokio's `Builder::on_thread_park`: spins for at most `budget`
/// before the thread parks (see the [module docs](self)). A zero budget never spins, and
/// neither does any budget where this process may use one CPU only ([`useful_budget`]).
pub fn park_hook(budget: Duration) -> impl Fn() + Send + Sync + 'static {
    let budget = useful_budget(budget, available_cpus());
    if !budget.is_zero() {
        ENABLED.store(true, Ordering::Relaxed);
    }
    move || {
        spin_before_park(budget);
    }
}

/// The CPUs this process may run on: the affinity of its main thread (what `taskset` or a
/// cpuset gave the process). Not the calling thread's own: a thread pinned to one CPU (bench's
/// `--pin split` pins client and server threads to a CPU each) may still have its peer on
/// another. Falls back to [`std::thread::available_parallelism`], then 1.
pub fn available_cpus() -> usize {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most
    // size_of::<cpu_set_t>() bytes into it, and CPU_COUNT only reads it.
    let counted = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        (libc::sched_getaffinity(libc::getpid(), size, &mut set) == 0)
            .then(|| libc::CPU_COUNT(&set) as usize)
    };
    match counted {
        Some(n) if n > 0 => n,
        _ => std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
}

/// The spin budget that can help with `cpus` CPUs available: `budget`, or zero on a single
/// CPU, where the peer (another process or thread on the same machine) can only run once this
/// thread stops: spinning there delays the reply it waits for.
pub fn useful_budget(budget: Duration, cpus: usize) -> Duration {
    if cpus <= 1 {
        Duration::ZERO
    } else {
        budget
    }
}

/// What one spin did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spun {
    /// Nothing to wait for, or skipping after failed spins, or no budget.
    Skipped,
    /// A socket became readable within the budget.
    Found,
    /// The budget passed with nothing readable.
    Nothing,
}

/// Spins for at most `budget` on the sockets this thread's receivers wait on.
pub fn spin_before_park(budget: Duration) -> Spun {
    if budget.is_zero() {
        return Spun::Skipped;
    }
    let skip = SKIP.with(Cell::get);
    if skip > 0 {
        SKIP.with(|s| s.set(skip - 1));
        return Spun::Skipped;
    }
    let mut fds: Vec<libc::pollfd> = WAITING.with(|w| {
        lock(w)
            .iter()
            .map(|&fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect()
    });
    if fds.is_empty() {
        return Spun::Skipped;
    }
    let start = Instant::now();
    loop {
        if readable(&mut fds) {
            FAILS.with(|f| f.set(0));
            return Spun::Found;
        }
        if start.elapsed() >= budget {
            let fails = FAILS.with(|f| {
                f.set(f.get().saturating_add(1));
                f.get()
            });
            if fails >= FAILS_BEFORE_SKIPPING {
                let shift = (fails - FAILS_BEFORE_SKIPPING).min(10);
                SKIP.with(|s| s.set((1u32 << shift).min(MAX_SKIP)));
            }
            return Spun::Nothing;
        }
        // Let a peer that shares this CPU run.
        std::thread::yield_now();
    }
}

/// True if any of `fds` is readable (or closed, or failed: the runtime must look).
fn readable(fds: &mut [libc::pollfd]) -> bool {
    // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfd structs for
    // the duration of the call; poll(2) with a zero timeout only writes their `revents`.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
    n > 0
}

/// A receiver's socket registered as waited on while its read is pending; removed on drop.
#[derive(Debug)]
struct Registration {
    waiting: Waiting,
    fd: RawFd,
}

impl Registration {
    fn new(fd: RawFd) -> Registration {
        let waiting = WAITING.with(Arc::clone);
        lock(&waiting).push(fd);
        Registration { waiting, fd }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut w = lock(&self.waiting);
        if let Some(i) = w.iter().position(|&f| f == self.fd) {
            w.swap_remove(i);
        }
    }
}

/// Runs `read` with `fd` registered for spinning while it is pending (only when a hook
/// exists: otherwise this is `read` itself).
pub(crate) async fn spinning<F: Future>(fd: Option<RawFd>, read: F) -> F::Output {
    let Some(fd) = fd.filter(|_| ENABLED.load(Ordering::Relaxed)) else {
        return read.await;
    };
    let mut read = pin!(read);
    let mut registration = None;
    poll_fn(|cx| match read.as_mut().poll(cx) {
        Poll::Ready(v) => Poll::Ready(v),
        Poll::Pending => {
            registration.get_or_insert_with(|| Registration::new(fd));
            Poll::Pending
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One CPU: no spin, whatever the budget (the peer cannot run while this thread spins);
    /// more: the budget as given.
    #[test]
    fn a_single_cpu_turns_spinning_off() {
        let budget = Duration::from_micros(50);
        assert_eq!(useful_budget(budget, 1), Duration::ZERO);
        assert_eq!(useful_budget(budget, 0), Duration::ZERO);
        assert_eq!(useful_budget(budget, 2), budget);
        assert_eq!(useful_budget(Duration::ZERO, 8), Duration::ZERO);
        assert!(available_cpus() >= 1);
    }

    /// A thread pinned to one CPU still sees the process's CPUs: its peer may run on another.
    #[test]
    fn a_pinned_thread_sees_the_process_cpus() {
        let process = available_cpus();
        let seen = std::thread::spawn(|| {
            // SAFETY: as in `available_cpus`; CPU_SET writes within the set, and
            // sched_setaffinity(0, ..) reads it and changes this (spawned) thread only.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut set);
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
            available_cpus()
        })
        .join()
        .expect("thread");
        assert_eq!(seen, process);
    }
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    /// A read that is pending has its socket registered for spinning (with a hook in
    /// existence) until it completes; a read that completes at once never registers.
    #[tokio::test]
    async fn a_pending_read_is_registered_until_it_completes() {
        // What a hook with a budget does (set directly: on a single CPU a hook never spins,
        // and registers nothing).
        ENABLED.store(true, Ordering::Relaxed);
        let waiting = || WAITING.with(|w| lock(w).clone());
        let (a, _b) = UnixStream::pair().unwrap();
        let fd = a.as_raw_fd();
        assert_eq!(spinning(Some(fd), async { 7 }).await, 7);
        assert!(waiting().is_empty(), "a ready read is not registered");
        let (tx, rx) = tokio::sync::oneshot::channel::<u8>();
        let mut read = std::pin::pin!(spinning(Some(fd), rx));
        let first = poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await;
        assert!(first.is_pending());
        assert_eq!(waiting(), vec![fd], "registered while pending");
        tx.send(1).unwrap();
        assert_eq!(read.await.unwrap(), 1);
        assert!(waiting().is_empty(), "removed once the read completed");
    }

    /// A spin returns as soon as a registered socket is readable, finds nothing within the
    /// budget otherwise, skips when nothing is registered, and after repeated empty spins
    /// skips a growing number of parks.
    #[test]
    fn spins_find_readable_sockets_and_back_off_when_they_do_not() {
        let budget = Duration::from_millis(2);
        assert_eq!(
            spin_before_park(budget),
            Spun::Skipped,
            "nothing registered"
        );
        let (a, mut b) = UnixStream::pair().unwrap();
        let reg = Registration::new(a.as_raw_fd());
        assert_eq!(spin_before_park(Duration::ZERO), Spun::Skipped);
        let t = Instant::now();
        assert_eq!(spin_before_park(budget), Spun::Nothing);
        assert!(t.elapsed() >= budget);
        b.write_all(b"x").unwrap();
        assert_eq!(spin_before_park(budget), Spun::Found);
        drop(reg);
        assert_eq!(
            spin_before_park(budget),
            Spun::Skipped,
            "unregistered on drop"
        );
        let (c, _d) = UnixStream::pair().unwrap();
        let _reg = Registration::new(c.as_raw_fd());
        for _ in 0..FAILS_BEFORE_SKIPPING {
            assert_eq!(spin_before_park(budget), Spun::Nothing);
        }
        assert_eq!(spin_before_park(budget), Spun::Skipped, "backing off");
        assert_eq!(
            spin_before_park(budget),
            Spun::Nothing,
            "one park skipped, then tries"
        );
        assert_eq!(spin_before_park(budget), Spun::Skipped);
        assert_eq!(
            spin_before_park(budget),
            Spun::Skipped,
            "two parks skipped now"
        );
    }
}
