//! Spinning before sleeping: a runtime thread about to park first polls the sockets its
//! receivers wait on, for a bounded time.
//!
//! When the peer runs on another CPU, a reply often arrives a few microseconds after the
//! runtime ran out of work; parking in `epoll_wait` then costs a sleep and a cross-CPU wake-up
//! (on a VM, tens of microseconds per round trip, blocking sockets included). With the hook
//! from [`park_hook`] installed in a tokio runtime (`Builder::on_thread_park`), the thread
//! first polls (zero timeout, yielding the CPU between polls) the sockets that stream receivers
//! on it are waiting on, for at most the budget: TCP and other sockets through an epoll set of
//! its own, Unix sockets with `poll(2)`. As soon as one is readable it returns and the
//! runtime's `epoll_wait` finds the event without sleeping.
//!
//! Why an epoll set for TCP: `poll(2)` reads the socket's state, which for TCP shows
//! the data a moment before the kernel runs the socket's wake-up callbacks (it first processes
//! the segment's acknowledgement). A spin that returned on `poll(2)` would send the runtime
//! into `epoll_wait` before its event is queued, and the runtime would sleep until the
//! callback woke it: whole TCP connections then settle into round trips several times longer
//! (docs/notes/2026-12-02-bench-spin-before-sleeping.md). An event in an epoll set means the
//! callbacks have run, the runtime's included. A Unix socket queues its data and runs its
//! callbacks together, so `poll(2)`, which costs less, is safe there.
//!
//! It spins only on reads that began to wait since the thread's last park (an answer
//! awaited since the turn that just ended), not on ones that have waited across parks (an
//! idle connection, a stream's acknowledgement while the thread waits for room to write).
//! It costs CPU only after activity: a thread parks once per wake-up, so an idle process spins
//! once (one budget) and then sleeps. Spins that keep finding nothing (the peer is slow), or
//! find something only after this thread was switched out while it spun (the peer shares its
//! CPU: it could reply only once this thread yielded, and would have as soon had it slept),
//! make the thread skip spinning for a growing number of parks. So the hook can be installed
//! wherever the process may use more than one CPU: it spins where that pays and backs off
//! where it does not ([`DEFAULT_BUDGET`] is what the bench uses).
//!
//! ```no_run
//! use std::time::Duration;
//! let rt = tokio::runtime::Builder::new_current_thread()
//!     .enable_all()
//!     .on_thread_park(transport_core::spin::park_hook(Duration::from_micros(50)))
//!     .build()
//!     .unwrap();
//! ```

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::os::fd::RawFd;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

/// A spin budget that covers a reply from a peer on another CPU of the same machine (a
/// round trip there is 5-20 µs), at a cost of at most this much CPU per wake-up of an idle
/// thread. The bench's default (`--spin-us`).
pub const DEFAULT_BUDGET: Duration = Duration::from_micros(50);

/// Set once any hook exists: receivers register their sockets only then.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Spins in a row that found nothing before a thread starts skipping spins.
const FAILS_BEFORE_SKIPPING: u32 = 4;
/// Most parks skipped after failed spins.
const MAX_SKIP: u32 = 1024;

/// The sockets this thread's receivers wait on, each with the park count when its read
/// began to wait.
type Waiting = Arc<Mutex<Vec<(RawFd, u64)>>>;

/// This thread's epoll set for spinning (edge-triggered `EPOLLIN` on each socket it waited on:
/// an arrival is reported once, and sockets no longer waited on do not keep reporting unread
/// data). Sockets stay in it after their read completes (adding one per read would cost a
/// system call per message); a closed socket leaves it by itself, and a spin that finds nothing
/// forgets what it added, so a descriptor number reused by a new socket is added again.
/// Unix-domain sockets are not added: their data and their wake-up come together, so they are
/// polled with `poll(2)`, which costs less per round trip.
struct SpinSet {
    ep: std::os::fd::OwnedFd,
    /// Each socket seen, and whether it is in the epoll set (false: a Unix socket).
    added: HashMap<RawFd, bool>,
}

impl SpinSet {
    fn new() -> Option<SpinSet> {
        use std::os::fd::FromRawFd;
        // SAFETY: epoll_create1 takes no pointers; a non-negative result is a new descriptor
        // that nothing else owns.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return None;
        }
        // SAFETY: `ep` was just created and is owned by nothing else.
        let ep = unsafe { std::os::fd::OwnedFd::from_raw_fd(ep) };
        Some(SpinSet {
            ep,
            added: HashMap::new(),
        })
    }

    /// Adds the sockets not added yet; false if one cannot be (then `poll(2)` is used).
    fn add(&mut self, fds: &[RawFd]) -> bool {
        use std::os::fd::AsRawFd;
        for &fd in fds {
            if self.added.contains_key(&fd) {
                continue;
            }
            if is_unix_socket(fd) {
                self.added.insert(fd, false);
                continue;
            }
            let mut ev = libc::epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
                u64: fd as u64,
            };
            // SAFETY: `ev` is a valid event for the duration of the call; the epoll set is
            // open (owned by `self`).
            let rc =
                unsafe { libc::epoll_ctl(self.ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
            if rc != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                return false;
            }
            self.added.insert(fd, true);
        }
        true
    }

    /// The sockets of `fds` polled with `poll(2)` and those in the epoll set.
    fn split(&self, fds: &[RawFd]) -> (Vec<libc::pollfd>, Vec<RawFd>) {
        let (mut polled, mut epolled) = (Vec::new(), Vec::new());
        for &fd in fds {
            if self.added.get(&fd) == Some(&true) {
                epolled.push(fd);
            } else {
                polled.push(pollin(fd));
            }
        }
        (polled, epolled)
    }

    /// True if one of `fds` has an event in the set (zero timeout).
    fn ready(&self, fds: &[RawFd]) -> bool {
        use std::os::fd::AsRawFd;
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        // SAFETY: `events` has room for 16 entries, which is what the call may write; the
        // epoll set is open.
        let n = unsafe { libc::epoll_wait(self.ep.as_raw_fd(), events.as_mut_ptr(), 16, 0) };
        // Sockets no longer waited on may be reported (an arrival they have not read yet):
        // only a waited-on one counts.
        n > 0
            && events[..n as usize]
                .iter()
                .any(|e| fds.contains(&(e.u64 as RawFd)))
    }
}

thread_local! {
    static SPIN_SET: RefCell<Option<SpinSet>> = const { RefCell::new(None) };
    static WAITING: Waiting = Arc::default();
    static PARKS: Cell<u64> = const { Cell::new(0) };
    static FAILS: Cell<u32> = const { Cell::new(0) };
    static SKIP: Cell<u32> = const { Cell::new(0) };
}

fn lock(w: &Waiting) -> std::sync::MutexGuard<'_, Vec<(RawFd, u64)>> {
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
    /// A socket was readable at the first look: the spin saved nothing (the runtime would
    /// not have slept either), and neither starts the failure count over nor adds to it.
    Ready,
    /// A socket became readable within the budget, without this thread being switched out.
    Found,
    /// A socket became readable, but only after this thread had been switched out while it
    /// spun (the peer most likely shares its CPU): counted as a failure.
    Shared,
    /// The budget passed with nothing readable.
    Nothing,
}

impl Spun {
    /// Whether the spin saw a socket readable.
    pub fn found_data(self) -> bool {
        matches!(self, Spun::Ready | Spun::Found | Spun::Shared)
    }
}

/// Spins for at most `budget` on the sockets this thread's receivers began to wait on since
/// its last park.
///
/// Only those: a read that began to wait in the turn that just ended (a request sent, its
/// answer awaited) is one whose data may come within microseconds. A read that has waited
/// across parks is waiting on a peer with nothing to say (a stream's acknowledgement, an
/// idle connection) while the thread sleeps for something else, such as room to write;
/// spinning on it only delayed the thread: on one CPU a raw stream's writer, spinning on its
/// idle reply socket while its receiver drained the socket, settled into filling and
/// draining the whole socket buffer in turns, and moved half as much
/// (docs/notes/2026-12-06-spin-by-default.md).
pub fn spin_before_park(budget: Duration) -> Spun {
    let park = PARKS.with(|p| {
        let park = p.get();
        p.set(park.wrapping_add(1));
        park
    });
    if budget.is_zero() {
        return Spun::Skipped;
    }
    let skip = SKIP.with(Cell::get);
    if skip > 0 {
        SKIP.with(|s| s.set(skip - 1));
        return Spun::Skipped;
    }
    let waiting: Vec<RawFd> = WAITING.with(|w| {
        lock(w)
            .iter()
            .filter(|&&(_, since)| since == park)
            .map(|&(fd, _)| fd)
            .collect()
    });
    if waiting.is_empty() {
        return Spun::Skipped;
    }
    SPIN_SET.with(|s| {
        let mut s = s.borrow_mut();
        if s.is_none() {
            *s = SpinSet::new();
        }
        let added = s.as_mut().is_some_and(|set| set.add(&waiting));
        let spun = match s.as_ref() {
            Some(set) if added => {
                let (mut polled, epolled) = set.split(&waiting);
                spin(budget, || {
                    (!polled.is_empty() && readable(&mut polled))
                        || (!epolled.is_empty() && set.ready(&epolled))
                })
            }
            _ => {
                let mut fds: Vec<libc::pollfd> = waiting.iter().map(|&fd| pollin(fd)).collect();
                spin(budget, || readable(&mut fds))
            }
        };
        if spun == Spun::Nothing {
            if let Some(set) = s.as_mut() {
                for fd in &waiting {
                    set.added.remove(fd);
                }
            }
        }
        spun
    })
}

/// Calls `ready` until it says yes or `budget` passes, yielding the CPU between calls; counts
/// the failures for backing off (the blocking RPC spins with it too).
///
/// A find counts as a failure too when this thread was switched out while it spun (its
/// context switches, read before the first yield and at the find, grew): what it waited
/// for then came while it had given its CPU away, most likely because the peer shares that
/// CPU and could only run when this thread yielded. Sleeping would have let it run as soon,
/// without the spin's system calls, so such spins back off as empty ones do.
pub fn spin(budget: Duration, ready: impl FnMut() -> bool) -> Spun {
    spin_counting(budget, ready, thread_switches)
}

/// [`spin`] with the thread's context switches read by `switches`.
fn spin_counting(
    budget: Duration,
    mut ready: impl FnMut() -> bool,
    switches: impl Fn() -> u64,
) -> Spun {
    let start = Instant::now();
    let mut switches_before = None;
    loop {
        if ready() {
            let Some(before) = switches_before else {
                return Spun::Ready;
            };
            if switches() > before {
                failed_spin();
                return Spun::Shared;
            }
            FAILS.with(|f| f.set(0));
            return Spun::Found;
        }
        if start.elapsed() >= budget {
            failed_spin();
            return Spun::Nothing;
        }
        if switches_before.is_none() {
            switches_before = Some(switches());
        }
        // Let a peer that shares this CPU run.
        std::thread::yield_now();
    }
}

/// Counts a spin that did not pay; after [`FAILS_BEFORE_SKIPPING`] in a row, the thread
/// skips a doubling number of parks (up to [`MAX_SKIP`]) before it spins again.
fn failed_spin() {
    let fails = FAILS.with(|f| {
        f.set(f.get().saturating_add(1));
        f.get()
    });
    if fails >= FAILS_BEFORE_SKIPPING {
        let shift = (fails - FAILS_BEFORE_SKIPPING).min(10);
        SKIP.with(|s| s.set((1u32 << shift).min(MAX_SKIP)));
    }
}

/// The calling thread's context switches so far, voluntary and not (0 if they cannot be
/// read: then no spin is seen as shared).
fn thread_switches() -> u64 {
    // SAFETY: a zeroed rusage is a valid value; getrusage writes at most one rusage into it
    // for the duration of the call.
    let (rc, usage) = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        (libc::getrusage(libc::RUSAGE_THREAD, &mut usage), usage)
    };
    if rc != 0 {
        return 0;
    }
    (usage.ru_nvcsw as u64).wrapping_add(usage.ru_nivcsw as u64)
}

/// Whether `fd` is a Unix-domain socket (false if that cannot be told).
fn is_unix_socket(fd: RawFd) -> bool {
    let mut domain: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `domain` and `len` are valid, writable and sized as the option needs for the
    // duration of the call; a descriptor that is not a socket makes it fail (ENOTSOCK).
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&mut domain as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    rc == 0 && domain == libc::AF_UNIX
}

/// `fd` asked for readability, for `poll(2)`.
fn pollin(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
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
        let park = PARKS.with(Cell::get);
        lock(&waiting).push((fd, park));
        Registration { waiting, fd }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut w = lock(&self.waiting);
        if let Some(i) = w.iter().position(|&(f, _)| f == self.fd) {
            w.swap_remove(i);
        }
    }
}

/// Runs `read` with `fd` registered for spinning while it is pending (only when a hook
/// exists: otherwise this is `read` itself).
pub async fn spinning<F: Future>(fd: Option<RawFd>, read: F) -> F::Output {
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
            pin_to(first_cpu());
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
        let waiting = || WAITING.with(|w| lock(w).iter().map(|&(fd, _)| fd).collect::<Vec<_>>());
        let (a, _b) = UnixStream::pair().unwrap();
        let fd = a.as_raw_fd();
        assert_eq!(spinning(Some(fd), async { 7 }).await, 7);
        assert!(waiting().is_empty(), "a ready read is not registered");
        let (tx, rx) = tokio::sync::oneshot::channel::<u8>();
        let mut read = std::pin::pin!(spinning(Some(fd), rx));
        let first = crate::poll_once(read.as_mut()).await;
        assert!(first.is_pending());
        assert_eq!(waiting(), vec![fd], "registered while pending");
        tx.send(1).unwrap();
        assert_eq!(read.await.unwrap(), 1);
        assert!(waiting().is_empty(), "removed once the read completed");
    }

    /// Spins once on `fds`, registered as waited on since just before this park.
    fn spin_on(fds: &[RawFd], budget: Duration) -> Spun {
        let _waiting: Vec<Registration> = fds.iter().map(|&fd| Registration::new(fd)).collect();
        spin_before_park(budget)
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
        let a = [a.as_raw_fd()];
        assert_eq!(spin_on(&a, Duration::ZERO), Spun::Skipped);
        let t = Instant::now();
        assert_eq!(spin_on(&a, budget), Spun::Nothing);
        assert!(t.elapsed() >= budget);
        b.write_all(b"x").unwrap();
        assert_eq!(
            spin_on(&a, budget),
            Spun::Ready,
            "readable at the first look"
        );
        assert_eq!(
            spin_before_park(budget),
            Spun::Skipped,
            "unregistered on drop"
        );
        let (c, _d) = UnixStream::pair().unwrap();
        let c = [c.as_raw_fd()];
        // The first pair's spins have failed once (Nothing): start over.
        FAILS.with(|f| f.set(0));
        for _ in 0..FAILS_BEFORE_SKIPPING {
            assert_eq!(spin_on(&c, budget), Spun::Nothing);
        }
        assert_eq!(spin_on(&c, budget), Spun::Skipped, "backing off");
        assert_eq!(
            spin_on(&c, budget),
            Spun::Nothing,
            "one park skipped, then tries"
        );
        assert_eq!(spin_on(&c, budget), Spun::Skipped);
        assert_eq!(spin_on(&c, budget), Spun::Skipped, "two parks skipped now");
    }

    /// Only reads that began to wait since the thread's last park are spun on: one that has
    /// waited across a park is left alone, readable or not, while a new one beside it is
    /// found.
    #[test]
    fn reads_waiting_since_before_the_last_park_are_not_spun_on() {
        let budget = Duration::from_millis(2);
        let (a, mut b) = UnixStream::pair().unwrap();
        let _old = Registration::new(a.as_raw_fd());
        b.write_all(b"x").unwrap();
        assert_eq!(spin_before_park(budget), Spun::Ready, "new: spun on");
        assert_eq!(
            spin_before_park(budget),
            Spun::Skipped,
            "waited across a park"
        );
        let (c, mut d) = UnixStream::pair().unwrap();
        let _new = Registration::new(c.as_raw_fd());
        assert_eq!(
            spin_before_park(budget),
            Spun::Nothing,
            "the old one is not looked at"
        );
        let _newer = Registration::new(c.as_raw_fd());
        d.write_all(b"y").unwrap();
        assert_eq!(spin_before_park(budget), Spun::Ready);
    }

    /// Pins the calling thread to `cpu`.
    fn pin_to(cpu: usize) {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it, and
        // sched_setaffinity(0, ..) reads it and changes the calling thread only.
        let rc = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        assert_eq!(rc, 0, "pin to CPU {cpu}");
    }

    /// The first CPU this thread may run on.
    fn first_cpu() -> usize {
        // SAFETY: as in `available_cpus`; CPU_ISSET only reads the set.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            let size = std::mem::size_of::<libc::cpu_set_t>();
            assert_eq!(libc::sched_getaffinity(0, size, &mut set), 0);
            (0..libc::CPU_SETSIZE as usize)
                .find(|&c| libc::CPU_ISSET(c, &set))
                .expect("some CPU")
        }
    }

    /// A peer pinned to the spinning thread's CPU answers only when that thread gives the
    /// CPU away: the find counts as shared, a failed spin that starts the back-off (the
    /// thread had three failures, the fourth makes it skip its next park).
    #[test]
    fn a_find_that_needed_the_cpu_given_away_counts_as_a_failure() {
        use std::sync::atomic::AtomicU32;
        let cpu = first_cpu();
        let (spun, fails, skip) = std::thread::spawn(move || {
            pin_to(cpu);
            let polls = Arc::new(AtomicU32::new(0));
            let answered = Arc::new(AtomicBool::new(false));
            let peer = {
                let (polls, answered) = (polls.clone(), answered.clone());
                std::thread::spawn(move || {
                    pin_to(cpu);
                    // Answer once the spinner has polled twice: its second poll comes after
                    // it read its switch count, before it yields again. Bounded: the spin
                    // gives up after its budget and then this loop after its own.
                    let t = Instant::now();
                    while polls.load(Ordering::SeqCst) < 2 && t.elapsed() < Duration::from_secs(10)
                    {
                        std::thread::yield_now();
                    }
                    answered.store(true, Ordering::SeqCst);
                })
            };
            FAILS.with(|f| f.set(FAILS_BEFORE_SKIPPING - 1));
            let spun = spin(Duration::from_secs(5), || {
                polls.fetch_add(1, Ordering::SeqCst);
                answered.load(Ordering::SeqCst)
            });
            let (fails, skip) = (FAILS.with(Cell::get), SKIP.with(Cell::get));
            peer.join().expect("peer");
            (spun, fails, skip)
        })
        .join()
        .expect("spinner");
        assert_eq!(spun, Spun::Shared, "the peer could only answer on this CPU");
        assert_eq!(fails, FAILS_BEFORE_SKIPPING, "counted as a failure");
        assert_eq!(skip, 1, "the fourth failure in a row skips the next park");
    }

    /// How each kind of find counts, with the switch count given: readable at the first
    /// look changes nothing; after a yield with no switch it starts the failure count over;
    /// after a switch it adds to it, as an empty spin does.
    #[test]
    fn finds_count_by_whether_the_thread_was_switched_out() {
        let budget = Duration::from_secs(5);
        let fails = || FAILS.with(Cell::get);
        let on_call = |n: u32| {
            let mut calls = 0;
            move || {
                calls += 1;
                calls >= n
            }
        };
        FAILS.with(|f| f.set(2));
        assert_eq!(spin_counting(budget, on_call(1), || 7), Spun::Ready);
        assert_eq!(fails(), 2, "a find at the first look is neutral");
        let switches = Cell::new(7);
        let switched = || {
            switches.set(switches.get() + 1);
            switches.get()
        };
        assert_eq!(spin_counting(budget, on_call(3), switched), Spun::Shared);
        assert_eq!(fails(), 3, "a find after a switch is a failure");
        assert_eq!(spin_counting(budget, on_call(3), || 7), Spun::Found);
        assert_eq!(fails(), 0, "a find without a switch starts over");
        assert!(Spun::Ready.found_data() && Spun::Found.found_data() && Spun::Shared.found_data());
        assert!(!Spun::Nothing.found_data() && !Spun::Skipped.found_data());
    }

    /// A connected pair of TCP sockets on loopback (what the epoll set is for).
    fn tcp_pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// A TCP socket is waited on through the thread's epoll set: found when data arrives, and
    /// a Unix socket beside it is still polled.
    #[test]
    fn tcp_sockets_are_found_through_the_epoll_set() {
        let budget = Duration::from_millis(2);
        let (a, mut b) = tcp_pair();
        let (u, mut v) = UnixStream::pair().unwrap();
        let both = [a.as_raw_fd(), u.as_raw_fd()];
        assert_eq!(spin_on(&both, budget), Spun::Nothing);
        b.write_all(b"x").unwrap();
        // Loopback delivers within the budget (bounded: the spin returns either way).
        assert!(spin_on(&both, Duration::from_secs(2)).found_data());
        let in_set = SPIN_SET.with(|s| {
            let s = s.borrow();
            let set = s.as_ref().expect("made by the first spin");
            (
                set.added.get(&a.as_raw_fd()).copied(),
                set.added.get(&u.as_raw_fd()).copied(),
            )
        });
        assert_eq!(
            in_set,
            (Some(true), Some(false)),
            "TCP in the epoll set, Unix polled"
        );
        v.write_all(b"y").unwrap();
        assert!(spin_on(&both, budget).found_data());
    }

    /// A socket that reuses the descriptor number of a closed one (which left the epoll set
    /// with it) is found again: the spin that finds nothing forgets the number, the next one
    /// adds the new socket.
    #[test]
    fn a_reused_descriptor_is_found_again() {
        use std::os::fd::{FromRawFd, IntoRawFd};
        let budget = Duration::from_millis(2);
        let (a, mut b) = tcp_pair();
        let fd = a.as_raw_fd();
        b.write_all(b"x").unwrap();
        assert!(spin_on(&[fd], Duration::from_secs(2)).found_data());
        drop(b);
        // Another socket under the same number: dup2 closes the first socket and reuses its
        // number in one step (no other thread can take the number in between).
        let fd = a.into_raw_fd();
        let (c, mut d) = tcp_pair();
        // SAFETY: `fd` is owned here (taken from `a`); dup2 closes its socket and makes it a
        // second descriptor of `c`'s socket.
        assert_eq!(unsafe { libc::dup2(c.as_raw_fd(), fd) }, fd);
        // SAFETY: `fd` is open (dup2 above) and owned by nothing else from here on.
        let reused = unsafe { std::net::TcpStream::from_raw_fd(fd) };
        drop(c);
        let reused_fd = [reused.as_raw_fd()];
        d.write_all(b"y").unwrap();
        let first = spin_on(&reused_fd, budget);
        let found = first.found_data() || spin_on(&reused_fd, Duration::from_secs(2)).found_data();
        assert!(found, "the reused descriptor was not found: {first:?}");
        drop(reused);
    }
}
