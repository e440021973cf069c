//! The report: terminal tables, the diagnosis, JSON.

use crate::suite::{BaselineKind, Cell, Settings, Stat, TransportReport};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// Where the client and server ran.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Placement {
    /// `local` (both in this process) or `remote` (client of `bench server` on another host).
    pub mode: String,
    /// CPU the client threads were pinned to.
    pub client_core: Option<usize>,
    /// CPU the server ran on (local mode, pinned), if known.
    pub server_core: Option<usize>,
    /// CPUs this process may use.
    pub allowed_cpus: Vec<usize>,
    /// Human-readable summary.
    pub summary: String,
}

/// A transport that was not measured, and why.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Unavailable {
    /// Backend name.
    pub transport: String,
    /// Why it was skipped.
    pub reason: String,
}

/// The diagnosis of one transport.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Diagnosis {
    /// Backend name.
    pub transport: String,
    /// The cell the figures come from: the lowest utilization among the cells of 256 KB and
    /// more at the fewest threads (all sizes when none is that large).
    pub basis: String,
    /// Utilization of that cell.
    pub utilization: f64,
    /// RPC payload bytes copied per payload byte.
    pub copies_per_byte: f64,
    /// Raw payload bytes copied per payload byte.
    pub raw_copies_per_byte: f64,
    /// RPC minor page faults per call (whole process).
    pub page_faults_per_call: f64,
    /// Raw minor page faults per message (whole process).
    pub raw_page_faults_per_call: f64,
    /// RPC context switches per call (whole process).
    pub context_switches_per_call: f64,
    /// Raw context switches per message (whole process).
    pub raw_context_switches_per_call: f64,
    /// RPC system calls or doorbells per call (client side).
    pub syscalls_per_call: f64,
    /// Raw system calls or doorbells per message (client side).
    pub raw_syscalls_per_call: f64,
    /// RPC memory registrations per call.
    pub registrations_per_call: f64,
    /// Mean RPC calls in flight.
    pub mean_in_flight: f64,
    /// RPC CPU ms per GB (whole process).
    pub cpu_ms_per_gb: f64,
    /// Raw CPU ms per GB (whole process).
    pub raw_cpu_ms_per_gb: f64,
    /// RPC CPU µs per ping vs raw, from the latency row.
    pub ping_cpu_us: (f64, f64),
    /// The largest cost, in one sentence.
    pub verdict: String,
    /// Where the round trip goes against the OS's own sockets (wake-ups and system calls per
    /// round trip of os, raw and RPC), when the os baseline was measured.
    pub latency_verdict: Option<String>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Tool version.
    pub version: String,
    /// The machine it was measured on (absent in reports without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<crate::machine::Machine>,
    /// Placement of client and server.
    pub placement: Placement,
    /// What was measured.
    pub settings: Settings,
    /// Per-transport results.
    pub transports: Vec<TransportReport>,
    /// Transports not measured.
    pub unavailable: Vec<Unavailable>,
    /// Per-transport diagnosis.
    pub diagnosis: Vec<Diagnosis>,
    /// Wall time of the whole run, seconds.
    pub wall_seconds: f64,
}

/// Formats a byte count in binary units, as `--sizes` reads K and M: 64 KiB, 2 MiB; a count
/// that is not a whole number of KiB stays exact (500000 B).
pub fn size_label(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1024 && n % 1024 == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

pub(crate) fn num(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

pub(crate) fn stat(s: &Stat) -> String {
    format!("{} ({}-{})", num(s.median), num(s.min), num(s.max))
}

/// How the cells of a [`Table`] column line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Padded on the right (names, labels).
    Left,
    /// Padded on the left (figures).
    Right,
}

/// A text table: a header row and rows of cells, each column as wide as its widest cell,
/// two spaces between columns, each line after an indent. The one table renderer of the
/// bench: the main report's tables and `bench scenario`'s are all drawn by it.
#[derive(Debug, Clone)]
pub struct Table {
    rows: Vec<Vec<String>>,
    align: Vec<Align>,
    indent: &'static str,
}

impl Table {
    /// A table with `header`, its first `left` columns aligned left and the others right,
    /// indented by two spaces (the main report's layout).
    pub fn new(header: &[&str], left: usize) -> Table {
        Table {
            rows: vec![header.iter().map(|s| s.to_string()).collect()],
            align: (0..header.len())
                .map(|c| if c < left { Align::Left } else { Align::Right })
                .collect(),
            indent: "  ",
        }
    }

    /// The same table with every line indented by `indent` instead of two spaces.
    pub fn indent(mut self, indent: &'static str) -> Table {
        self.indent = indent;
        self
    }

    /// Adds a row (a row longer than the header has its extra cells aligned right).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Adds every row of `rows`.
    pub fn rows(&mut self, rows: impl IntoIterator<Item = Vec<String>>) {
        self.rows.extend(rows);
    }

    /// Appends the table to `out`, one line per row, without trailing spaces.
    pub fn render(&self, out: &mut String) {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..cols)
            .map(|c| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(c))
                    .map(|s| s.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for r in &self.rows {
            let mut line = String::from(self.indent);
            for (c, cell) in r.iter().enumerate() {
                let pad = " ".repeat(widths[c] - cell.chars().count());
                match self.align.get(c).copied().unwrap_or(Align::Right) {
                    Align::Left => {
                        line.push_str(cell);
                        line.push_str(&pad);
                    }
                    Align::Right => {
                        line.push_str(&pad);
                        line.push_str(cell);
                    }
                }
                line.push_str("  ");
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
}

/// Builds the diagnosis of one transport from its cells and its ping row: RPC against raw,
/// so none without raw figures (`--only rpc`).
///
/// `raw_twoway` says what the raw rows of send, recv and echo measured (`--raw-twoway`): the
/// verdict blames a twoway call's second message only when raw had none.
pub fn diagnose(t: &TransportReport, raw_twoway: crate::measure::RawTwoway) -> Option<Diagnosis> {
    // The cells with both sides measured, each with its raw figures and utilization.
    let paired = || {
        t.cells
            .iter()
            .filter_map(|c| Some((c, c.raw.as_ref()?, c.utilization?)))
    };
    let threads = paired().map(|(c, ..)| c.threads).min()?;
    let at_threads = || paired().filter(move |(c, ..)| c.threads == threads);
    let large = at_threads().any(|(c, ..)| c.size >= 256 << 10);
    let (basis, raw, utilization): (&Cell, _, f64) = at_threads()
        .filter(|(c, ..)| !large || c.size >= 256 << 10)
        .min_by(|a, b| a.2.total_cmp(&b.2))?;
    let rpc = &basis.rpc.costs;
    let raw = &raw.costs;
    let mut d = Diagnosis {
        transport: t.transport.clone(),
        basis: format!(
            "{} {} x {} thread(s)",
            basis.op.name(),
            size_label(basis.size),
            basis.threads
        ),
        utilization,
        copies_per_byte: rpc.copies_per_byte,
        raw_copies_per_byte: raw.copies_per_byte,
        page_faults_per_call: rpc.page_faults_per_call,
        raw_page_faults_per_call: raw.page_faults_per_call,
        context_switches_per_call: rpc.context_switches_per_call,
        raw_context_switches_per_call: raw.context_switches_per_call,
        syscalls_per_call: rpc.syscalls_per_call,
        raw_syscalls_per_call: raw.syscalls_per_call,
        registrations_per_call: rpc.registrations_per_call,
        mean_in_flight: rpc.mean_in_flight,
        cpu_ms_per_gb: rpc.cpu_ms_per_gb,
        raw_cpu_ms_per_gb: raw.cpu_ms_per_gb,
        ping_cpu_us: t
            .ping
            .as_ref()
            .and_then(|p| {
                Some((
                    p.rpc.costs.cpu_us_per_call,
                    p.raw.as_ref()?.costs.cpu_us_per_call,
                ))
            })
            .unwrap_or((0.0, 0.0)),
        verdict: String::new(),
        latency_verdict: latency_verdict(t),
    };
    d.verdict = verdict(
        &d,
        utilization,
        t.ping.as_ref().and_then(|p| p.latency_ratio),
        basis.op != crate::measure::Op::Oneway,
        raw_twoway == crate::measure::RawTwoway::Exchange,
    );
    d.verdict = format!("{} (basis: {})", d.verdict.trim_end_matches('.'), d.basis) + ".";
    Some(d)
}

/// One sentence on the ping row against the os baseline: how far raw and RPC are from it, and
/// whether the extra time goes to wake-ups (context switches of the whole process per round
/// trip) or to the transport's reads and writes (client side; a runtime's `epoll_wait` calls
/// are not among them, its wake-ups are). None unless os, raw and RPC were all measured.
pub fn latency_verdict(t: &TransportReport) -> Option<String> {
    let p = t.ping.as_ref()?;
    let os = p.os.as_ref()?;
    let raw = p.raw.as_ref()?;
    if t.os_baseline.kind == BaselineKind::Link {
        let (r, c) = (&raw.costs, &p.rpc.costs);
        return Some(format!(
            "{} latency: RPC p50 {:.1} µs = {:.2}x the link's busy-polled SEND ping-pong ({:.1} µs), raw {:.2}x; \
             CPU per round trip {:.1} µs for RPC, {:.1} raw, {:.1} link; system calls and doorbells per round trip {:.1} for RPC, {:.1} raw \
             (completion-channel arms and reads count: 0 when every reply came within the polling budget); \
             messages handed from another task to the waiting task per round trip {:.2} for RPC, {:.2} raw (both sides; 0 when each was taken from the device on the task waiting for it).",
            t.transport,
            p.rpc.p50_us,
            p.rpc.p50_us / os.p50_us.max(1e-9),
            os.p50_us,
            raw.p50_us / os.p50_us.max(1e-9),
            c.cpu_us_per_call,
            r.cpu_us_per_call,
            os.costs.cpu_us_per_call,
            c.syscalls_per_call,
            r.syscalls_per_call,
            c.handoffs_per_call,
            r.handoffs_per_call,
        ));
    }
    let (o, r, c) = (&os.costs, &raw.costs, &p.rpc.costs);
    let ratio = p.rpc.p50_us / os.p50_us.max(1e-9);
    let cause = if ratio <= 1.1 {
        "at the OS's limit for this placement".to_string()
    } else if c.context_switches_per_call > 1.3 * o.context_switches_per_call + 0.2 {
        format!(
            "the gap is wake-ups: {:.1} context switches per round trip for RPC and {:.1} raw against {:.1} for blocking sockets",
            c.context_switches_per_call, r.context_switches_per_call, o.context_switches_per_call
        )
    } else if c.syscalls_per_call > 1.2 * o.syscalls_per_call {
        format!(
            "the gap is system calls: {:.1} reads and writes per round trip for RPC and {:.1} raw against {:.1}",
            c.syscalls_per_call, r.syscalls_per_call, o.syscalls_per_call
        )
    } else {
        format!(
            "wake-ups ({:.1} context switches per round trip; os {:.1}) and reads and writes ({:.1}; os {:.1}) match the OS: the rest is CPU in the runtime (its epoll_wait calls are not counted here) and the RPC layer ({:.1} µs CPU per call, raw {:.1}, os {:.1})",
            c.context_switches_per_call,
            o.context_switches_per_call,
            c.syscalls_per_call,
            o.syscalls_per_call,
            c.cpu_us_per_call,
            r.cpu_us_per_call,
            o.cpu_us_per_call
        )
    };
    Some(format!(
        "{} latency: RPC p50 {:.1} µs = {:.2}x the OS's blocking sockets ({:.1} µs), raw {:.2}x; {}.",
        t.transport,
        p.rpc.p50_us,
        ratio,
        os.p50_us,
        raw.p50_us / os.p50_us.max(1e-9),
        cause
    ))
}

fn verdict(
    d: &Diagnosis,
    util: f64,
    ping: Option<f64>,
    twoway: bool,
    raw_exchange: bool,
) -> String {
    // Without a latency row, the verdict speaks of throughput only.
    let ping_ratio = ping.unwrap_or(1.0);
    let latency = |r: f64| match ping {
        Some(_) => format!(" and {r:.2}x raw p50 latency"),
        None => String::new(),
    };
    // Each candidate: (estimated share of the gap, sentence).
    let mut candidates: Vec<(f64, String)> = Vec::new();
    let extra_copies = d.copies_per_byte - d.raw_copies_per_byte;
    if extra_copies > 0.05 {
        candidates.push((
            extra_copies,
            format!(
                "payload copies: {:.2} bytes copied in user space per byte moved ({:.2} raw)",
                d.copies_per_byte, d.raw_copies_per_byte
            ),
        ));
    }
    let extra_faults = d.page_faults_per_call - d.raw_page_faults_per_call;
    if extra_faults > 1.0 {
        candidates.push((
            // ~120 faults re-map a 500 KB buffer: treat a full re-map per call as a 100% cost.
            extra_faults / 120.0,
            format!(
                "fresh memory per call: {:.1} page faults per call ({:.1} raw), buffers are allocated instead of reused",
                d.page_faults_per_call, d.raw_page_faults_per_call
            ),
        ));
    }
    if d.registrations_per_call > 0.01 {
        candidates.push((
            d.registrations_per_call,
            format!(
                "memory registration on the call path: {:.2} registrations per call",
                d.registrations_per_call
            ),
        ));
    }
    if twoway && d.mean_in_flight < 1.5 && util < 0.95 {
        candidates.push((
            // Structural: with one call at a time nothing else can close the gap.
            1.0 - util + 0.5,
            format!(
                "too few calls in flight (mean {:.1}): every call waits a full round trip; raise --window or --window-bytes",
                d.mean_in_flight
            ),
        ));
    }
    if d.raw_syscalls_per_call > 0.0 && d.syscalls_per_call > 1.2 * d.raw_syscalls_per_call {
        candidates.push((
            (d.syscalls_per_call / d.raw_syscalls_per_call - 1.0) * 0.5,
            format!(
                "system calls: {:.2} per call against {:.2} per raw message{}",
                d.syscalls_per_call,
                d.raw_syscalls_per_call,
                if twoway && !raw_exchange {
                    " (a twoway call is two messages where the raw stream has one: the other one costs a write, a read and a wake-up per call unless several are written together)"
                } else {
                    ""
                }
            ),
        ));
    }
    let extra_switches = d.context_switches_per_call - d.raw_context_switches_per_call;
    if extra_switches > 0.3 && d.context_switches_per_call > 1.3 * d.raw_context_switches_per_call {
        candidates.push((
            // A switch costs a few µs: about a tenth of a large call on one core.
            extra_switches * 0.1,
            format!(
                "wake-ups: {:.2} context switches per call against {:.2} per raw message (client and server take turns per call instead of per batch)",
                d.context_switches_per_call, d.raw_context_switches_per_call
            ),
        ));
    }
    if d.raw_cpu_ms_per_gb > 0.0 && d.cpu_ms_per_gb > 1.05 * d.raw_cpu_ms_per_gb {
        candidates.push((
            d.cpu_ms_per_gb / d.raw_cpu_ms_per_gb - 1.0,
            format!(
                "CPU in the RPC layer: {:.0} ms per GB against {:.0} ms raw (+{:.0}%)",
                d.cpu_ms_per_gb,
                d.raw_cpu_ms_per_gb,
                (d.cpu_ms_per_gb / d.raw_cpu_ms_per_gb - 1.0) * 100.0
            ),
        ));
    }
    let (rpc_cpu, raw_cpu) = d.ping_cpu_us;
    if ping_ratio > 1.15 && raw_cpu > 0.0 {
        candidates.push((
            ping_ratio - 1.0,
            format!(
                "per-call overhead of the RPC layer: a ping costs {rpc_cpu:.1} µs of CPU against {raw_cpu:.1} µs raw ({ping_ratio:.2}x the raw p50 latency)"
            ),
        ));
    }
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0));
    match candidates.into_iter().next() {
        Some((_, s)) if util < 0.95 || ping_ratio > 1.15 => {
            format!("{}: the largest cost is {s}.", d.transport)
        }
        Some((_, s)) => format!(
            "{}: RPC is at {:.0}% of raw throughput{}; the largest remaining cost is {s}.",
            d.transport,
            util * 100.0,
            latency(ping_ratio)
        ),
        None => format!(
            "{}: no measurable cost above raw: RPC is at {:.0}% of raw throughput{}.",
            d.transport,
            util * 100.0,
            latency(ping_ratio)
        ),
    }
}

impl Report {
    /// One line per measured transport without an OS baseline, saying why (not with
    /// `--only rpc`, whose title and section lines already say so), then the notes.
    fn os_notes(&self, out: &mut String) {
        let unmeasured = self
            .transports
            .iter()
            .filter(|r| self.settings.raw() && !r.os_baseline.measured());
        for r in unmeasured {
            let _ = writeln!(out, "  {:<9}  os: {}", r.transport, r.os_baseline.describe);
        }
        for r in &self.transports {
            for n in &r.notes {
                let _ = writeln!(out, "  {:<9}  {n}", r.transport);
            }
        }
    }

    /// Adds the transports that `other` measured on an emulated machine, described by
    /// `machine` (`cargo xtask bench`: verbs in the soft-RoCE guest), to this report's tables.
    /// Their rows are named `NAME*`, with a note that says where and how they were measured
    /// and that only their ratios compare with this machine's rows; this report's
    /// "unavailable" line for the same transport goes. Their diagnosis lines come along.
    pub fn merge_emulated(&mut self, other: Report, machine: &str) {
        let placement = other.placement.summary;
        for mut t in other.transports {
            let name = std::mem::take(&mut t.transport);
            self.unavailable.retain(|u| u.transport != name);
            t.transport = format!("{name}*");
            t.notes.insert(
                0,
                format!(
                    "* measured {machine}; placement: {placement}; compare its ratios (against \
                     its own {}), not its figures, with the rows of this machine",
                    t.os_baseline.kind.column()
                ),
            );
            t.emulated = Some(format!("{machine}; placement: {placement}"));
            self.transports.push(t);
        }
        for mut d in other.diagnosis {
            // The verdicts start with the transport's name: mark them as the rows are.
            let mark = |v: &mut String| {
                if v.starts_with(&d.transport) {
                    v.insert(d.transport.len(), '*');
                }
            };
            mark(&mut d.verdict);
            if let Some(v) = d.latency_verdict.as_mut() {
                mark(v);
            }
            d.transport.push('*');
            self.diagnosis.push(d);
        }
        self.wall_seconds += other.wall_seconds;
    }

    /// What the title says the run measured against: `, against the OS's own sockets (uds,
    /// tcp) and the link (verbs)`, naming only the limits that were measured; empty when none
    /// was.
    fn against(&self) -> String {
        let limits: Vec<String> = [
            (BaselineKind::Sockets, "the OS's own sockets"),
            (BaselineKind::Link, "the link"),
        ]
        .into_iter()
        .filter_map(|(kind, limit)| {
            let names: Vec<&str> = self
                .transports
                .iter()
                .filter(|r| r.os_baseline.kind == kind)
                .map(|r| r.transport.as_str())
                .collect();
            (!names.is_empty()).then(|| format!("{limit} ({})", names.join(", ")))
        })
        .collect();
        if limits.is_empty() {
            String::new()
        } else {
            format!(", against {}", limits.join(" and "))
        }
    }

    /// The terminal rendering: what was measured and how, the latency table, the throughput
    /// table, the diagnosis.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_preamble(&mut out);
        out.push('\n');
        self.render_latency(&mut out);
        self.os_notes(&mut out);
        out.push('\n');
        self.render_throughput(&mut out);
        self.render_unavailable(&mut out);
        self.render_diagnosis(&mut out);
        let _ = writeln!(out, "\n(total {:.1} s)", self.wall_seconds);
        out
    }

    /// The lines above the tables: mode, placement, runs and window, payload memory.
    fn render_preamble(&self, out: &mut String) {
        let what = if self.settings.raw() {
            "raw backend connection vs RPC over it"
        } else {
            "RPC alone (--only rpc: the raw connection and the os baseline were not measured)"
        };
        let _ = writeln!(
            out,
            "bench {}: {what}{} ({} mode)",
            self.version,
            self.against(),
            self.placement.mode
        );
        let _ = writeln!(out, "placement: {}", self.placement.summary);
        let _ = writeln!(
            out,
            "runs: {} per figure, shown as median (min-max); {}",
            self.settings.repeat,
            match self.settings.rpc_io {
                crate::measure::RpcIo::Async => format!(
                    "RPC window: up to {} calls and {} in flight per client thread{}{}",
                    self.settings.window,
                    size_label(self.settings.window_bytes),
                    if self.settings.echo_both_ways
                        && self.settings.ops.contains(&crate::measure::Op::Echo)
                    {
                        " (an echo's payload counted out and back)"
                    } else {
                        ""
                    },
                    if self.settings.verbs_window_bytes != self.settings.window_bytes
                        && self
                            .transports
                            .iter()
                            .any(|t| t.transport.starts_with("verbs"))
                    {
                        format!(
                            " ({} on verbs)",
                            size_label(self.settings.verbs_window_bytes)
                        )
                    } else {
                        String::new()
                    }
                ),
                crate::measure::RpcIo::Blocking => "RPC: blocking (transport_rpc::blocking: \
                    the client blocks in recv, one call at a time; a thread per connection on \
                    the server; verbs rows stay async)"
                    .to_string(),
            }
        );
        let _ = writeln!(
            out,
            "payloads: {}",
            if self.settings.heap_payload {
                "heap memory (--heap-payload: verbs copies eager messages into registered memory)"
            } else {
                "from the transport's buffer pool (registered memory on verbs: no copy; \
                 --heap-payload for heap memory)"
            }
        );
    }

    /// The latency table (os, raw and RPC ping), and the transports not available.
    fn render_latency(&self, out: &mut String) {
        // The OS columns appear when some transport has its OS baseline (local mode, uds and
        // tcp; verbs with its link); a transport without one shows "n/a" there. The raw
        // columns appear when raw was measured (not with --only rpc).
        let pinged: Vec<(&TransportReport, &crate::suite::PingRow)> = self
            .transports
            .iter()
            .filter_map(|r| r.ping.as_ref().map(|p| (r, p)))
            .collect();
        let with_os = pinged.iter().any(|(_, p)| p.os.is_some());
        let with_raw = pinged.iter().any(|(_, p)| p.raw.is_some());
        let with_link = pinged
            .iter()
            .any(|(r, p)| p.os.is_some() && r.os_baseline.kind == BaselineKind::Link);
        if pinged.is_empty() && self.settings.ping {
            out.push_str("Latency: no transport was measured here (see below)\n");
        } else if pinged.is_empty() {
            out.push_str("Latency: not measured (--ops without ping)\n");
        } else if with_os {
            out.push_str(
                "Latency: os = 1-byte ping-pong over blocking OS sockets, no runtime (what the machine can do), raw = 1-byte ping-pong on the backend connection, rpc = `void o()` call; os, raw and rpc measured in alternating chunks; µs/rt = mean per chunk\n",
            );
            if with_link {
                out.push_str("  for verbs, os = the link: 2-byte SEND ping-pong busy-polled on both sides through this crate's binding (ib_send_lat-style)\n");
            }
        } else if with_raw {
            out.push_str(
                "Latency: raw = 1-byte ping-pong on the backend connection, rpc = `void o()` call; raw and rpc measured in alternating chunks; µs/rt = mean per chunk\n",
            );
        } else {
            out.push_str(
                "Latency: rpc = `void o()` call; µs/call = mean per chunk; raw and os: not measured (--only rpc)\n",
            );
        }
        let mut header = vec!["transport"];
        if with_os {
            header.extend(["os µs/rt", "os p50/p99 µs"]);
        }
        if with_raw {
            header.extend(["raw µs/rt", "raw p50/p99 µs"]);
        }
        header.extend(["rpc µs/call", "rpc p50/p99 µs", "rpc calls/s"]);
        if with_raw {
            header.extend(["rpc/raw p50", "rpc/raw mean"]);
        }
        if with_os {
            if with_raw {
                header.push("raw/os p50");
            }
            header.push("rpc/os p50");
        }
        let lat = |l: Option<&crate::suite::Latency>| match l {
            Some(l) => [
                stat(&l.us_per_call),
                format!("{} / {}", num(l.p50_us), num(l.p99_us)),
            ],
            None => ["n/a".into(), "n/a".into()],
        };
        let x = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}x"));
        let mut t = Table::new(&header, 1);
        for (r, p) in &pinged {
            let mut row = vec![r.transport.clone()];
            if with_os {
                row.extend(lat(p.os.as_ref()));
            }
            if with_raw {
                row.extend(lat(p.raw.as_ref()));
            }
            row.extend(lat(Some(&p.rpc)));
            row.push(format!("{:.0}", p.rpc.calls_s.median));
            if with_raw {
                row.extend([x(p.latency_ratio), x(p.mean_latency_ratio)]);
            }
            if with_os {
                if with_raw {
                    row.push(x(p.raw_os_latency_ratio));
                }
                row.push(x(p.rpc_os_latency_ratio));
            }
            t.row(row);
        }
        if !pinged.is_empty() {
            t.render(out);
        }
        self.render_unavailable(out);
    }

    /// The throughput table, or why there is none.
    fn render_throughput(&self, out: &mut String) {
        if self.transports.iter().all(|r| r.cells.is_empty()) {
            out.push_str("Throughput: not measured (--ops ping only)\n");
        } else {
            let cells = || self.transports.iter().flat_map(|r| r.cells.iter());
            let with_raw = cells().any(|c| c.raw.is_some());
            let with_os = cells().any(|c| c.os.is_some());
            if with_raw {
                let raw = match self.settings.raw_twoway {
                    crate::measure::RawTwoway::Stream => "message stream on the backend connection (send/oneway: into a sink, recv: from a source, echo: echoed stream)",
                    crate::measure::RawTwoway::Exchange => "messages on the backend connection (oneway: into a sink; --raw-twoway exchange: send answered by an empty message each, recv asked for by a request each, echo echoed, the RPC window in flight)",
                };
                let _ = writeln!(out, "Throughput in Mbit/s of payload: raw = {raw}; util = median over the runs of rpc / raw measured back to back");
            } else {
                out.push_str("Throughput in Mbit/s of payload of RPC calls; raw, util and os: not measured (--only rpc)\n");
            }
            if with_os {
                out.push_str("os = blocking OS socket stream of writes of the size into a reading sink, one thread, no runtime (beside send and oneway at 1 thread; - where there is none); raw/os, rpc/os = median over the runs of raw / os and rpc / os measured back to back\n");
                if self.transports.iter().any(|r| {
                    r.os_baseline.kind == BaselineKind::Link
                        && r.cells.iter().any(|c| c.os.is_some())
                }) {
                    out.push_str("  for verbs, os = the link: RDMA READs of the size, 32 in flight, through this crate's binding (ib_read_bw-style)\n");
                }
            }
            let mut header = vec!["transport", "op", "size", "threads", "window"];
            if with_os {
                header.push("os Mbit/s");
            }
            if with_raw {
                header.push("raw Mbit/s");
            }
            header.extend(["rpc Mbit/s", "rpc calls/s"]);
            if with_raw {
                header.push("util");
            }
            if with_os {
                if with_raw {
                    header.push("raw/os");
                }
                header.push("rpc/os");
            }
            let mut t = Table::new(&header, 2);
            let pct = |v: f64| format!("{:.0}%", v * 100.0);
            for r in &self.transports {
                // "n/a": this transport has no OS baseline (or no raw figures); "-": this row
                // has no OS twin.
                let none = if r.os_baseline.measured() { "-" } else { "n/a" };
                for c in &r.cells {
                    let mut row = vec![
                        r.transport.clone(),
                        c.op.name().to_string(),
                        size_label(c.size),
                        c.threads.to_string(),
                        c.window.to_string(),
                    ];
                    if with_os {
                        row.push(c.os.as_ref().map_or(none.into(), |f| stat(&f.mbit_s)));
                    }
                    if with_raw {
                        row.push(c.raw.as_ref().map_or("n/a".into(), |f| stat(&f.mbit_s)));
                    }
                    row.extend([stat(&c.rpc.mbit_s), format!("{:.0}", c.rpc.calls_s.median)]);
                    if with_raw {
                        row.push(c.utilization.map_or("n/a".into(), pct));
                    }
                    if with_os {
                        if with_raw {
                            row.push(c.raw_os_utilization.map_or(none.into(), pct));
                        }
                        row.push(c.rpc_os_utilization.map_or(none.into(), pct));
                    }
                    t.row(row);
                }
            }
            t.render(out);
        }
    }

    /// The transports that could not be measured, and why.
    fn render_unavailable(&self, out: &mut String) {
        for u in &self.unavailable {
            let _ = writeln!(out, "  {:<9}  not available: {}", u.transport, u.reason);
        }
    }

    /// The diagnosis table and its verdicts, or why there is none.
    fn render_diagnosis(&self, out: &mut String) {
        if !self.diagnosis.is_empty() {
            out.push('\n');
            out.push_str(
                "Diagnosis (copies: client and in-process server; other counters: client side; CPU: the whole process)\n",
            );
            let mut t = Table::new(
                &[
                    "transport",
                    "basis",
                    "util",
                    "copies B/B rpc (raw)",
                    "faults/call rpc (raw)",
                    "syscalls/call rpc (raw)",
                    "switches/call rpc (raw)",
                    "regs/call",
                    "mean in flight",
                    "CPU ms/GB rpc (raw)",
                    "CPU µs/ping rpc (raw)",
                ],
                2,
            );
            for d in &self.diagnosis {
                t.row(vec![
                    d.transport.clone(),
                    d.basis.clone(),
                    format!("{:.0}%", d.utilization * 100.0),
                    format!("{:.2} ({:.2})", d.copies_per_byte, d.raw_copies_per_byte),
                    format!(
                        "{:.1} ({:.1})",
                        d.page_faults_per_call, d.raw_page_faults_per_call
                    ),
                    format!(
                        "{:.2} ({:.2})",
                        d.syscalls_per_call, d.raw_syscalls_per_call
                    ),
                    format!(
                        "{:.2} ({:.2})",
                        d.context_switches_per_call, d.raw_context_switches_per_call
                    ),
                    format!("{:.2}", d.registrations_per_call),
                    format!("{:.1}", d.mean_in_flight),
                    format!("{:.0} ({:.0})", d.cpu_ms_per_gb, d.raw_cpu_ms_per_gb),
                    if d.ping_cpu_us == (0.0, 0.0) {
                        "-".to_string()
                    } else {
                        format!("{:.1} ({:.1})", d.ping_cpu_us.0, d.ping_cpu_us.1)
                    },
                ]);
            }
            t.render(out);
            for d in &self.diagnosis {
                let _ = writeln!(out, "  {}", d.verdict);
                if let Some(l) = &d.latency_verdict {
                    let _ = writeln!(out, "  {l}");
                }
            }
        } else if !self.settings.raw() {
            out.push_str(
                "\nDiagnosis: none (it sets RPC against raw, which --only rpc does not measure)\n",
            );
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
