//! Adaptive polling (`VerbsConfig::poll_spin`): replies that come within the spin budget cost
//! no completion-channel system call and are taken from the device on the receiving task
//! itself (no hand-off from the driver task), and idle connections do not spin. Without a
//! budget, completion events (one channel per device, read by one pump thread) wake each
//! connection's own driver, on whichever runtime it lives.

mod common;

use std::time::Duration;

use bytes::Bytes;
use transport_core::{
    Connection, HeaderBytes, Listener, Message, MessageReceiver, MessageSender, Transport,
};
use transport_verbs::{VerbsConfig, VerbsTransport};

const ROUND_TRIPS: u64 = 300;

/// The tests of this file measure what the whole process does (CPU time, system calls,
/// wake-ups, hand-offs): run side by side, one test's spinning connections show up in
/// another's idle CPU. Each takes this lock first, so they run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    // A test that failed while holding it poisons it; the next still runs alone.
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sends every message `server` receives back to its peer until the stream ends.
fn echo_back(server: transport_verbs::VerbsConnection) -> tokio::task::JoinHandle<()> {
    let (mut stx, mut srx) = server.split();
    tokio::spawn(async move {
        while let Ok(Some(m)) = srx.recv().await {
            if stx.send(m).await.is_err() {
                break;
            }
        }
    })
}

/// What `ROUND_TRIPS` 8-byte ping-pongs on one connection cost its client with this spin
/// budget.
struct Costs {
    /// Completion-channel arms and event reads.
    syscalls: u64,
    /// Replies the driver task took from the device and handed to the receiving task.
    handoffs: u64,
}

async fn ping_pong_costs(addr: std::net::SocketAddr, spin: Duration) -> Costs {
    let mut config = VerbsConfig::default();
    config.poll_spin = spin;
    let verbs = VerbsTransport::new(config).expect("transport");
    let mut listener = verbs.listen(&addr).await.expect("listen");
    let addr = listener.local_addr().expect("addr");
    let conn = verbs.connect(&addr).await.expect("connect");
    let server = listener.accept().await.expect("accept");
    let metrics = conn.metrics();
    let (mut tx, mut rx) = conn.split();
    let echo = echo_back(server);
    let ping = || Message::new(HeaderBytes::from([7u8]), Bytes::from_static(b"8 bytes!"));
    // The handshake and first exchange are not counted.
    tx.send(ping()).await.expect("send");
    rx.recv().await.expect("recv").expect("open");
    let before = metrics.snapshot();
    for _ in 0..ROUND_TRIPS {
        tx.send(ping()).await.expect("send");
        let m = rx.recv().await.expect("recv").expect("open");
        assert_eq!(&m.payload[..], b"8 bytes!");
    }
    let d = metrics.snapshot() - before;
    tx.close().await.expect("close");
    // The echo task sees the end of the stream and stops.
    tokio::time::timeout(Duration::from_secs(10), echo)
        .await
        .expect("echo task ended")
        .expect("echo task");
    drop(rx);
    Costs {
        syscalls: d.syscalls,
        handoffs: d.handoffs,
    }
}

/// One cost of the ping-pong in event mode (`poll_spin` 0), then within a 30 s spin budget.
async fn in_both_modes(addr: std::net::SocketAddr, cost: impl Fn(&Costs) -> u64) -> (u64, u64) {
    let events = ping_pong_costs(addr, Duration::ZERO).await;
    let spinning = ping_pong_costs(addr, Duration::from_secs(30)).await;
    (cost(&events), cost(&spinning))
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn replies_within_the_spin_budget_cost_no_completion_event() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    common::run(async move {
        let (events, spinning) = in_both_modes(addr, |c| c.syscalls).await;
        eprintln!(
            "client system calls over {ROUND_TRIPS} round trips: {events} with poll_spin 0 \
             (events), {spinning} with poll_spin 30 s"
        );
        // Without a spin budget every wait for the reply arms the channel and reads an event.
        assert!(
            events >= ROUND_TRIPS,
            "event mode made only {events} system calls in {ROUND_TRIPS} round trips"
        );
        // Within the budget the driver never sleeps: no arm, no event read.
        assert!(
            spinning <= 4,
            "{spinning} completion-channel system calls while replies came within the budget"
        );
    });
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn replies_within_the_spin_budget_are_taken_on_the_receiving_task() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    common::run(async move {
        let (events, spinning) = in_both_modes(addr, |c| c.handoffs).await;
        eprintln!(
            "replies handed over by the driver in {ROUND_TRIPS} round trips: {events} with \
             poll_spin 0 (events), {spinning} with poll_spin 30 s"
        );
        // Sleeping on the completion channel, the driver is woken and hands the reply over.
        assert!(
            events >= ROUND_TRIPS / 2,
            "event mode handed over only {events} of {ROUND_TRIPS} replies"
        );
        // Within the budget the waiting receiver polls the CQ itself and the driver stays out
        // of its way: no task hop between the device and the application.
        assert!(
            spinning <= 4,
            "{spinning} of {ROUND_TRIPS} replies went through the driver task while the \
             receiver was polling"
        );
    });
}

/// Shared receive queue depth of [`messages_reach_a_blocked_runtime`].
const SMALL_SRQ: usize = 8;

/// Messages sent to a connection whose driver sleeps on the completion channel reach it while
/// the runtime it lives on is blocked, four times as many as its device's shared receive queue
/// holds: the device's pump thread drains the connection's CQ at each event, so the queue gets
/// each buffer back at once. Otherwise every buffer would stay taken until that runtime runs
/// the connection's driver (here: never, until released), and the senders beyond the queue's
/// depth would wait on RNR retries; with a thousand clients on one runtime that empties a
/// queue of 128 and turns into a storm of RNR retries
/// (docs/notes/2026-12-03-scenarios-rnr-retries.md).
#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_sleeping_connection_takes_its_messages_while_its_runtime_is_blocked() {
    // Pure event mode: the server's driver sleeps on the channel as soon as it is idle.
    if let Some(server) = messages_reach_a_blocked_runtime(Duration::ZERO, SMALL_SRQ) {
        let m = server.memory_use();
        assert_eq!(
            m.shared_receive_buffers, SMALL_SRQ,
            "grew beyond its cap: {m:?}"
        );
    }
}

/// Like `a_sleeping_connection_takes_its_messages_while_its_runtime_is_blocked`, but the
/// server's connection spins (its budget outlasts the test), so its CQ is never armed and
/// raises no event: when the shared receive queue runs below its limit, the device's pump
/// drains every connection's CQ and posts the buffers again. Otherwise the 8 buffers would
/// stay in the unpolled CQ and the sender would retry on RNR NAKs until the runtime is released
/// (with many clients spinning on one busy runtime: an RNR storm,
/// docs/notes/2026-12-04-scenarios-srq-low-water-event.md).
#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_spinning_connection_gives_back_its_buffers_while_its_runtime_is_blocked() {
    if let Some(server) = messages_reach_a_blocked_runtime(Duration::from_secs(120), SMALL_SRQ) {
        let m = server.memory_use();
        assert_eq!(
            m.shared_receive_buffers, SMALL_SRQ,
            "grew beyond its cap: {m:?}"
        );
    }
}

/// As `a_spinning_connection_gives_back_its_buffers_while_its_runtime_is_blocked`, with room to
/// grow: four times the queue's depth in flight at once runs it low, and at its low-water
/// event the queue doubles, up to `srq_max_depth` and not beyond. A thousand clients calling
/// together then find a buffer each instead of retrying on RNR NAKs
/// (docs/notes/2026-12-06-srq-grows.md).
#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_shared_receive_queue_that_runs_low_grows_up_to_its_cap() {
    let cap = 2 * SMALL_SRQ;
    let Some(server) = messages_reach_a_blocked_runtime(Duration::from_secs(120), cap) else {
        eprintln!("no shared receive queue on this device's paths: nothing to grow");
        return;
    };
    // The queue grows on a thread of its own, started at the low-water event: its depth
    // rises batch by batch as fresh buffers are made, each batch posted as it is counted.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !grown_to(&server, cap, deadline) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether `verbs`'s shared receive queue holds `want` buffers, all posted; fails the test
/// if it holds more, or if `deadline` has passed without it.
fn grown_to(verbs: &VerbsTransport, want: usize, deadline: std::time::Instant) -> bool {
    let m = verbs.memory_use();
    assert!(
        m.shared_receive_buffers <= want,
        "grew beyond {want}: {m:?}"
    );
    if m.shared_receive_buffers == want
        && m.shared_receive_bytes == want * verbs.config().recv_buf_size()
    {
        return true;
    }
    assert!(
        std::time::Instant::now() < deadline,
        "the queue did not grow to {want} buffers, all posted: {m:?}"
    );
    false
}

/// The shared receive queue grows with the connections it serves, before any message: with
/// two buffers per connection (`SHARED_BUFFERS_PER_CONNECTION`), twelve connections grow a
/// queue of 8 to 32 (16 is not enough, 32 is), not to its cap of 64. Clients that connect
/// and then call together do not wait on RNR NAKs while it grows.
#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_shared_receive_queue_grows_with_the_connections_it_serves() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    let mut config = VerbsConfig::default();
    config.srq_depth = SMALL_SRQ;
    config.srq_max_depth = 8 * SMALL_SRQ;
    if common::device_paths(&config, addr.ip()).srq_depth == 0 {
        eprintln!("no shared receive queue on this device's paths: nothing to grow");
        return;
    }
    common::run(async move {
        let verbs = VerbsTransport::new(config.clone()).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut pairs = Vec::new();
        // Six pairs, both ends on this transport: twelve connections.
        for _ in 0..6 {
            pairs.push(common::open_pair(&verbs, &mut listener, addr).await);
        }
        let want = 4 * SMALL_SRQ;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !grown_to(&verbs, want, deadline) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let m = common::srq_refilled(&verbs, config.recv_buf_size()).await;
        assert_eq!(m.shared_receive_buffers, want, "{m:?}");
        assert_eq!(m.connections, 12, "{m:?}");
        drop(pairs);
    });
}

/// Sends four times the shared receive queue's depth to a server connection whose runtime is
/// blocked (its driver spins for `poll_spin` after activity), and asserts they all reach its
/// engine meanwhile, then arrive whole and in order. The queue may grow to `srq_max_depth`;
/// returns the server's transport (`None`: the device's paths have no shared queue).
fn messages_reach_a_blocked_runtime(
    poll_spin: Duration,
    srq_max_depth: usize,
) -> Option<VerbsTransport> {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    const MSGS: usize = 4 * SMALL_SRQ;
    const BODY: &[u8] = b"parked";
    let mut config = VerbsConfig::default();
    config.srq_depth = SMALL_SRQ;
    config.srq_max_depth = srq_max_depth;
    config.poll_spin = poll_spin;
    let shared_queue = common::device_paths(&config, addr.ip()).srq_depth > 0;
    let server_verbs = VerbsTransport::new(config).expect("transport");
    let server_transport = server_verbs.clone();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (metrics_tx, metrics_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    // The server's connection lives on a runtime of one thread, which the test blocks.
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let mut listener = server_verbs.listen(&addr).await.expect("listen");
            addr_tx
                .send(listener.local_addr().expect("addr"))
                .expect("test waits");
            let conn = tokio::time::timeout(Duration::from_secs(30), listener.accept())
                .await
                .expect("accepted in time")
                .expect("accept");
            let metrics = conn.metrics();
            let (_stx, mut srx) = conn.split();
            // One message first: the handshake is done and the driver, idle again, sleeps on
            // the completion channel (it arms the CQ in the turn that delivered it), or spins.
            let first = tokio::time::timeout(Duration::from_secs(30), srx.recv())
                .await
                .expect("delivered in time")
                .expect("recv")
                .expect("open");
            assert_eq!(first.header.as_slice(), b"first");
            metrics_tx.send(metrics).expect("test waits");
            // Blocks this runtime, and the connection's driver with it, until released.
            release_rx
                .recv_timeout(Duration::from_secs(60))
                .expect("released");
            let mut got = Vec::with_capacity(MSGS);
            for _ in 0..MSGS {
                let m = tokio::time::timeout(Duration::from_secs(30), srx.recv())
                    .await
                    .expect("delivered in time")
                    .expect("recv")
                    .expect("open");
                assert_eq!(&m.payload[..], BODY);
                got.push(m.header.as_slice()[0]);
            }
            got
        })
    });
    common::run(async move {
        let server_addr = addr_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("server listens");
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let conn = verbs.connect(&server_addr).await.expect("connect");
        let (mut tx, _rx) = conn.split();
        tx.send(Message::new(HeaderBytes::from(*b"first"), Bytes::new()))
            .await
            .expect("send");
        let server_metrics = tokio::task::spawn_blocking(move || {
            metrics_rx
                .recv_timeout(Duration::from_secs(30))
                .expect("server took the first message")
        })
        .await
        .expect("join");
        let before = server_metrics.snapshot().bytes_received;
        let mut batch: Vec<Message> = (0..MSGS)
            .map(|i| Message::new(HeaderBytes::from([i as u8]), Bytes::from_static(BODY)))
            .collect();
        tx.send_batch(&mut batch).await.expect("send_batch");
        // Every message reaches the server's engine while its runtime is blocked.
        let want = (MSGS * BODY.len()) as u64;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut got = 0;
        while std::time::Instant::now() < deadline {
            got = server_metrics.snapshot().bytes_received - before;
            if got >= want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let blocked_got = got;
        release_tx.send(()).expect("server waits");
        let order = tokio::task::spawn_blocking(move || server.join().expect("server thread"))
            .await
            .expect("join");
        // A spinning connection gives buffers back only where they are shared: with receive
        // buffers of its own (registration exposure, iWARP) they are nobody else's, and its
        // messages wait for its runtime like any of its work; a sleeping one is drained by the
        // pump either way.
        if shared_queue || poll_spin.is_zero() {
            assert!(
                blocked_got >= want,
                "the server's engine took {blocked_got} of at least {want} bytes while its \
                 runtime was blocked"
            );
        } else {
            eprintln!(
                "no shared receive queue on this device's paths: {blocked_got} of {want} bytes \
                 taken while blocked (nothing shared to give back); checking delivery only"
            );
        }
        let expected: Vec<u8> = (0..MSGS as u8).collect();
        assert_eq!(order, expected, "messages out of order");
        drop(tx);
    });
    shared_queue.then_some(server_transport)
}

/// Messages in the batch of `a_batch_of_sends_rings_one_doorbell_not_one_per_message`.
const BATCH: u8 = 32;

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn a_batch_of_sends_rings_one_doorbell_not_one_per_message() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    common::run(async move {
        // Credits for the whole batch: where the device's paths give each connection buffers
        // of its own, as many as the defaults grant through a shared queue.
        let mut cfg = VerbsConfig::default();
        if common::device_paths(&cfg, addr.ip()).srq_depth == 0 {
            cfg.srq_depth = 0;
        }
        let verbs = VerbsTransport::new(cfg).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        // The handshake and first exchange are not counted.
        let common::Pair {
            client: (mut tx, rx),
            server: (stx, mut srx),
        } = common::open_pair(&verbs, &mut listener, addr).await;
        let metrics = tx.metrics().clone();
        let msg = |i: u8| Message::new(HeaderBytes::from([i]), Bytes::from_static(b"8 bytes!"));

        let before = metrics.snapshot();
        for i in 0..BATCH {
            tx.send(msg(i)).await.expect("send");
        }
        let one_by_one = (metrics.snapshot() - before).doorbells;
        for i in 0..BATCH {
            let m = srx.recv().await.expect("recv").expect("open");
            assert_eq!(m.header.as_slice(), &[i], "message {i} out of order");
        }

        let before = metrics.snapshot();
        let mut batch: Vec<Message> = (0..BATCH).map(msg).collect();
        tx.send_batch(&mut batch).await.expect("send_batch");
        let batched = (metrics.snapshot() - before).doorbells;
        assert!(batch.is_empty(), "send_batch left {} messages", batch.len());
        for i in 0..BATCH {
            let m = srx.recv().await.expect("recv").expect("open");
            assert_eq!(
                m.header.as_slice(),
                &[i],
                "batched message {i} out of order"
            );
        }
        eprintln!(
            "client doorbells for {BATCH} messages: {one_by_one} sent one by one, {batched} as one batch"
        );
        assert!(
            one_by_one >= u64::from(BATCH),
            "{BATCH} separate sends rang only {one_by_one} doorbells"
        );
        // The batch's sends share one doorbell; receive-queue refills add at most a few.
        assert!(
            batched <= u64::from(BATCH) / 4,
            "a batch of {BATCH} rang {batched} doorbells"
        );
        drop((tx, rx, stx));
    });
}

/// CPU time this process has used (user + system).
fn cpu_time() -> Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is a valid, writable rusage; getrusage fills it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage");
    // SAFETY: filled by the successful call above.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Per thread of this process: (name, context switches, CPU clock ticks) from /proc, to name
/// what wakes while connections are idle.
fn thread_activity() -> std::collections::BTreeMap<u32, (String, u64, u64)> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let path = e.path();
        let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let switches = field("voluntary_ctxt_switches:") + field("nonvoluntary_ctxt_switches:");
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        // utime and stime are fields 14 and 15; the name before them may hold spaces.
        let stat = std::fs::read_to_string(path.join("stat")).unwrap_or_default();
        let ticks = stat
            .rsplit_once(')')
            .map(|(_, rest)| {
                rest.split_whitespace()
                    .skip(11)
                    .take(2)
                    .filter_map(|v| v.parse::<u64>().ok())
                    .sum()
            })
            .unwrap_or(0);
        out.insert(tid, (comm.trim().to_string(), switches, ticks));
    }
    out
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn idle_connections_stop_spinning_after_the_budget() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    // 100 open connections (both ends of 50 pairs), as in the idle target.
    const CONNS: usize = 50;
    common::run(async move {
        let verbs = VerbsTransport::new(VerbsConfig::default()).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut kept = Vec::new();
        for _ in 0..CONNS {
            // One exchange each, so every driver has had activity (and a spin budget).
            kept.push(common::open_pair(&verbs, &mut listener, addr).await);
        }
        // Every budget (10 ms by default) has run out well before the window starts.
        tokio::time::sleep(VerbsConfig::default().poll_spin * 50).await;
        let window = Duration::from_secs(10);
        let (cpu0, threads0) = (cpu_time(), thread_activity());
        tokio::time::sleep(window).await;
        let used = cpu_time() - cpu0;
        // What woke: context switches and CPU ticks per thread over the window. The test's
        // own thread (it sleeps once and reads /proc), the rdma_cm thread and the device's
        // completion-event pump (a check per second each, whatever the number of connections)
        // are not the connections' doing.
        let me = std::fs::read_link("/proc/thread-self")
            .ok()
            .and_then(|p| p.file_name()?.to_str()?.parse::<u32>().ok());
        let mut wakeups = 0;
        for (tid, (name, switches, ticks)) in thread_activity() {
            let (s0, t0) = threads0.get(&tid).map_or((0, 0), |t| (t.1, t.2));
            let (woke, ticks) = (switches.saturating_sub(s0), ticks.saturating_sub(t0));
            if woke > 0 || ticks > 0 {
                eprintln!("  thread {tid} {name}: {woke} wake-ups, {ticks} CPU ticks");
            }
            if Some(tid) != me && name != "verbs-rdma-cm" && !name.starts_with("verbs-cq-") {
                wakeups += woke;
            }
        }
        let share = used.as_secs_f64() / window.as_secs_f64();
        eprintln!(
            "{} idle connections (both ends in this process): CPU {:?} in {window:?} ({:.2}%), \
             {wakeups} wake-ups of the runtime's threads",
            2 * CONNS,
            used,
            share * 100.0
        );
        // Idle connections wake nothing: no timer, no poll. A stale timer per connection (a
        // hello deadline left armed) would wake the runtime about once per pair; a spinning
        // driver wakes it without end.
        assert!(
            (wakeups as usize) < CONNS,
            "{wakeups} wake-ups of the runtime's threads in {window:?} with {CONNS} idle pairs"
        );
        // CPU time under the emulated guest is coarse and moves with the host's load (0.5%
        // quiet, up to 3% with builds running beside it); a spinning driver costs 50-100%.
        assert!(
            share < 0.05,
            "idle connections used {:.1}% of a CPU",
            share * 100.0
        );
        drop(kept);
    });
}

/// Event mode (`poll_spin` 0): `rounds` calls on each of `conns.len()` connections at once,
/// every reply checked to be its own connection's.
async fn calls_on_all(
    conns: &mut Vec<(transport_verbs::VerbsSender, transport_verbs::VerbsReceiver)>,
    rounds: usize,
) {
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (mut tx, mut rx)) in conns.drain(..).enumerate() {
        tasks.spawn(async move {
            for r in 0..rounds {
                let body = Bytes::from(format!("connection {i} call {r}"));
                tx.send(Message::new(HeaderBytes::EMPTY, body.clone()))
                    .await
                    .unwrap_or_else(|e| panic!("connection {i} send {r}: {e}"));
                let m = rx.recv().await.expect("recv").expect("open");
                assert_eq!(m.payload, body, "connection {i} got another's reply");
            }
            (i, tx, rx)
        });
    }
    let mut back = Vec::new();
    while let Some(t) = tasks.join_next().await {
        back.push(t.expect("caller task"));
    }
    back.sort_by_key(|(i, _, _)| *i);
    conns.extend(back.into_iter().map(|(_, tx, rx)| (tx, rx)));
}

/// Echoes every message back until the stream ends.
fn echo(mut server: (transport_verbs::VerbsSender, transport_verbs::VerbsReceiver)) {
    tokio::spawn(async move {
        while let Ok(Some(m)) = server.1.recv().await {
            if server.0.send(m).await.is_err() {
                break;
            }
        }
    });
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn each_connection_is_woken_by_its_own_completion_events() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    const CONNS: usize = 16;
    const ROUNDS: usize = 30;
    common::run(async move {
        let mut config = VerbsConfig::default();
        config.poll_spin = Duration::ZERO;
        let verbs = VerbsTransport::new(config).expect("transport");
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut conns = Vec::new();
        let mut metrics = Vec::new();
        for _ in 0..CONNS {
            let conn = verbs.connect(&addr).await.expect("connect");
            echo(listener.accept().await.expect("accept").split());
            metrics.push(conn.metrics());
            conns.push(conn.split());
        }
        let before: Vec<_> = metrics.iter().map(|m| m.snapshot()).collect();
        // Every wait sleeps on the CQ: each reply reaches its caller only if the pump routes
        // its CQ's event to that connection's driver (a lost or misrouted event hangs a
        // caller until the test's time limit).
        calls_on_all(&mut conns, ROUNDS).await;
        for (i, (m, b)) in metrics.iter().zip(before).enumerate() {
            let d = m.snapshot() - b;
            // Each wait for a reply arms the CQ, and its event is read by the pump and counted
            // to this connection: at least one system call per call.
            assert!(
                d.syscalls >= ROUNDS as u64,
                "connection {i}: {} completion-channel system calls in {ROUNDS} calls",
                d.syscalls
            );
        }
    });
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn connections_keep_their_events_after_the_runtime_that_made_the_device_ready_ends() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    let mut config = VerbsConfig::default();
    config.poll_spin = Duration::ZERO;
    let verbs = VerbsTransport::new(config).expect("transport");
    // The first connection on the device (which sets up its domain and completion channel)
    // lives on a runtime of its own, which then ends with it.
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let v = verbs.clone();
    first.block_on(async move {
        tokio::time::timeout(Duration::from_secs(60), async move {
            let mut listener = v.listen(&addr).await.expect("listen");
            let addr = listener.local_addr().expect("addr");
            let conn = v.connect(&addr).await.expect("connect");
            echo(listener.accept().await.expect("accept").split());
            let mut conns = vec![conn.split()];
            calls_on_all(&mut conns, 3).await;
        })
        .await
        .expect("first runtime's calls hung");
    });
    first.shutdown_timeout(Duration::from_secs(2));
    // Connections made afterwards on another runtime still get their completion events.
    common::run(async move {
        let mut listener = verbs.listen(&addr).await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut conns = Vec::new();
        for _ in 0..4 {
            let conn = verbs.connect(&addr).await.expect("connect");
            echo(listener.accept().await.expect("accept").split());
            conns.push(conn.split());
        }
        calls_on_all(&mut conns, 20).await;
    });
}

/// `CONNS` connections on one runtime (current-thread, or `workers` worker threads) make
/// `ROUNDS` echo round trips each at once (each payload names its connection and round, and
/// comes back unchanged), with `poll_together_from` = `from`. Returns how often a thread's
/// poller took completions.
fn echo_on_one_runtime(addr: std::net::SocketAddr, from: usize, workers: usize) -> u64 {
    const CONNS: usize = 6;
    const ROUNDS: u32 = 40;
    let rt = if workers == 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
    }
    .expect("runtime");
    rt.block_on(async move {
        tokio::time::timeout(Duration::from_secs(120), async move {
            let mut config = VerbsConfig::default();
            config.poll_spin = Duration::from_secs(30);
            config.poll_together_from = from;
            let verbs = VerbsTransport::new(config).expect("transport");
            let mut listener = verbs.listen(&addr).await.expect("listen");
            let addr = listener.local_addr().expect("addr");
            let before = transport_verbs::polled_together();
            let mut tasks = tokio::task::JoinSet::new();
            for c in 0..CONNS {
                let conn = verbs.connect(&addr).await.expect("connect");
                let server = listener.accept().await.expect("accept");
                echo_back(server);
                tasks.spawn(async move {
                    let (mut tx, mut rx) = conn.split();
                    for round in 0..ROUNDS {
                        let tag = format!("connection {c} round {round}");
                        let body = Bytes::from(tag.clone().into_bytes());
                        tx.send(Message::new(HeaderBytes::EMPTY, body))
                            .await
                            .expect("send");
                        let m = rx.recv().await.expect("recv").expect("open");
                        assert_eq!(&m.payload[..], tag.as_bytes(), "reply on connection {c}");
                    }
                    tx.close().await.expect("close");
                    ROUNDS
                });
            }
            let mut done = 0;
            while let Some(r) = tasks.join_next().await {
                assert_eq!(r.expect("client task"), ROUNDS);
                done += 1;
            }
            assert_eq!(done, CONNS);
            transport_verbs::polled_together() - before
        })
        .await
        .expect("test hung")
    })
}

/// Many receivers waiting on one thread are polled together by the thread's poller, and each
/// still gets exactly its own replies; below the threshold (here: never) no poller runs.
#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn receivers_waiting_on_one_thread_are_polled_together() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    let together = echo_on_one_runtime(addr, 2, 0);
    let apart = echo_on_one_runtime(addr, usize::MAX, 0);
    eprintln!("poller deliveries: {together} with poll_together_from 2, {apart} with usize::MAX");
    assert!(together > 0, "no receiver was polled together");
    assert_eq!(
        apart, 0,
        "a poller ran although the threshold was never reached"
    );
}

/// On a multi-thread runtime, where tasks move between workers and each worker thread has its
/// own poller, every connection still gets exactly its own replies when all wait together.
#[test]
#[ignore = "needs an RDMA device: cargo xtask testbed verbs runs it"]
fn receivers_polled_together_on_a_multi_thread_runtime_each_get_their_replies() {
    let _alone = one_at_a_time();
    let addr = common::listen_addr();
    let together = echo_on_one_runtime(addr, 0, 2);
    eprintln!("poller deliveries on two workers with poll_together_from 0: {together}");
    assert!(together > 0, "no receiver was polled together");
}
