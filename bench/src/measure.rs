//! One measurement: `threads` client threads, each with its own connection and its own
//! single-threaded runtime, running one operation raw or through RPC.

use crate::proto::{self, method, Presplit, ServerCounters};
use crate::sys;
use bytes::Bytes;
use futures_util::stream::StreamExt;
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use transport_core::{
    Connection, HeaderBytes, Message, MessageReceiver, MessageSender, MetricsSnapshot, Transport,
};
use transport_rpc::blocking::{BlockingClient, BlockingConfig, BlockingSocket};
use transport_rpc::{ClientConfig, RpcClient};

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Latency: 1-byte raw ping-pong vs `void o()` RPC.
    Ping,
    /// Byte sequence to the server (raw: a stream into a sink; RPC: twoway calls).
    Send,
    /// Byte sequence to the server (raw: a stream into a sink; RPC: oneway calls).
    Oneway,
    /// Byte sequence from the server (raw: a stream from a source; RPC: returned by a call).
    Recv,
    /// Byte sequence there and back (raw: an echo stream; RPC: echo calls).
    Echo,
}

impl Op {
    /// Name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Op::Ping => "ping",
            Op::Send => "send",
            Op::Oneway => "oneway",
            Op::Recv => "recv",
            Op::Echo => "echo",
        }
    }
}

/// Where a server of plain `std` sockets listens (or should listen): the OS baseline's
/// (`os::Target`) and the blocking RPC server's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketTarget {
    /// A Unix-domain stream socket at this path.
    Uds(std::path::PathBuf),
    /// A TCP address (`TCP_NODELAY` on both ends).
    Tcp(std::net::SocketAddr),
}

/// How the RPC rows are measured.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum RpcIo {
    /// `RpcClient` and `RpcServer` on tokio (pipelined calls, the window applies).
    #[default]
    Async,
    /// `transport_rpc::blocking`: the client blocks in `recv`, one call at a time; a
    /// thread per connection on the server (uds and tcp in local mode).
    Blocking,
}

/// What the raw rows of the twoway ops (send, recv, echo) measure (`--raw-twoway`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum RawTwoway {
    /// Message streams, the most the connection can deliver: send into a sink, recv from a
    /// source (one request for the whole run), echo as a stream echoed back.
    #[default]
    Stream,
    /// The two messages an RPC call makes, on the raw connection, with as many in flight as
    /// the cell's RPC window: send answered by an empty message each, recv asked for by a
    /// small request each, echo one message back for each sent. RPC / this is the cost of
    /// the RPC layer alone; RPC / stream also counts the second message of every call.
    Exchange,
}

/// The bench server a measurement runs against.
pub struct Peer<'a, T: Transport> {
    /// The transport to reach it with.
    pub transport: &'a T,
    /// Where it listens.
    pub addr: &'a T::Addr,
    /// Its connection counters when it runs in this process (local mode): their difference
    /// over a measurement is the server's side of it. `None` when it runs elsewhere.
    pub counters: Option<&'a ServerCounters>,
    /// With `--rpc-io blocking`: the blocking RPC server the RPC rows go to instead.
    pub blocking: Option<&'a SocketTarget>,
    /// How long the client threads poll their waiting sockets before they sleep
    /// (`--spin-us`; zero: never).
    pub spin: Duration,
}

/// Raw backend connection or RPC over it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layer {
    /// The backend's `Connection`, no RPC.
    Raw,
    /// `RpcClient` over the same backend.
    Rpc,
}

/// One measurement to run.
#[derive(Debug, Clone, Copy)]
pub struct Job {
    /// Operation.
    pub op: Op,
    /// Raw or RPC.
    pub layer: Layer,
    /// Payload bytes per message or call (ping: 1 raw, 0 RPC).
    pub size: usize,
    /// Messages or calls in all (split between the threads).
    pub count: u64,
    /// Client threads, each with its own connection.
    pub threads: usize,
    /// RPC calls in flight per thread.
    pub window: usize,
    /// CPU each client thread is pinned to.
    pub client_core: Option<usize>,
    /// Payloads in heap memory instead of the transport's buffer pool.
    pub heap_payload: bool,
    /// What the raw rows of send, recv and echo measure.
    pub raw_twoway: RawTwoway,
}

/// What one measurement saw.
#[derive(Debug)]
pub struct Outcome {
    /// From the first thread's start to the last thread's end.
    pub elapsed: Duration,
    /// Calls or messages completed.
    pub calls: u64,
    /// Payload bytes moved (echo counts one direction: the sequence size per call).
    pub payload_bytes: u64,
    /// Round-trip times (ping only), in nanoseconds.
    pub latency: Option<Histogram<u64>>,
    /// Client-side connection counters over the measurement (all threads).
    pub metrics: MetricsSnapshot,
    /// The in-process bench server's counters over the measurement (local mode, from
    /// [`Peer::counters`]; zero when the server is another process).
    pub server_metrics: MetricsSnapshot,
    /// CPU time (user + system) of this process over the measurement.
    pub cpu: Duration,
    /// Minor page faults of this process over the measurement (fresh memory being touched).
    pub page_faults: u64,
    /// Context switches of this process over the measurement (threads blocking and waking).
    pub context_switches: u64,
}

impl Outcome {
    /// Payload throughput in Mbit/s.
    pub fn mbit_s(&self) -> f64 {
        self.payload_bytes as f64 * 8.0 / self.elapsed.as_secs_f64() / 1e6
    }
    /// Calls (or messages) per second.
    pub fn calls_s(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct ThreadResult {
    start: Instant,
    end: Instant,
    /// The process's resource usage when this thread's measured work ended (before it
    /// closed its connection and its runtime went down, which are not the job's cost).
    usage_at_end: sys::Usage,
    calls: u64,
    bytes: u64,
    hist: Option<Histogram<u64>>,
    metrics: MetricsSnapshot,
}

/// Runs `job` against the bench server `peer`.
pub fn run<T>(peer: &Peer<'_, T>, job: Job) -> Result<Outcome, String>
where
    T: Transport + Clone,
{
    let server_totals = || {
        peer.counters
            .map(ServerCounters::totals)
            .unwrap_or_default()
    };
    let threads = job.threads.max(1);
    let barrier = Arc::new(Barrier::new(threads + 1));
    let mut handles = Vec::with_capacity(threads);
    for i in 0..threads {
        let share = job.count / threads as u64 + u64::from((i as u64) < job.count % threads as u64);
        let transport = peer.transport.clone();
        let addr = peer.addr.clone();
        let barrier = barrier.clone();
        let blocking = peer.blocking.filter(|_| job.layer == Layer::Rpc).cloned();
        let spin = peer.spin;
        handles.push(std::thread::spawn(
            move || -> Result<ThreadResult, String> {
                if let Some(core) = job.client_core {
                    sys::pin_current_thread(core)?;
                }
                if let Some(target) = blocking {
                    return blocking_client_thread(&target, job, share, spin, &barrier)
                        .map_err(|e| format!("{} blocking: {e}", job_name(&job)));
                }
                let rt = sys::runtime(spin).map_err(|e| e.to_string())?;
                let name = transport.capabilities().name;
                // The client runs as a spawned task, not as the `block_on` future itself: a
                // wake of the `block_on` future from another task (the RPC client's response
                // reader) costs an eventfd write and an extra epoll_wait per call, which a
                // spawned task's wake does not (and which no tokio application that spawns
                // its work pays).
                let client = rt.spawn(async move {
                    client_thread(&transport, &addr, job, share, &barrier)
                        .await
                        .map_err(|e| e.to_string())
                });
                rt.block_on(client)
                    .map_err(|e| format!("client task failed: {e}"))
                    .and_then(|r| r)
                    .map_err(|e| format!("{} {name}: {e}", job_name(&job)))
            },
        ));
    }
    barrier.wait();
    let before = sys::usage();
    let server_before = server_totals();
    let mut results = Vec::with_capacity(threads);
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(r)) => results.push(r),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert_with(|| "a client thread panicked".to_string());
            }
        }
    }
    let server_metrics = server_totals() - server_before;
    if let Some(e) = first_err {
        return Err(e);
    }
    // CPU, faults and switches up to the end of the last thread's measured work: closing the
    // connections and dropping the runtimes afterwards (freeing pools, joining tasks) is not
    // the job's cost, and the elapsed time the figures are divided by excludes it
    // (docs/notes/2026-12-02-bench-rusage-of-the-measured-work.md).
    let used = results
        .iter()
        .max_by_key(|r| r.end)
        .expect("threads >= 1")
        .usage_at_end
        - before;
    let start = results.iter().map(|r| r.start).min().expect("threads >= 1");
    let end = results.iter().map(|r| r.end).max().expect("threads >= 1");
    let mut metrics = MetricsSnapshot::default();
    let mut latency: Option<Histogram<u64>> = None;
    let (mut calls, mut bytes) = (0, 0);
    for r in results {
        metrics.accumulate(&r.metrics);
        calls += r.calls;
        bytes += r.bytes;
        if let Some(h) = r.hist {
            match &mut latency {
                Some(all) => all.add(&h).map_err(|e| e.to_string())?,
                None => latency = Some(h),
            }
        }
    }
    Ok(Outcome {
        elapsed: end
            .saturating_duration_since(start)
            .max(Duration::from_nanos(1)),
        calls,
        payload_bytes: bytes,
        latency,
        metrics,
        server_metrics,
        cpu: used.cpu,
        page_faults: used.minor_faults,
        context_switches: used.context_switches,
    })
}

fn job_name(job: &Job) -> String {
    format!(
        "{} {:?} {} B x{}",
        job.op.name(),
        job.layer,
        job.size,
        job.threads
    )
}

/// Warm-up operations before the clock starts (connection set up, buffers grown, caches hot).
const WARMUP: u64 = 20;

/// Waits at the start barrier exactly once, also when the thread fails before reaching it
/// (otherwise the other threads and the coordinator would wait forever).
struct Start<'a> {
    barrier: &'a Barrier,
    passed: bool,
}

impl<'a> Start<'a> {
    fn new(barrier: &'a Barrier) -> Start<'a> {
        Start {
            barrier,
            passed: false,
        }
    }

    fn wait(&mut self) {
        if !self.passed {
            self.passed = true;
            self.barrier.wait();
        }
    }
}

impl Drop for Start<'_> {
    fn drop(&mut self) {
        self.wait();
    }
}

async fn client_thread<T: Transport>(
    transport: &T,
    addr: &T::Addr,
    job: Job,
    count: u64,
    barrier: &Barrier,
) -> Result<ThreadResult, BoxError> {
    let mut barrier = Start::new(barrier);
    let conn = transport.connect(addr).await?;
    let metrics = conn.metrics();
    let caps = conn.capabilities();
    let peer = conn.peer();
    let (mut tx, mut rx) = conn.split();
    let pool = if job.heap_payload {
        Arc::new(transport_core::HeapPool)
    } else {
        tx.buffer_pool()
    };
    let payload = payload_in(&*pool, job.size);
    let mode = match (job.layer, job.op) {
        (Layer::Rpc, _) => proto::MODE_RPC,
        (Layer::Raw, Op::Ping | Op::Echo) => proto::MODE_ECHO,
        (Layer::Raw, Op::Send) if job.raw_twoway == RawTwoway::Exchange => proto::MODE_ACKED,
        (Layer::Raw, Op::Send | Op::Oneway) => proto::MODE_SINK,
        (Layer::Raw, Op::Recv) => proto::MODE_SOURCE,
    };
    proto::send_mode(&mut tx, mode).await?;
    let r = match job.layer {
        Layer::Raw => {
            raw_op(&mut tx, &mut rx, job, &payload, WARMUP).await?;
            barrier.wait();
            let m0 = metrics.snapshot();
            let start = Instant::now();
            let (bytes, hist) = raw_op(&mut tx, &mut rx, job, &payload, count).await?;
            let end = Instant::now();
            let usage_at_end = sys::usage();
            let _ = tx.close().await;
            ThreadResult {
                start,
                end,
                usage_at_end,
                calls: count,
                bytes,
                hist,
                metrics: metrics.snapshot() - m0,
            }
        }
        Layer::Rpc => {
            let conn = Presplit::new(tx, rx, caps, metrics.clone(), peer);
            let client = RpcClient::new(
                conn,
                ClientConfig::default()
                    .with_max_in_flight(job.window.max(1))
                    .with_default_deadline(None),
            );
            rpc_op(&client, job, &payload, WARMUP).await?;
            barrier.wait();
            let m0 = metrics.snapshot();
            let start = Instant::now();
            let (bytes, hist) = rpc_op(&client, job, &payload, count).await?;
            let end = Instant::now();
            let usage_at_end = sys::usage();
            let snap = metrics.snapshot() - m0;
            let _ = client.close().await;
            ThreadResult {
                start,
                end,
                usage_at_end,
                calls: count,
                bytes,
                hist,
                metrics: snap,
            }
        }
    };
    Ok(r)
}

pub(crate) fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds")
}

pub(crate) fn record(h: &mut Histogram<u64>, d: Duration) {
    let _ = h.record(d.as_nanos().clamp(1, 60_000_000_000) as u64);
}

/// The payload every call and message of a measurement carries: `size` bytes in the
/// transport's own buffer pool, as an application after speed allocates it (`BufferPool::alloc`,
/// `RpcClient::alloc`): registered memory on verbs, which sends it without a copy (eager) or a
/// registration (rendezvous), as perftest sends from its registered buffer; heap memory on the
/// socket backends.
fn payload_in(pool: &dyn transport_core::BufferPool, size: usize) -> Bytes {
    let mut buf = pool.alloc(size);
    match buf.fill(size) {
        Some(b) => b.fill(0xa5),
        // The pool cannot serve this size: heap memory, as without a pool.
        None => return payload_in(&transport_core::HeapPool, size),
    }
    buf.freeze()
}

fn data(payload: &Bytes) -> Message {
    Message::new(HeaderBytes::EMPTY, payload.clone())
}

async fn recv_one<R: MessageReceiver>(rx: &mut R) -> Result<Message, BoxError> {
    rx.recv()
        .await?
        .ok_or_else(|| "server closed the connection".into())
}

/// Runs `count` raw operations; returns payload bytes moved and, for pings, the latencies.
async fn raw_op<S: MessageSender, R: MessageReceiver>(
    tx: &mut S,
    rx: &mut R,
    job: Job,
    payload: &Bytes,
    count: u64,
) -> Result<(u64, Option<Histogram<u64>>), BoxError> {
    match job.op {
        Op::Ping => {
            let one = Bytes::from_static(b"p");
            let mut h = new_hist();
            for _ in 0..count {
                let t = Instant::now();
                tx.send(data(&one)).await?;
                // `recv` itself, not `recv_one`: a frame of the harness's own would count
                // in every round trip (`cargo xtask profile`).
                let echo = rx.recv().await?;
                record(&mut h, t.elapsed());
                if echo.is_none_or(|m| m.payload.len() != 1) {
                    return Err("raw ping: wrong echo or the server closed".into());
                }
            }
            // A latency test: its byte is not counted as payload moved.
            Ok((0, Some(h)))
        }
        Op::Send | Op::Recv | Op::Echo if job.raw_twoway == RawTwoway::Exchange => {
            // What goes out per exchange, and how many bytes its answer carries: send is
            // answered by an empty message, echo by its own bytes, a `src` request for one
            // message by that message.
            let (out, want) = match job.op {
                Op::Recv => {
                    let size =
                        u32::try_from(job.size).map_err(|_| "raw source: size above 4 GiB")?;
                    (
                        source_request(proto::SourceRequest { size, count: 1 }),
                        job.size,
                    )
                }
                Op::Send => (data(payload), 0),
                _ => (data(payload), payload.len()),
            };
            let bytes = raw_exchange(
                tx,
                rx,
                count,
                job.window,
                || out.clone(),
                |answer| {
                    let got = from_source(answer)?;
                    if got == want as u64 {
                        Ok(job.size as u64)
                    } else {
                        Err(
                            format!("raw exchange: an answer of {got} bytes where {want} were due")
                                .into(),
                        )
                    }
                },
            )
            .await?;
            Ok((bytes, None))
        }
        Op::Send | Op::Oneway => {
            for _ in 0..count {
                tx.send(data(payload)).await?;
            }
            tx.send(Message::new(HeaderBytes::from(*b"end"), Bytes::new()))
                .await?;
            let ack = recv_one(rx).await?;
            let got = <[u8; 8]>::try_from(&ack.payload[..])
                .map(u64::from_le_bytes)
                .map_err(|_| "raw sink: bad ack")?;
            let want = count * job.size as u64;
            if ack.header.as_slice() != proto::SINK_ACK || got != want {
                return Err(format!("raw sink: server got {got} of {want} bytes").into());
            }
            Ok((want, None))
        }
        Op::Recv => {
            let size = u32::try_from(job.size).map_err(|_| "raw source: size above 4 GiB")?;
            let mut bytes = 0;
            // One request per MAX_SOURCE_BYTES at most (the server's limit): one round trip
            // per 64 GiB at worst.
            for req in proto::SourceRequest::split(size, count) {
                let messages = req.count;
                tx.send(source_request(req)).await?;
                for _ in 0..messages {
                    bytes += from_source(&recv_one(rx).await?)?;
                }
            }
            Ok((bytes, None))
        }
        Op::Echo => {
            let send = async {
                for _ in 0..count {
                    tx.send(data(payload)).await?;
                }
                Ok::<_, BoxError>(())
            };
            let recv = async {
                let mut bytes = 0;
                for _ in 0..count {
                    bytes += recv_one(rx).await?.payload.len() as u64;
                }
                Ok::<_, BoxError>(bytes)
            };
            let (s, r) = tokio::join!(send, recv);
            s?;
            Ok((r?, None))
        }
    }
}

/// A `src` request to the bench source.
fn source_request(req: proto::SourceRequest) -> Message {
    Message::new(
        HeaderBytes::new(proto::SOURCE_REQ).expect("short"),
        req.encode(),
    )
}

/// The payload bytes a message carries, or, if it is the source's refusal, its reason as
/// the error (only the source refuses; the acked and echo modes never do).
fn from_source(m: &Message) -> Result<u64, BoxError> {
    if m.header.as_slice() == proto::SOURCE_ERR {
        let why = String::from_utf8_lossy(&m.payload);
        return Err(format!("raw source: the server refused: {why}").into());
    }
    Ok(m.payload.len() as u64)
}

/// `count` exchanges on the raw connection, as RPC calls make them (`--raw-twoway
/// exchange`): messages from `next` go out while fewer than `window` wait for their answer;
/// `answered` checks each answer and says how many payload bytes it stands for. Sending and
/// receiving run side by side (as the RPC client reads while a write waits), so a window of
/// large echoes cannot leave both ends blocked in a write. Returns the payload bytes moved.
async fn raw_exchange<S: MessageSender, R: MessageReceiver>(
    tx: &mut S,
    rx: &mut R,
    count: u64,
    window: usize,
    next: impl Fn() -> Message,
    mut answered: impl FnMut(&Message) -> Result<u64, BoxError>,
) -> Result<u64, BoxError> {
    let window = window.max(1) as u64;
    let done = std::sync::atomic::AtomicU64::new(0);
    let room = tokio::sync::Notify::new();
    let send = async {
        for sent in 0..count {
            while sent - done.load(std::sync::atomic::Ordering::Acquire) >= window {
                room.notified().await;
            }
            tx.send(next()).await?;
        }
        Ok::<_, BoxError>(())
    };
    let recv = async {
        let mut bytes = 0;
        for _ in 0..count {
            let answer = recv_one(rx).await;
            // A failed read ends the sender's wait too (its send then fails or the join ends).
            done.fetch_add(1, std::sync::atomic::Ordering::Release);
            room.notify_one();
            bytes += answered(&answer?)?;
        }
        Ok::<_, BoxError>(bytes)
    };
    let (s, r) = tokio::join!(send, recv);
    let bytes = r?;
    s?;
    Ok(bytes)
}

/// A client thread of `--rpc-io blocking`: no runtime, one call at a time.
fn blocking_client_thread(
    target: &SocketTarget,
    job: Job,
    count: u64,
    spin: Duration,
    barrier: &Barrier,
) -> Result<ThreadResult, BoxError> {
    let mut barrier = Start::new(barrier);
    let config = BlockingConfig::default()
        .with_max_message_size(proto::MAX_PAYLOAD + 64)
        .with_spin(spin);
    match target {
        SocketTarget::Uds(p) => {
            let s = std::os::unix::net::UnixStream::connect(p)?;
            blocking_run(BlockingClient::new(s, config)?, job, count, &mut barrier)
        }
        SocketTarget::Tcp(a) => {
            let s = std::net::TcpStream::connect(a)?;
            blocking_run(BlockingClient::new(s, config)?, job, count, &mut barrier)
        }
    }
}

fn blocking_run<S: BlockingSocket>(
    mut client: BlockingClient<S>,
    job: Job,
    count: u64,
    barrier: &mut Start<'_>,
) -> Result<ThreadResult, BoxError> {
    let payload = vec![0xa5u8; job.size];
    blocking_op(&mut client, job, &payload, WARMUP)?;
    barrier.wait();
    let m0 = client.metrics().snapshot();
    let start = Instant::now();
    let (bytes, hist) = blocking_op(&mut client, job, &payload, count)?;
    let end = Instant::now();
    Ok(ThreadResult {
        start,
        end,
        usage_at_end: sys::usage(),
        calls: count,
        bytes,
        hist,
        metrics: client.metrics().snapshot() - m0,
    })
}

fn blocking_op<S: BlockingSocket>(
    client: &mut BlockingClient<S>,
    job: Job,
    payload: &[u8],
    count: u64,
) -> Result<(u64, Option<Histogram<u64>>), BoxError> {
    match job.op {
        Op::Ping => {
            let mut h = new_hist();
            for _ in 0..count {
                let t = Instant::now();
                client.call(method::PING, &[])?;
                record(&mut h, t.elapsed());
            }
            Ok((0, Some(h)))
        }
        Op::Oneway => {
            for _ in 0..count {
                client.oneway(method::ONEWAY, payload)?;
            }
            // Ordered connection: the answer to this call means every oneway was read.
            client.call(method::PING, &[])?;
            Ok((count * job.size as u64, None))
        }
        Op::Send | Op::Recv | Op::Echo => {
            let size = (job.size as u32).to_le_bytes();
            let (m, arg, want) = match job.op {
                Op::Send => (method::SEND, payload, 0),
                Op::Echo => (method::ECHO, payload, job.size),
                _ => (method::RECV, &size[..], job.size),
            };
            for _ in 0..count {
                let reply = client.call(m, arg)?;
                if reply.len() != want {
                    return Err(
                        format!("rpc {}: reply of {} bytes", job.op.name(), reply.len()).into(),
                    );
                }
            }
            Ok((count * job.size as u64, None))
        }
    }
}

/// Runs `count` RPC calls with up to `job.window` in flight.
async fn rpc_op<S: MessageSender>(
    client: &RpcClient<S>,
    job: Job,
    payload: &Bytes,
    count: u64,
) -> Result<(u64, Option<Histogram<u64>>), BoxError> {
    match job.op {
        Op::Ping => {
            let mut h = new_hist();
            for _ in 0..count {
                let t = Instant::now();
                client.call(method::PING, Bytes::new()).await?;
                record(&mut h, t.elapsed());
            }
            Ok((0, Some(h)))
        }
        Op::Oneway => {
            for _ in 0..count {
                client.oneway(method::ONEWAY, payload.clone()).await?;
            }
            // Ordered connection: the answer to this call means every oneway was read.
            client.call(method::PING, Bytes::new()).await?;
            Ok((count * job.size as u64, None))
        }
        Op::Send | Op::Recv | Op::Echo => {
            let (m, arg) = match job.op {
                Op::Send => (method::SEND, payload.clone()),
                Op::Echo => (method::ECHO, payload.clone()),
                _ => (
                    method::RECV,
                    Bytes::copy_from_slice(&(job.size as u32).to_le_bytes()),
                ),
            };
            let want = if job.op == Op::Send { 0 } else { job.size };
            // `window` callers, each making its calls one after the other (an ORB's client
            // threads): a caller's call lives inside it, with no allocation and no move of
            // the call's future per call (`buffer_unordered` makes both).
            let issued = std::sync::atomic::AtomicU64::new(0);
            let caller = || async {
                loop {
                    if issued.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= count {
                        return Ok::<(), BoxError>(());
                    }
                    let reply = client.call(m, arg.clone()).await?;
                    if reply.len() != want {
                        return Err(format!(
                            "rpc {}: reply of {} bytes",
                            job.op.name(),
                            reply.len()
                        )
                        .into());
                    }
                }
            };
            let mut callers: futures_util::stream::FuturesUnordered<_> =
                (0..job.window.max(1)).map(|_| caller()).collect();
            while let Some(r) = callers.next().await {
                r?;
            }
            Ok((count * job.size as u64, None))
        }
    }
}

/// Per-call (per-message) figures derived from a measurement's counters.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct CostFigures {
    /// Payload bytes copied in user space per payload byte moved, by the client and (in
    /// local mode) the server.
    pub copies_per_byte: f64,
    /// System calls (or doorbells) per call / message, client side.
    pub syscalls_per_call: f64,
    /// Memory registrations per call.
    pub registrations_per_call: f64,
    /// Mean RPC calls in flight when a call started (raw: 0).
    pub mean_in_flight: f64,
    /// CPU milliseconds (whole process: client and, in local mode, server) per GB of payload.
    pub cpu_ms_per_gb: f64,
    /// CPU microseconds per call.
    pub cpu_us_per_call: f64,
    /// Minor page faults (whole process) per call: buffers allocated fresh instead of reused.
    pub page_faults_per_call: f64,
    /// Context switches (whole process) per call: every one is a thread going to sleep on a
    /// socket or completion and being woken again.
    pub context_switches_per_call: f64,
    /// Received messages handed from one task to the waiting one, per call, client and (in
    /// local mode) server (`Metrics::handoffs`: verbs replies the connection's driver took from
    /// the device while the receiver was not polling it itself, and RPC replies one waiting
    /// call read for another).
    #[serde(default)]
    pub handoffs_per_call: f64,
}

impl CostFigures {
    /// Derives the figures from an outcome.
    pub fn of(o: &Outcome) -> CostFigures {
        let calls = o.calls.max(1) as f64;
        let m = &o.metrics;
        CostFigures {
            copies_per_byte: if o.payload_bytes == 0 {
                0.0
            } else {
                (m.payload_bytes_copied + o.server_metrics.payload_bytes_copied) as f64
                    / o.payload_bytes as f64
            },
            syscalls_per_call: (m.syscalls + m.doorbells) as f64 / calls,
            registrations_per_call: m.registrations as f64 / calls,
            mean_in_flight: m.mean_in_flight(),
            cpu_ms_per_gb: if o.payload_bytes == 0 {
                0.0
            } else {
                o.cpu.as_secs_f64() * 1e3 / (o.payload_bytes as f64 / 1e9)
            },
            cpu_us_per_call: o.cpu.as_secs_f64() * 1e6 / calls,
            page_faults_per_call: o.page_faults as f64 / calls,
            context_switches_per_call: o.context_switches as f64 / calls,
            handoffs_per_call: (m.handoffs + o.server_metrics.handoffs) as f64 / calls,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool whose buffers hold fewer bytes than asked (as a backend pool serving a size class
    /// below the request would): the payload falls back to heap memory of the full size.
    struct Small;
    impl transport_core::BufferPool for Small {
        fn alloc(&self, _capacity: usize) -> transport_core::SendBuffer {
            struct Region(Vec<u8>);
            impl transport_core::BackendRegion for Region {
                fn as_slice(&self) -> &[u8] {
                    &self.0
                }
                fn as_mut_slice(&mut self) -> &mut [u8] {
                    &mut self.0
                }
            }
            transport_core::SendBuffer::from_region(Box::new(Region(vec![0; 8])))
        }
    }

    #[test]
    fn payloads_have_the_size_asked_for_from_the_pool_or_the_heap() {
        let p = payload_in(&transport_core::HeapPool, 1000);
        assert_eq!(p.len(), 1000);
        assert!(p.iter().all(|&b| b == 0xa5));
        let p = payload_in(&Small, 1000);
        assert_eq!(p.len(), 1000);
        assert!(p.iter().all(|&b| b == 0xa5));
    }
}
