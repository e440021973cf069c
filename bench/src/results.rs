//! The results page: one recorded run rendered as `docs/results/results.md` (tables), its
//! JSON (`results.json`, from which everything else is rendered), an SVG plot, and the
//! README's headline block between [`BEGIN`] and [`END`].
//!
//! `cargo xtask bench --record` measures and calls `bench results write`; `bench results
//! check` (and this module's test, which CI runs) renders the page and the block again from the
//! committed JSON and fails when a file differs: figures change only through the command.

use crate::machine::Machine;
use crate::report::{num, size_label, Report};
use crate::suite::{BaselineKind, Cell, TransportReport};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// How `bench merge` and `bench results write` describe the machine the guest's rows come from.
pub(crate) const MERGE_MACHINE: &str = "in the soft-RoCE guest under QEMU software emulation";

/// The line that opens the README's generated block.
pub const BEGIN: &str = "<!-- BEGIN results -->";
/// The line that closes it.
pub const END: &str = "<!-- END results -->";
/// The page's file name in the results directory.
pub const PAGE: &str = "results.md";
/// The recorded run's file name in the results directory.
pub const JSON: &str = "results.json";
/// The plot's file name in the results directory.
pub const PLOT: &str = "throughput.svg";

/// One recorded run: everything the page and the README block are rendered from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// When it was recorded (`YYYY-MM-DD HH:MM UTC`).
    pub generated: String,
    /// The commit it measured (`abc1234`, `+ uncommitted changes` when the tree was dirty).
    pub commit: String,
    /// The command that recorded it.
    pub command: String,
    /// The report: this machine's transports, and the guest's marked `NAME*`.
    pub report: Report,
    /// The soft-RoCE guest's part, when verbs was measured there.
    pub guest: Option<GuestRun>,
}

/// What the soft-RoCE guest measured beside the bench.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GuestRun {
    /// The guest machine, as its own report described it.
    pub machine: Option<Machine>,
    /// perftest's result rows of the same boot.
    pub perftest: Vec<PerftestFigure>,
}

/// One perftest result row: the step that ran it and its header and values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PerftestFigure {
    /// The test bed's step name (`perftest:ib_send_bw-64K`).
    pub step: String,
    /// perftest's header and result row, `HEADER | VALUES`.
    pub figure: String,
}

impl PerftestFigure {
    /// perftest's average bandwidth, Gbit/s (the `BW average` column of a `_bw` test).
    fn gbit_s(&self) -> Option<f64> {
        let (header, values) = self.figure.split_once(" | ")?;
        header.contains("BW average").then_some(())?;
        values.split_whitespace().nth(3)?.parse().ok()
    }

    /// perftest's typical latency, µs (the `t_typical` column of a `_lat` test: half a round
    /// trip).
    fn t_typical_us(&self) -> Option<f64> {
        let (header, values) = self.figure.split_once(" | ")?;
        let col = header
            .split_whitespace()
            .position(|h| h.starts_with("t_typical"))?;
        values.split_whitespace().nth(col)?.parse().ok()
    }

    fn named(figures: &[PerftestFigure], step: &str) -> Option<PerftestFigure> {
        figures
            .iter()
            .find(|f| f.step == format!("perftest:{step}"))
            .cloned()
    }
}

/// A Markdown table.
struct Md {
    out: String,
}

impl Md {
    fn new(header: &[&str], right_from: usize) -> Md {
        let mut out = format!("| {} |\n|", header.join(" | "));
        for c in 0..header.len() {
            out.push_str(if c < right_from { "---|" } else { "---:|" });
        }
        out.push('\n');
        Md { out }
    }

    fn row(&mut self, cells: &[String]) {
        let _ = writeln!(self.out, "| {} |", cells.join(" | "));
    }
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:.0}%", v * 100.0))
}

fn times(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"))
}

/// The limit a transport is measured against, for a column: `os` or `link`.
fn limit(t: &TransportReport) -> &'static str {
    if t.os_baseline.kind == BaselineKind::NotMeasured {
        "-"
    } else {
        t.os_baseline.kind.column()
    }
}

/// The one-thread cells of the headline, in the report's order of ops and sizes.
fn headline_cells(r: &Report) -> Vec<(crate::measure::Op, usize)> {
    let mut out = Vec::new();
    for op in &r.settings.ops {
        for &size in &r.settings.sizes {
            let present = r.transports.iter().any(|t| {
                t.cells
                    .iter()
                    .any(|c| c.op == *op && c.size == size && c.threads == 1)
            });
            if present && !out.contains(&(*op, size)) {
                out.push((*op, size));
            }
        }
    }
    out
}

fn short_size(n: usize) -> String {
    size_label(n).replace(" KiB", "K").replace(" MiB", "M")
}

/// The headline table: per transport, RPC `void o()` against the limit and raw, and RPC / raw
/// (RPC / limit) of the one-thread throughput cells.
fn headline(r: &Report) -> String {
    let cells = headline_cells(r);
    let mut header: Vec<String> = vec![
        "transport".into(),
        "limit".into(),
        "RPC `void o()` p50".into(),
        "RPC / limit".into(),
        "RPC / raw".into(),
    ];
    header.extend(
        cells
            .iter()
            .map(|(op, size)| format!("{} {}", op.name(), short_size(*size))),
    );
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut t = Md::new(&header, 2);
    for tr in &r.transports {
        let mut row = vec![format!("{}", tr.transport), limit(tr).to_string()];
        match &tr.ping {
            Some(p) => {
                let limit_p50 = p.os.as_ref().map(|o| o.p50_us);
                row.push(match limit_p50 {
                    Some(l) => format!("{} µs ({} µs)", num(p.rpc.p50_us), num(l)),
                    None => format!("{} µs", num(p.rpc.p50_us)),
                });
                row.push(times(p.rpc_os_latency_ratio));
                row.push(times(p.latency_ratio));
            }
            None => row.extend(["-".into(), "-".into(), "-".into()]),
        }
        for (op, size) in &cells {
            let cell = tr
                .cells
                .iter()
                .find(|c| c.op == *op && c.size == *size && c.threads == 1);
            row.push(match cell {
                Some(c) if c.rpc_os_utilization.is_some() => {
                    format!("{} ({})", pct(c.utilization), pct(c.rpc_os_utilization))
                }
                Some(c) => pct(c.utilization),
                None => "-".into(),
            });
        }
        t.row(&row);
    }
    t.out
}

/// What the headline's columns mean, in one paragraph.
fn headline_legend(r: &Report) -> String {
    let mut s = String::from(
        "`limit`: what the machine does without the project, measured in the same run: `os` = \
         blocking OS sockets with no runtime (a 1-byte ping-pong, a stream of writes), `link` = \
         the verbs link itself (a busy-polled SEND ping-pong and an RDMA READ stream, as \
         perftest measures it). Latency: median round trip of RPC `void o()`, with the limit's \
         in brackets, and RPC's p50 as a multiple of the limit's and of the raw connection's. \
         Throughput: RPC Mbit/s as a share of the raw connection's (RPC / raw), and of the \
         limit's in brackets where it was measured, one client thread.",
    );
    if r.transports.iter().any(|t| t.emulated.is_some()) {
        s.push_str(
            " `*`: measured in an emulated machine (soft-RoCE under QEMU): compare its ratios, \
             not its absolute figures.",
        );
    }
    s
}

fn machine_line(r: &Report) -> String {
    r.machine
        .as_ref()
        .map_or_else(|| "an unrecorded machine".into(), Machine::summary)
}

/// The README's block, markers included.
pub fn readme_block(rec: &Record) -> String {
    let r = &rec.report;
    let mut s = String::new();
    let _ = writeln!(s, "{BEGIN}");
    let _ = writeln!(
        s,
        "<!-- generated by `cargo xtask bench --record` from docs/results/{JSON}: do not edit -->"
    );
    s.push_str(&headline(r));
    s.push('\n');
    let _ = writeln!(s, "{}", headline_legend(r));
    s.push('\n');
    let _ = writeln!(s, "![throughput and utilization](docs/results/{PLOT})");
    s.push('\n');
    let _ = writeln!(
        s,
        "Recorded {} at {} on {}{}. Every figure, the settings and the diagnosis: \
         [docs/results/results.md](docs/results/results.md).",
        rec.generated,
        rec.commit,
        machine_line(r),
        if rec.guest.is_some() {
            "; `verbs*` in the soft-RoCE guest on the same machine"
        } else {
            ""
        }
    );
    let _ = writeln!(s, "{END}");
    s
}

fn latency_table(r: &Report) -> String {
    let mut t = Md::new(
        &[
            "transport",
            "limit",
            "limit p50 / p99 µs",
            "raw p50 / p99 µs",
            "RPC p50 / p99 µs",
            "RPC calls/s",
            "RPC / raw",
            "raw / limit",
            "RPC / limit",
        ],
        2,
    );
    for tr in &r.transports {
        let Some(p) = &tr.ping else { continue };
        let pair = |l: Option<&crate::suite::Latency>| {
            l.map_or_else(
                || "-".into(),
                |l| format!("{} / {}", num(l.p50_us), num(l.p99_us)),
            )
        };
        t.row(&[
            tr.transport.clone(),
            limit(tr).into(),
            pair(p.os.as_ref()),
            pair(p.raw.as_ref()),
            pair(Some(&p.rpc)),
            format!("{:.0}", p.rpc.calls_s.median),
            times(p.latency_ratio),
            times(p.raw_os_latency_ratio),
            times(p.rpc_os_latency_ratio),
        ]);
    }
    t.out
}

fn throughput_table(r: &Report) -> String {
    let mut t = Md::new(
        &[
            "transport",
            "op",
            "size",
            "threads",
            "window",
            "limit Mbit/s",
            "raw Mbit/s",
            "RPC Mbit/s",
            "RPC / raw",
            "raw / limit",
            "RPC / limit",
        ],
        2,
    );
    let mbit = |f: Option<&crate::suite::Figures>| {
        f.map_or_else(|| "-".into(), |f| crate::report::stat(&f.mbit_s))
    };
    for tr in &r.transports {
        for c in &tr.cells {
            let Cell {
                op,
                size,
                threads,
                window,
                ..
            } = c;
            t.row(&[
                tr.transport.clone(),
                op.name().into(),
                size_label(*size),
                threads.to_string(),
                window.to_string(),
                mbit(c.os.as_ref()),
                mbit(c.raw.as_ref()),
                mbit(Some(&c.rpc)),
                pct(c.utilization),
                pct(c.raw_os_utilization),
                pct(c.rpc_os_utilization),
            ]);
        }
    }
    t.out
}

/// The verbs rows against perftest of the same boot: the bench's link round trip and RPC
/// `void o()` against `ib_send_lat`'s, RPC send against `ib_send_bw` (64 KiB) and
/// `ib_write_bw` (1 MiB), echo against half of bidirectional `ib_write_bw`.
fn perftest_section(rec: &Record) -> Option<String> {
    let g = rec.guest.as_ref()?;
    let mut s = String::new();
    let mut t = Md::new(&["step", "perftest's result row"], 2);
    for f in &g.perftest {
        // A `|` ends a Markdown table cell even inside code: escaped.
        t.row(&[
            format!("`{}`", f.step),
            format!("`{}`", f.figure.replace('|', "\\|")),
        ]);
    }
    s.push_str(&t.out);
    let verbs = rec
        .report
        .transports
        .iter()
        .find(|t| t.emulated.is_some())?;
    let mut cmp = Md::new(&["verbs*", "bench", "perftest", "bench / perftest"], 1);
    let mut rows = 0;
    if let (Some(p), Some(lat)) = (
        &verbs.ping,
        PerftestFigure::named(&g.perftest, "ib_send_lat-2B").and_then(|f| f.t_typical_us()),
    ) {
        let rt = 2.0 * lat;
        for (what, v) in [
            ("link round trip p50", p.os.as_ref().map(|l| l.p50_us)),
            ("raw round trip p50", p.raw.as_ref().map(|l| l.p50_us)),
            ("RPC `void o()` p50", Some(p.rpc.p50_us)),
        ] {
            if let Some(v) = v {
                cmp.row(&[
                    what.into(),
                    format!("{} µs", num(v)),
                    format!("{} µs (2 x `ib_send_lat` t_typical)", num(rt)),
                    format!("{:.2}x", v / rt),
                ]);
                rows += 1;
            }
        }
    }
    let compare = [
        ("send", 65536, "ib_send_bw-64K", 1.0),
        ("send", 1 << 20, "ib_write_bw-1M", 1.0),
        ("oneway", 65536, "ib_send_bw-64K", 1.0),
        ("oneway", 1 << 20, "ib_write_bw-1M", 1.0),
        ("echo", 65536, "ib_write_bw-64K-bidirectional", 0.5),
        ("echo", 1 << 20, "ib_write_bw-1M-bidirectional", 0.5),
    ];
    for (op, size, step, share) in compare {
        let Some(c) = verbs
            .cells
            .iter()
            .find(|c| c.op.name() == op && c.size == size && c.threads == 1)
        else {
            continue;
        };
        let Some(gbit) = PerftestFigure::named(&g.perftest, step).and_then(|f| f.gbit_s()) else {
            continue;
        };
        let perf = gbit * 1000.0 * share;
        let half = if share < 1.0 { "half of " } else { "" };
        cmp.row(&[
            format!("RPC {op} {}", size_label(size)),
            format!("{} Mbit/s", num(c.rpc.mbit_s.median)),
            format!("{} Mbit/s ({half}`{step}`)", num(perf)),
            format!("{:.0}%", c.rpc.mbit_s.median / perf * 100.0),
        ]);
        rows += 1;
    }
    if rows > 0 {
        s.push('\n');
        s.push_str(&cmp.out);
    }
    Some(s)
}

/// The results page.
pub fn page(rec: &Record) -> String {
    let r = &rec.report;
    let mut s = String::new();
    let _ = writeln!(s, "# Results\n");
    let _ = writeln!(
        s,
        "<!-- generated by `cargo xtask bench --record` from {JSON}: do not edit; run the command again -->\n"
    );
    let _ = writeln!(
        s,
        "The project's current figures, all from one run of `cargo xtask bench --record` \
         ([how to read them](../bench.md)). A newer run replaces this page; older runs are in \
         its git history, investigations in [the lab notes](../notes/README.md). The run's data: \
         [{JSON}]({JSON}).\n"
    );
    let _ = writeln!(s, "## Machine and run\n");
    let _ = writeln!(s, "- Recorded: {}, commit {}.", rec.generated, rec.commit);
    let _ = writeln!(s, "- Command: `{}`.", rec.command);
    let _ = writeln!(s, "- Machine: {}.", machine_line(r));
    let _ = writeln!(s, "- Placement: {}.", r.placement.summary);
    if let Some(g) = &rec.guest {
        let guest = g
            .machine
            .as_ref()
            .map_or_else(|| "an unrecorded machine".into(), Machine::summary);
        let _ = writeln!(
            s,
            "- `verbs*`: measured in the soft-RoCE guest (QEMU software emulation on the machine \
             above, rdma_rxe): {guest}. Its figures compare with perftest's of the same boot \
             (below), not with the host's."
        );
    }
    let st = &r.settings;
    let _ = writeln!(
        s,
        "- Settings: {} run{} per figure (median, min-max); {} payload bytes per throughput run; \
         {} pings; RPC window up to {} calls and {} per client thread ({} on verbs).",
        st.repeat,
        if st.repeat == 1 { "" } else { "s" },
        size_label(st.bytes_per_run as usize),
        st.pings,
        st.window,
        size_label(st.window_bytes),
        size_label(st.verbs_window_bytes),
    );
    for u in &r.unavailable {
        let _ = writeln!(s, "- Not measured: {}: {}.", u.transport, u.reason);
    }
    let _ = writeln!(s, "\n## Headline\n");
    s.push_str(&headline(r));
    let _ = writeln!(s, "\n{}\n", headline_legend(r));
    let _ = writeln!(s, "![throughput and utilization]({PLOT})\n");
    let _ = writeln!(s, "## Latency\n");
    s.push_str(&latency_table(r));
    let _ = writeln!(
        s,
        "\nRound trips, µs: `limit` as in the headline; raw = 1-byte ping-pong on the backend \
         connection; RPC = `void o()`. Ratios are of p50s.\n"
    );
    let _ = writeln!(s, "## Throughput\n");
    s.push_str(&throughput_table(r));
    let _ = writeln!(
        s,
        "\nMbit/s of payload, median (min-max) over the runs; ratios are medians of runs \
         measured back to back. `limit` is measured beside send and oneway at one thread.\n"
    );
    if let Some(p) = perftest_section(rec) {
        let _ = writeln!(s, "## verbs against perftest (same guest boot)\n");
        s.push_str(&p);
        s.push('\n');
    }
    if !r.diagnosis.is_empty() {
        let _ = writeln!(s, "## Diagnosis\n");
        for d in &r.diagnosis {
            let _ = writeln!(s, "- {}", d.verdict);
            if let Some(l) = &d.latency_verdict {
                let _ = writeln!(s, "- {l}");
            }
        }
        s.push('\n');
    }
    let notes: Vec<&String> = r.transports.iter().flat_map(|t| &t.notes).collect();
    if !notes.is_empty() {
        let _ = writeln!(s, "## Notes of the run\n");
        for n in notes {
            let _ = writeln!(s, "- {n}");
        }
        s.push('\n');
    }
    while s.ends_with("\n\n") {
        s.pop();
    }
    s
}

/// The record as written to and read from [`JSON`].
fn to_json(rec: &Record) -> Result<String, String> {
    serde_json::to_string_pretty(rec)
        .map(|s| s + "\n")
        .map_err(|e| e.to_string())
}

fn read_record(dir: &Path) -> Result<Record, String> {
    let path = dir.join(JSON);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a results record: {e}", path.display()))
}

/// `text` with its block between [`BEGIN`] and [`END`] (markers included) replaced by `block`.
fn replace_block(text: &str, block: &str) -> Result<String, String> {
    let (start, end) = block_span(text)?;
    Ok(format!("{}{block}{}", &text[..start], &text[end..]))
}

/// Byte span of the block, from the start of the [`BEGIN`] line to after the [`END`] line.
fn block_span(text: &str) -> Result<(usize, usize), String> {
    let count = |m: &str| text.lines().filter(|l| l.trim() == m).count();
    if count(BEGIN) != 1 || count(END) != 1 {
        return Err(format!(
            "the README must hold exactly one `{BEGIN}` line and one `{END}` line (found {} and {})",
            count(BEGIN),
            count(END)
        ));
    }
    let start = text.find(BEGIN).ok_or("no begin marker")?;
    let end_at = text.find(END).ok_or("no end marker")?;
    if end_at < start {
        return Err(format!("`{END}` comes before `{BEGIN}`"));
    }
    let end = text[end_at..]
        .find('\n')
        .map_or(text.len(), |i| end_at + i + 1);
    Ok((start, end))
}

/// Writes the record's JSON, page and plot into `dir` and its block into `readme`.
pub fn write(rec: &Record, dir: &Path, readme: &Path) -> Result<(), String> {
    let json = to_json(rec)?;
    // Render from what the file holds, so a later check reads the very same numbers.
    let rec: Record = serde_json::from_str(&json).map_err(|e| e.to_string())?;
    let readme_text =
        std::fs::read_to_string(readme).map_err(|e| format!("{}: {e}", readme.display()))?;
    let new_readme = replace_block(&readme_text, &readme_block(&rec))
        .map_err(|e| format!("{}: {e}", readme.display()))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let put = |name: &str, text: &str| -> Result<(), String> {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))
    };
    put(JSON, &json)?;
    put(PAGE, &page(&rec))?;
    crate::plot::write_svg(&rec.report, &dir.join(PLOT))?;
    std::fs::write(readme, new_readme).map_err(|e| format!("{}: {e}", readme.display()))
}

/// Fails unless `dir`'s page and plot and `readme`'s block are what `dir`'s JSON renders to.
pub fn check(dir: &Path, readme: &Path) -> Result<(), String> {
    let rec = read_record(dir)?;
    let mut wrong = Vec::new();
    let mut compare = |path: PathBuf, expected: String, actual: Result<String, String>| match actual
    {
        Ok(actual) if actual == expected => {}
        Ok(actual) => {
            let line = expected
                .lines()
                .zip(actual.lines())
                .position(|(a, b)| a != b)
                .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
            wrong.push(format!(
                "{} differs from what {} renders to (first at line {}): edited by hand? \
                     run `cargo xtask bench --record`",
                path.display(),
                dir.join(JSON).display(),
                line + 1
            ));
        }
        Err(e) => wrong.push(e),
    };
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    compare(dir.join(PAGE), page(&rec), read(&dir.join(PAGE)));
    let block = read(readme).and_then(|t| {
        let (a, b) = block_span(&t).map_err(|e| format!("{}: {e}", readme.display()))?;
        Ok(t[a..b].to_string())
    });
    compare(readme.to_path_buf(), readme_block(&rec), block);
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let plot = tmp.path().join(PLOT);
    let rendered = crate::plot::write_svg(&rec.report, &plot).and_then(|()| read(&plot));
    match rendered {
        Ok(svg) => compare(dir.join(PLOT), svg, read(&dir.join(PLOT))),
        Err(e) => wrong.push(e),
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("\n"))
    }
}

/// `bench results write`: the host's report, the guest's (optional) and perftest's rows of the
/// guest's boot (optional: `STEP<TAB>FIGURE` lines) into one record, written out.
pub fn write_from_files(a: &WriteArgs) -> Result<(), String> {
    let read = |path: &Path| -> Result<Report, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| format!("{}: not a bench JSON report: {e}", path.display()))
    };
    let mut report = read(&a.host)?;
    let guest = match &a.guest {
        Some(path) => {
            let g = read(path)?;
            let machine = g.machine.clone();
            report.merge_emulated(g, MERGE_MACHINE);
            let perftest = match &a.perftest {
                Some(p) => std::fs::read_to_string(p)
                    .map_err(|e| format!("{}: {e}", p.display()))?
                    .lines()
                    .filter_map(|l| l.split_once('\t'))
                    .map(|(step, figure)| PerftestFigure {
                        step: step.into(),
                        figure: figure.into(),
                    })
                    .collect(),
                None => Vec::new(),
            };
            Some(GuestRun { machine, perftest })
        }
        None => None,
    };
    let rec = Record {
        generated: a.generated.clone(),
        commit: a.commit.clone(),
        command: a.command.clone(),
        report,
        guest,
    };
    write(&rec, &a.dir, &a.readme)?;
    println!(
        "results written to {} and the block of {}",
        a.dir.display(),
        a.readme.display()
    );
    Ok(())
}

/// Arguments of `bench results write`.
#[derive(Debug, clap::Args)]
pub struct WriteArgs {
    /// This machine's report (`--json-out`).
    #[arg(long)]
    pub host: PathBuf,
    /// The soft-RoCE guest's report, whose rows are merged marked `NAME*`.
    #[arg(long)]
    pub guest: Option<PathBuf>,
    /// perftest's rows of the guest's boot, one `STEP<TAB>FIGURE` per line.
    #[arg(long, requires = "guest")]
    pub perftest: Option<PathBuf>,
    /// When the run was recorded.
    #[arg(long)]
    pub generated: String,
    /// The commit measured.
    #[arg(long)]
    pub commit: String,
    /// The command that recorded it.
    #[arg(long, default_value = "cargo xtask bench --record")]
    pub command: String,
    /// The results directory.
    #[arg(long, default_value = "docs/results")]
    pub dir: PathBuf,
    /// The README whose block is replaced.
    #[arg(long, default_value = "README.md")]
    pub readme: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::{report, transport};

    fn repo() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    /// The committed results page, plot and README block are what the committed JSON renders
    /// to: a hand edit of a figure fails here (and so in CI).
    #[test]
    fn the_committed_results_match_their_json() {
        let root = repo();
        check(&root.join("docs/results"), &root.join("README.md")).unwrap();
    }

    fn record() -> Record {
        Record {
            generated: "2026-01-02 03:04 UTC".into(),
            commit: "0123abc".into(),
            command: "cargo xtask bench --record".into(),
            report: report(vec![transport("uds", true), transport("tcp", false)]),
            guest: None,
        }
    }

    #[test]
    fn write_then_check_passes_and_a_hand_edit_fails() {
        let dir = tempfile::tempdir().unwrap();
        let readme = dir.path().join("README.md");
        std::fs::write(
            &readme,
            format!("# T\n\nbefore\n{BEGIN}\nold\n{END}\nafter\n"),
        )
        .unwrap();
        let results = dir.path().join("results");
        write(&record(), &results, &readme).unwrap();
        check(&results, &readme).unwrap();
        let text = std::fs::read_to_string(&readme).unwrap();
        assert!(
            text.starts_with("# T\n\nbefore\n<!-- BEGIN results -->\n"),
            "{text}"
        );
        assert!(text.ends_with("<!-- END results -->\nafter\n"), "{text}");
        assert!(!text.contains("\nold\n"));
        assert!(text.contains("0123abc"));
        // A figure changed by hand in the README block fails the check.
        let edited = text.replacen("| uds |", "| uds (fast) |", 1);
        assert_ne!(edited, text, "the block names the transport");
        std::fs::write(&readme, edited).unwrap();
        let err = check(&results, &readme).unwrap_err();
        assert!(err.contains("README.md differs"), "{err}");
        // And so does an edit of the page.
        std::fs::write(&readme, text).unwrap();
        let page_path = results.join(PAGE);
        let p = std::fs::read_to_string(&page_path).unwrap();
        std::fs::write(&page_path, p.replacen("| uds |", "| uds* |", 1)).unwrap();
        let err = check(&results, &readme).unwrap_err();
        assert!(err.contains("results.md differs"), "{err}");
    }

    #[test]
    fn a_readme_without_markers_is_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let readme = dir.path().join("README.md");
        std::fs::write(&readme, "# T\n").unwrap();
        let err = write(&record(), &dir.path().join("r"), &readme).unwrap_err();
        assert!(err.contains(BEGIN), "{err}");
        std::fs::write(&readme, format!("{END}\n{BEGIN}\n")).unwrap();
        let err = write(&record(), &dir.path().join("r"), &readme).unwrap_err();
        assert!(err.contains("comes before"), "{err}");
    }

    #[test]
    fn perftest_rows_are_read_by_their_columns() {
        let bw = PerftestFigure {
            step: "perftest:ib_send_bw-64K".into(),
            figure: "#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps] | 65536 2000 0.45 0.44 0.000840".into(),
        };
        assert_eq!(bw.gbit_s(), Some(0.44));
        assert_eq!(bw.t_typical_us(), None);
        let lat = PerftestFigure {
            step: "perftest:ib_send_lat-2B".into(),
            figure: "#bytes #iterations t_min[usec] t_max[usec] t_typical[usec] t_avg[usec] t_stdev[usec] 99% percentile[usec] 99.9% percentile[usec] | 2 5000 9.12 80.3 11.19 12.0 2.1 20.0 60.1".into(),
        };
        assert_eq!(lat.t_typical_us(), Some(11.19));
        assert_eq!(lat.gbit_s(), None);
    }
}
