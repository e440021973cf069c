//! A whole comparison on one transport: pings, then every (threads, size, op) cell, the OS
//! baseline (when there is one), raw and RPC interleaved, repeated; then the statistics.

use crate::measure::{self, CostFigures, Job, Layer, Op, Outcome, Peer};
use crate::os;
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use transport_core::Transport;

/// What to measure.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Settings {
    /// Payload sizes in bytes.
    pub sizes: Vec<usize>,
    /// Client thread counts.
    pub threads: Vec<usize>,
    /// Byte-sequence operations.
    pub ops: Vec<Op>,
    /// The layers measured: raw and RPC, or RPC alone (`--only rpc`: no raw connection and
    /// no os baseline, whose figures are then null).
    pub layers: Vec<Layer>,
    /// Whether the latency row (raw ping-pong vs `void o()`) is measured (`--ops` has `ping`,
    /// or no `--ops`).
    pub ping: bool,
    /// Round trips for the latency row (raw and RPC each), split over the repetitions.
    pub pings: u64,
    /// Repetitions of every measurement.
    pub repeat: usize,
    /// Payload bytes per throughput measurement (bounded by `min_calls` / `max_calls`).
    pub bytes_per_run: u64,
    /// Fewest calls per throughput measurement.
    pub min_calls: u64,
    /// Most calls per throughput measurement.
    pub max_calls: u64,
    /// RPC calls in flight per client thread.
    pub window: usize,
    /// Most payload bytes in flight per client thread (caps `window` for large sizes).
    pub window_bytes: usize,
    /// The same on verbs ([`Settings::for_verbs`]).
    #[serde(default = "default_verbs_window_bytes")]
    pub verbs_window_bytes: usize,
    /// Whether an echo call counts its payload twice against `window_bytes` (its request and
    /// its reply are both in flight): on uds and tcp, where the window keeps the calls' bytes
    /// within the CPU cache. Not on verbs ([`Settings::for_verbs`]), whose window keeps each
    /// direction's rendezvous busy. A report without this field counts echo once.
    #[serde(default)]
    pub echo_both_ways: bool,
    /// CPU the client threads are pinned to.
    pub client_core: Option<usize>,
    /// How the RPC rows are measured (`--rpc-io`).
    #[serde(default)]
    pub rpc_io: measure::RpcIo,
    /// Payloads in heap memory, not the transport's buffer pool (`--heap-payload`).
    #[serde(default)]
    pub heap_payload: bool,
    /// What the raw rows of send, recv and echo measure (`--raw-twoway`); a report without
    /// this field has stream rows.
    #[serde(default)]
    pub raw_twoway: measure::RawTwoway,
}

/// Default of [`Settings::window_bytes`] (`--window-bytes`): 2 MiB.
pub const WINDOW_BYTES: usize = 2 << 20;
/// Default of [`Settings::verbs_window_bytes`]: 8 MiB. A 1 MiB echo call over verbs is an RTS
/// and a READ each way; with two calls in flight (2 MiB) the device idles between them, and
/// RPC echo of 1 MiB comes closest to the raw stream with 8 MiB
/// (docs/notes/2026-12-03-bench-window-bytes-echo-and-verbs.md).
pub const VERBS_WINDOW_BYTES: usize = 8 << 20;

fn default_verbs_window_bytes() -> usize {
    VERBS_WINDOW_BYTES
}

/// The verbs window for this process: [`VERBS_WINDOW_BYTES`], or where locked memory is
/// limited (`transport_verbs::memlock_budget`) an eighth of the limit if less, never below
/// [`WINDOW_BYTES`]: every byte in flight is registered on both ends (payloads and READ
/// targets), beside the shared receive queue.
pub fn verbs_window_bytes_here() -> usize {
    match transport_verbs::memlock_budget() {
        Some(limit) => {
            let eighth = usize::try_from(limit / 8).unwrap_or(usize::MAX);
            VERBS_WINDOW_BYTES.min(eighth.max(WINDOW_BYTES))
        }
        None => VERBS_WINDOW_BYTES,
    }
}

impl Settings {
    /// These settings for a verbs run: `verbs_window_bytes` in flight.
    pub fn for_verbs(&self) -> Settings {
        Settings {
            window_bytes: self.verbs_window_bytes,
            echo_both_ways: false,
            ..self.clone()
        }
    }

    /// Calls per throughput measurement for `size`.
    pub fn calls_for(&self, size: usize) -> u64 {
        (self.bytes_per_run / size.max(1) as u64).clamp(self.min_calls, self.max_calls)
    }

    /// RPC calls of `op` in flight per client thread for payloads of `size` bytes: as many
    /// as `window_bytes` holds (an echo's payload counted both ways where
    /// [`Settings::echo_both_ways`]), at least one, at most `window`.
    pub fn window_for(&self, op: Op, size: usize) -> usize {
        let ways = 1 + usize::from(op == Op::Echo && self.echo_both_ways);
        (self.window_bytes / size.max(1).saturating_mul(ways)).clamp(1, self.window.max(1))
    }

    /// Whether the raw backend connection is measured (not with `--only rpc`).
    pub fn raw(&self) -> bool {
        self.layers.contains(&Layer::Raw)
    }

    /// Number of measurements the suite runs on one transport, with or without the OS
    /// baseline (for the progress bar).
    pub fn jobs(&self, os: bool) -> u64 {
        let os = os && self.raw();
        let raw_ops = if self.raw() { self.raw_ops().len() } else { 0 };
        let pings = if self.ping {
            1 + usize::from(self.raw()) + usize::from(os)
        } else {
            0
        };
        let mut per_rep =
            self.threads.len() * self.sizes.len() * (self.ops.len() + raw_ops) + pings;
        if os {
            per_rep += self.os_stream_sizes();
        }
        (per_rep * self.repeat) as u64
    }

    /// OS streams per repetition: one per size, beside the send/oneway cells of one thread.
    fn os_stream_sizes(&self) -> usize {
        if self.threads.contains(&1) && self.raw_ops().contains(&Op::Send) {
            self.sizes.len()
        } else {
            0
        }
    }

    fn raw_ops(&self) -> Vec<Op> {
        let mut v: Vec<Op> = self.ops.iter().map(|&o| raw_twin(o)).collect();
        v.dedup();
        v.sort_by_key(|o| o.name());
        v.dedup();
        v
    }
}

/// The raw measurement an RPC operation is compared with.
pub fn raw_twin(op: Op) -> Op {
    match op {
        Op::Oneway => Op::Send,
        o => o,
    }
}

/// min / median / max of repeated runs.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Stat {
    /// Smallest.
    pub min: f64,
    /// Median.
    pub median: f64,
    /// Largest.
    pub max: f64,
}

impl Stat {
    /// Statistics of `v` (empty: zeros).
    pub fn of(mut v: Vec<f64>) -> Stat {
        if v.is_empty() {
            return Stat::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Stat {
            min: v[0],
            median,
            max: v[n - 1],
        }
    }
}

/// Throughput figures of one side of a cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Figures {
    /// Payload Mbit/s.
    pub mbit_s: Stat,
    /// Calls (messages) per second.
    pub calls_s: Stat,
    /// Calls per run.
    pub calls: u64,
    /// Costs, from the counters summed over the runs.
    pub costs: CostFigures,
}

/// Latency figures of one side of the ping row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Latency {
    /// Mean µs per round trip, per run.
    pub us_per_call: Stat,
    /// Round trips per second, per run.
    pub calls_s: Stat,
    /// Median round trip over all runs, µs.
    pub p50_us: f64,
    /// 99th percentile round trip over all runs, µs.
    pub p99_us: f64,
    /// Round trips in all.
    pub calls: u64,
    /// Costs, from the counters summed over the runs.
    pub costs: CostFigures,
}

/// OS ping-pong, raw ping-pong and RPC `void o()`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PingRow {
    /// 1-byte ping-pong over blocking OS sockets without a runtime (the machine's limit);
    /// `None` when not measured (see [`TransportReport::os_baseline`]).
    pub os: Option<Latency>,
    /// 1-byte messages echoed through the backend connection; `None` when the raw layer was
    /// not measured (`--only rpc`).
    pub raw: Option<Latency>,
    /// `void o()` calls.
    pub rpc: Latency,
    /// RPC p50 round trip / raw p50 round trip (robust against preemption by other
    /// processes); `None` without raw figures.
    pub latency_ratio: Option<f64>,
    /// Median of the per-run mean RPC latencies / the same for raw; `None` without raw
    /// figures.
    pub mean_latency_ratio: Option<f64>,
    /// Raw p50 round trip / OS p50 round trip.
    pub raw_os_latency_ratio: Option<f64>,
    /// RPC p50 round trip / OS p50 round trip: how far RPC is from what the machine can do.
    pub rpc_os_latency_ratio: Option<f64>,
}

/// One throughput cell.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    /// The RPC operation.
    pub op: Op,
    /// The raw measurement it is compared with.
    pub raw_op: Op,
    /// Payload bytes per call.
    pub size: usize,
    /// Client threads.
    pub threads: usize,
    /// RPC calls in flight per client thread in this cell: `--window`, or fewer where
    /// `--window-bytes` / size says so (at least 1).
    pub window: usize,
    /// Raw figures; `None` when the raw layer was not measured (`--only rpc`).
    pub raw: Option<Figures>,
    /// RPC figures.
    pub rpc: Figures,
    /// RPC Mbit/s / raw Mbit/s: the median over the repetitions of the ratio of the two runs
    /// measured back to back (a paired comparison: noise from other processes that slows one
    /// repetition down slows both of its runs); `None` without raw figures.
    pub utilization: Option<f64>,
    /// The OS stream of the same size (blocking socket into a reading sink, one thread, no
    /// runtime): send and oneway cells of one thread, when the OS baseline is measured.
    pub os: Option<Figures>,
    /// Raw Mbit/s / OS Mbit/s, paired like `utilization`.
    pub raw_os_utilization: Option<f64>,
    /// RPC Mbit/s / OS Mbit/s, paired like `utilization`: the share of what the machine can
    /// do that RPC gets.
    pub rpc_os_utilization: Option<f64>,
}

/// What a transport's `os` columns were measured against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BaselineKind {
    /// The OS's own blocking sockets, no runtime (uds and tcp in local mode).
    Sockets,
    /// The verbs link itself, perftest-style (see [`crate::link`]).
    Link,
    /// Nothing: the os columns were not measured.
    NotMeasured,
}

impl BaselineKind {
    /// How the tables and the plot name the limit: `os`, or `link` for verbs.
    pub fn column(self) -> &'static str {
        match self {
            BaselineKind::Link => "link",
            BaselineKind::Sockets | BaselineKind::NotMeasured => "os",
        }
    }
}

/// The limit a transport was measured against (the `os` columns): its kind, and what it is or
/// why it was not measured. In JSON, `os_baseline_kind` (`sockets`, `link`, `not_measured`)
/// and `os_baseline` (the text) beside the transport's other fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Baseline {
    /// The kind of limit.
    #[serde(rename = "os_baseline_kind")]
    pub kind: BaselineKind,
    /// What the limit is (`blocking std UnixStream ...`, `link: ...`), or `not measured: WHY`.
    #[serde(rename = "os_baseline")]
    pub describe: String,
}

impl Baseline {
    /// The OS's own sockets, described by `describe`.
    pub fn sockets(describe: impl Into<String>) -> Baseline {
        Baseline {
            kind: BaselineKind::Sockets,
            describe: describe.into(),
        }
    }

    /// The verbs link.
    pub fn link() -> Baseline {
        Baseline {
            kind: BaselineKind::Link,
            describe: format!("link: {}", crate::link::DESCRIBE),
        }
    }

    /// Not measured, because `why`.
    pub fn not_measured(why: &str) -> Baseline {
        Baseline {
            kind: BaselineKind::NotMeasured,
            describe: format!("not measured: {why}"),
        }
    }

    /// Whether the limit was measured (the OS's sockets or the link).
    pub fn measured(&self) -> bool {
        self.kind != BaselineKind::NotMeasured
    }
}

/// Everything measured on one transport.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TransportReport {
    /// Backend name.
    pub transport: String,
    /// What the OS baseline (`os` figures) is, or why it was not measured.
    #[serde(flatten)]
    pub os_baseline: Baseline,
    /// The latency row (absent when `--ops` leaves `ping` out).
    pub ping: Option<PingRow>,
    /// Throughput cells.
    pub cells: Vec<Cell>,
    /// What else the reader should know about this transport's run (verbs: the polling mode
    /// and the memory per connection).
    pub notes: Vec<String>,
    /// Where the transport was measured when that is not this machine: an emulated one
    /// (`cargo xtask bench` measures verbs in the soft-RoCE guest), whose figures compare
    /// with each other but not with this machine's. Absent for this machine's own rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emulated: Option<String>,
}

fn sum_outcomes(runs: &[Outcome]) -> CostFigures {
    let mut total = Outcome {
        elapsed: std::time::Duration::ZERO,
        calls: 0,
        payload_bytes: 0,
        latency: None,
        metrics: Default::default(),
        server_metrics: Default::default(),
        cpu: std::time::Duration::ZERO,
        page_faults: 0,
        context_switches: 0,
    };
    for r in runs {
        total.calls += r.calls;
        total.payload_bytes += r.payload_bytes;
        total.metrics.accumulate(&r.metrics);
        total.server_metrics.accumulate(&r.server_metrics);
        total.cpu += r.cpu;
        total.page_faults += r.page_faults;
        total.context_switches += r.context_switches;
    }
    CostFigures::of(&total)
}

fn figures(runs: &[Outcome]) -> Figures {
    Figures {
        mbit_s: Stat::of(runs.iter().map(Outcome::mbit_s).collect()),
        calls_s: Stat::of(runs.iter().map(Outcome::calls_s).collect()),
        calls: runs.first().map_or(0, |r| r.calls),
        costs: sum_outcomes(runs),
    }
}

fn latency(runs: &[Outcome]) -> Result<Latency, String> {
    let mut all: Option<hdrhistogram::Histogram<u64>> = None;
    for r in runs {
        if let Some(h) = &r.latency {
            match &mut all {
                Some(a) => a.add(h).map_err(|e| e.to_string())?,
                None => all = Some(h.clone()),
            }
        }
    }
    let all = all.ok_or("no latency samples")?;
    Ok(Latency {
        us_per_call: Stat::of(
            runs.iter()
                .map(|r| r.elapsed.as_secs_f64() * 1e6 / r.calls.max(1) as f64)
                .collect(),
        ),
        calls_s: Stat::of(runs.iter().map(Outcome::calls_s).collect()),
        p50_us: all.value_at_quantile(0.5) as f64 / 1e3,
        p99_us: all.value_at_quantile(0.99) as f64 / 1e3,
        calls: runs.iter().map(|r| r.calls).sum(),
        costs: sum_outcomes(runs),
    })
}

/// Pairs of ping chunks per repetition, run in the order raw, rpc, rpc, raw, raw, rpc, ...
const PING_PAIRS: usize = 4;

/// Median over the repetitions of `rpc[i] / raw[i]` (runs measured back to back).
fn paired_ratio(rpc: &[Outcome], raw: &[Outcome]) -> f64 {
    Stat::of(
        rpc.iter()
            .zip(raw)
            .map(|(r, w)| r.mbit_s() / w.mbit_s().max(1e-9))
            .collect(),
    )
    .median
}

/// One side of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Side {
    /// Blocking OS sockets, no runtime.
    Os,
    /// The backend connection.
    Raw,
    /// RPC over it.
    Rpc,
}

/// Why an `--only rpc` run has no os (or link) figures.
pub const ONLY_RPC: &str = "--only rpc (the raw connection and its limit were not measured)";

/// The OS baseline of a transport: measured against `Target`, or not, and why.
pub enum OsBaseline<'a> {
    /// Measure against the OS baseline server at this target.
    Measure(&'a os::Target),
    /// Verbs: measure against the link itself (see [`crate::link`]); shown in the os columns.
    Link(&'a crate::link::Target),
    /// Not measured, for this reason.
    Skip(String),
}

/// What the os columns measure against.
#[derive(Clone, Copy)]
enum Limit<'a> {
    Os(&'a os::Target),
    Link(&'a crate::link::Target),
}

/// Runs the suite against the bench server `peer` (and the OS baseline server, if any).
/// Without the raw layer (`--only rpc`) neither raw nor the OS baseline is measured, and
/// the report says so.
pub fn run<T: Transport + Clone>(
    peer: &Peer<'_, T>,
    os_baseline: OsBaseline<'_>,
    s: &Settings,
    progress: &ProgressBar,
) -> Result<TransportReport, String> {
    let os_baseline = if s.raw() {
        os_baseline
    } else {
        OsBaseline::Skip(ONLY_RPC.into())
    };
    let os_target = match &os_baseline {
        OsBaseline::Measure(t) => Some(Limit::Os(t)),
        OsBaseline::Link(t) => Some(Limit::Link(t)),
        OsBaseline::Skip(_) => None,
    };
    let name = peer.transport.capabilities().name.to_string();
    let job = |op, layer, size, count, threads| Job {
        op,
        layer,
        size,
        count,
        threads,
        window: s.window_for(op, size),
        client_core: s.client_core,
        heap_payload: s.heap_payload,
        raw_twoway: s.raw_twoway,
    };
    let measure_side = |side: Side, op: Op, size: usize, count: u64, threads: usize| match side {
        Side::Os => match (os_target, op) {
            (Some(Limit::Os(t)), Op::Ping) => os::ping(t, count, s.client_core),
            (Some(Limit::Os(t)), Op::Send) => os::stream(t, size, count, s.client_core),
            (Some(Limit::Link(t)), Op::Ping) => crate::link::ping(t, count, s.client_core),
            (Some(Limit::Link(t)), Op::Send) => crate::link::stream(t, size, count, s.client_core),
            (None, _) => Err("the OS baseline is not measured here".to_string()),
            (Some(_), op) => Err(format!("the OS baseline has no {} test", op.name())),
        },
        Side::Raw => measure::run(peer, job(op, Layer::Raw, size, count, threads)),
        Side::Rpc => measure::run(peer, job(op, Layer::Rpc, size, count, threads)),
    };
    let repeat = s.repeat.max(1);
    // The pings of a repetition are measured in chunks, the sides alternating as
    // os, raw, rpc, rpc, raw, os (raw, rpc, rpc, raw without the OS baseline): a burst of
    // load from other processes, or a drift in the machine's speed, then falls on every
    // side alike instead of on one of them.
    let sides: &[Side] = match (os_target.is_some(), s.raw()) {
        (true, _) => &[Side::Os, Side::Raw, Side::Rpc],
        (false, true) => &[Side::Raw, Side::Rpc],
        (false, false) => &[Side::Rpc],
    };
    let ping_chunks = PING_PAIRS * sides.len();
    // Chunks per side over the whole suite; the pings are shared out exactly between them.
    let per_layer = repeat as u64 * PING_PAIRS as u64;
    let pings_in = |i: u64| (s.pings / per_layer + u64::from(i < s.pings % per_layer)).max(1);
    let mut ping_os = Vec::new();
    let mut ping_raw = Vec::new();
    let mut ping_rpc = Vec::new();
    // (side, op, size, threads) -> runs, in repetition order
    let mut runs: HashMap<(Side, Op, usize, usize), Vec<Outcome>> = HashMap::new();
    let raw_ops = s.raw_ops();
    for rep in 0..repeat {
        progress.set_message(format!("{name}: ping, run {}/{repeat}", rep + 1));
        for chunk in 0..if s.ping { ping_chunks } else { 0 } {
            let k = sides.len();
            let p = chunk % (2 * k);
            let side = if p < k {
                sides[p]
            } else {
                sides[2 * k - 1 - p]
            };
            let out = match side {
                Side::Os => &mut ping_os,
                Side::Raw => &mut ping_raw,
                Side::Rpc => &mut ping_rpc,
            };
            let count = pings_in(out.len() as u64);
            // 1-byte raw and OS messages, `void o()` calls.
            let size = usize::from(side != Side::Rpc);
            out.push(measure_side(side, Op::Ping, size, count, 1)?);
        }
        if s.ping {
            progress.inc(sides.len() as u64);
        }
        for &threads in &s.threads {
            for &size in &s.sizes {
                let count = s.calls_for(size).max(threads as u64);
                progress.set_message(format!(
                    "{name}: {size} B x {threads} thread(s), run {}/{repeat}",
                    rep + 1
                ));
                for &op in &raw_ops {
                    // OS and raw first in even repetitions, RPC first in odd ones: the runs
                    // of a cell are measured back to back, and no side always goes first.
                    let mut measured = Vec::new();
                    let mut jobs: Vec<(Side, Op)> = Vec::new();
                    if os_target.is_some() && op == Op::Send && threads == 1 {
                        jobs.push((Side::Os, op));
                    }
                    if s.raw() {
                        jobs.push((Side::Raw, op));
                    }
                    jobs.extend(
                        s.ops
                            .iter()
                            .filter(|&&r| raw_twin(r) == op)
                            .map(|&r| (Side::Rpc, r)),
                    );
                    if rep % 2 == 1 {
                        jobs.reverse();
                    }
                    for (side, op) in jobs {
                        let o = measure_side(side, op, size, count, threads)?;
                        measured.push(((side, op, size, threads), o));
                        progress.inc(1);
                    }
                    for (key, o) in measured {
                        runs.entry(key).or_default().push(o);
                    }
                }
            }
        }
    }
    let ping = if s.ping {
        let measured = |runs: &[Outcome]| (!runs.is_empty()).then(|| latency(runs)).transpose();
        let raw = measured(&ping_raw)?;
        let rpc = latency(&ping_rpc)?;
        let os = measured(&ping_os)?;
        let p50 = |over: &Option<Latency>, of: &Latency| {
            over.as_ref().map(|o| of.p50_us / o.p50_us.max(1e-9))
        };
        Some(PingRow {
            latency_ratio: p50(&raw, &rpc),
            mean_latency_ratio: raw
                .as_ref()
                .map(|r| rpc.us_per_call.median / r.us_per_call.median.max(1e-9)),
            raw_os_latency_ratio: raw.as_ref().and_then(|r| p50(&os, r)),
            rpc_os_latency_ratio: p50(&os, &rpc),
            os,
            raw,
            rpc,
        })
    } else {
        None
    };
    let mut cells = Vec::new();
    for &threads in &s.threads {
        for &op in &s.ops {
            for &size in &s.sizes {
                let raw_op = raw_twin(op);
                let raw_runs = runs.get(&(Side::Raw, raw_op, size, threads));
                let rpc_runs = &runs[&(Side::Rpc, op, size, threads)];
                let os_runs = runs.get(&(Side::Os, raw_op, size, threads));
                cells.push(Cell {
                    op,
                    raw_op,
                    size,
                    threads,
                    window: s.window_for(op, size),
                    utilization: raw_runs.map(|raw| paired_ratio(rpc_runs, raw)),
                    raw: raw_runs.map(|raw| figures(raw)),
                    rpc: figures(rpc_runs),
                    os: os_runs.map(|o| figures(o)),
                    raw_os_utilization: raw_runs.zip(os_runs).map(|(raw, o)| paired_ratio(raw, o)),
                    rpc_os_utilization: os_runs.map(|o| paired_ratio(rpc_runs, o)),
                });
            }
        }
    }
    Ok(TransportReport {
        transport: name,
        os_baseline: match os_baseline {
            OsBaseline::Measure(t) => Baseline::sockets(t.describe()),
            OsBaseline::Link(_) => Baseline::link(),
            OsBaseline::Skip(why) => Baseline::not_measured(&why),
        },
        ping,
        cells,
        notes: Vec::new(),
        emulated: None,
    })
}
