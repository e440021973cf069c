//! The SVG plots.
//!
//! [`write_svg`] draws the main comparison (`bench --plot FILE.svg`) of one operation (`send`,
//! or the first one measured): one row per client thread count, each with two panels against
//! the message size (log scale) and a legend naming every line of the row:
//!
//! - payload Mbit/s of raw (dashed, rings), RPC (solid, dots) and, where measured (one
//!   thread, send and oneway), the OS's own sockets or, for verbs, the link (dotted,
//!   triangles), one colour per transport;
//! - utilization: RPC / raw (solid, dots), raw / os (dashed, rings) and RPC / os (dotted,
//!   crosses; `raw/link` and `rpc/link` for verbs), with a grey line at 100%.
//!
//! Legend labels name transport, series and thread count (`uds rpc send, 4 threads`). The
//! throughput panels share one y scale so rows compare directly; each utilization panel has
//! its own (at least 0..110%), so one outlier does not flatten the other rows. Size ticks sit
//! at the measured sizes and at powers of two, labelled `64K`, `1M` (K = 1024), never two
//! overlapping. The pieces below ([`Style`], [`Panel`], [`Figure`], the size ticks and the
//! legend) are shared with the `bench scenario` plots: a legend sample is drawn by the same
//! code as the line it names.

use crate::measure::Op;
use crate::report::Report;
use crate::suite::Cell;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::ops::Range;
use std::path::Path;

/// Line colours, one per transport (or per series where there is no transport).
pub(crate) const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// How the points of a series are joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Line {
    /// A solid line.
    Solid,
    /// A dashed line.
    Dashed,
    /// A dotted line.
    Dotted,
    /// Not joined: one bar per point (panels with a [`XAxis::Categories`] axis).
    Bars,
}

/// The marker drawn at every point of a line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Marker {
    /// A filled circle.
    Dot,
    /// A hollow circle.
    Ring,
    /// A filled triangle.
    Triangle,
    /// A cross.
    Cross,
}

/// How a series is drawn: the plot and its legend sample both follow it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Style {
    /// Colour of the line, markers or bars.
    pub color: RGBColor,
    /// How the points are joined.
    pub line: Line,
    /// Marker at every point (not drawn for bars).
    pub marker: Marker,
}

impl Style {
    /// The style with colour number `color` (of [`COLORS`], wrapping around).
    pub(crate) fn new(color: usize, line: Line, marker: Marker) -> Style {
        Style {
            color: COLORS[color % COLORS.len()],
            line,
            marker,
        }
    }
}

/// One line (or set of bars) of a panel.
#[derive(Clone, Debug)]
pub(crate) struct Series {
    /// Its legend label.
    pub label: String,
    /// How it is drawn.
    pub style: Style,
    /// (x, y) points, drawn in this order.
    pub points: Vec<(f64, f64)>,
}

/// The x axis of a panel.
#[derive(Clone, Debug)]
pub(crate) enum XAxis {
    /// Message sizes in bytes on a log scale, ticked at the `measured` sizes and at powers
    /// of two, labelled 1K, 64K, 1M (see [`size_tick`]); no two labels overlap.
    Sizes {
        /// Sizes that get a tick first (may be empty: powers of two only).
        measured: Vec<f64>,
    },
    /// Counts on a linear scale from 0, ticked at the x values of the points.
    Counts,
    /// Named categories at x = 0, 1, 2, ...: one group of bars per category.
    Categories(Vec<String>),
}

/// How the y tick labels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum YFormat {
    /// Plain numbers.
    Number,
    /// Ratios printed as percentages (1.0 = 100%).
    Percent,
}

/// One chart of a figure.
#[derive(Clone, Debug)]
pub(crate) struct Panel {
    /// Caption above the chart.
    pub title: String,
    /// Heading of this panel's entries in the row's legend (none: entries without heading).
    pub legend_title: Option<String>,
    /// The x axis.
    pub x: XAxis,
    /// Description under the x axis.
    pub x_desc: String,
    /// Description beside the y axis.
    pub y_desc: String,
    /// How the y ticks read.
    pub y_format: YFormat,
    /// Top of the y axis (shared between panels); default: 110% of the largest y.
    pub y_max: Option<f64>,
    /// A grey horizontal reference line at this y (e.g. 100% utilization).
    pub reference: Option<f64>,
    /// Relative width in its row.
    pub weight: u32,
    /// What it draws.
    pub series: Vec<Series>,
}

/// A whole SVG: a caption, then rows of panels, each row with the legend of its panels at
/// the right.
#[derive(Clone, Debug)]
pub(crate) struct Figure {
    /// Caption at the top.
    pub caption: String,
    /// The rows, top to bottom.
    pub rows: Vec<Vec<Panel>>,
}

const WIDTH: u32 = 1240;
const LEGEND_WIDTH: u32 = 270;
const ROW_MIN_HEIGHT: u32 = 300;
const LEGEND_ENTRY: i32 = 17;
const LEGEND_TOP: i32 = 34;
const Y_LABEL_AREA: u32 = 64;
const MARGIN: u32 = 10;
const FONT: &str = "sans-serif";
/// Approximate width of one character of a 12 px tick label, and the least gap between two.
const CHAR_PX: f64 = 7.0;
const TICK_GAP_PX: f64 = 10.0;

/// The label of a size tick: multiples of 1 MiB as `1M`, of 1 KiB as `64K` (K = 1024,
/// M = 1048576), other sizes as their exact byte count (`500000`).
pub(crate) fn size_tick(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

/// The labels a size tick may take, best first: [`size_tick`], and for a size of 10 KiB or
/// more that is not a multiple of 1 KiB also the shorter rounded `488K` (for 500000), used
/// when the exact one has no room.
fn size_tick_labels(v: f64) -> Vec<String> {
    let n = v.round() as usize;
    let mut labels = vec![size_tick(n)];
    if n >= 10 << 10 && n % 1024 != 0 {
        labels.push(format!("{}K", (v / 1024.0).round()));
    }
    labels
}

/// Ticks and their labels on a log axis of sizes from `lo` to `hi`, `px` pixels wide: the
/// measured sizes first (multiples of 1 KiB before the others), then powers of two, every
/// octave or every few so their labels fit; a candidate whose label would overlap one already
/// chosen is left out. Sorted by size.
pub(crate) fn size_ticks(lo: f64, hi: f64, measured: &[f64], px: f64) -> Vec<(f64, String)> {
    let span = (hi / lo).ln().max(1e-9);
    let pos = |v: f64| (v / lo).ln() / span * px;
    let mut sorted: Vec<f64> = measured
        .iter()
        .copied()
        .filter(|&v| v >= lo && v <= hi)
        .collect();
    sorted.sort_by(f64::total_cmp);
    sorted.dedup();
    let round = |v: &f64| (*v as usize) % 1024 == 0;
    let mut candidates: Vec<f64> = sorted.iter().copied().filter(round).collect();
    candidates.extend(sorted.iter().copied().filter(|v| !round(v)));
    let octaves = (hi / lo).log2().max(1e-9);
    let per_octave = px / octaves;
    let step = ((4.0 * CHAR_PX + TICK_GAP_PX) / per_octave).ceil().max(1.0) as i32;
    let (first, last) = (lo.log2().ceil() as i32, hi.log2().floor() as i32);
    candidates.extend(
        (first.max(0)..=last)
            .filter(|e| e % step == 0)
            .map(|e| 2f64.powi(e)),
    );
    let mut ticks = spaced(candidates, pos, size_tick_labels);
    ticks.sort_by(|a, b| a.0.total_cmp(&b.0));
    ticks
}

/// The candidates, in order, that keep their labels apart at positions `pos`, each with the
/// first of its `labels` that fits.
fn spaced(
    candidates: impl IntoIterator<Item = f64>,
    pos: impl Fn(f64) -> f64,
    labels: impl Fn(f64) -> Vec<String>,
) -> Vec<(f64, String)> {
    let width = |l: &str| l.chars().count() as f64 * CHAR_PX;
    let mut ticks: Vec<(f64, String)> = Vec::new();
    for v in candidates {
        let fits = |l: &String| {
            ticks.iter().all(|(t, tl)| {
                (pos(v) - pos(*t)).abs() >= (width(l) + width(tl)) / 2.0 + TICK_GAP_PX
            })
        };
        if let Some(l) = labels(v).into_iter().find(fits) {
            ticks.push((v, l));
        }
    }
    ticks
}

/// The label `ticks` gives `v`, else `fallback`'s.
fn tick_label(ticks: &[(f64, String)], v: f64, fallback: impl Fn(f64) -> String) -> String {
    ticks
        .iter()
        .find(|(t, _)| (t - v).abs() <= 1e-9 * t.abs().max(1.0))
        .map_or_else(|| fallback(v), |(_, l)| l.clone())
}

/// An axis (log or linear) with the given ticks and light mesh lines, nothing else.
struct Ticked<R> {
    inner: R,
    ticks: Vec<f64>,
    light: Vec<f64>,
}

impl<R: Ranged<ValueType = f64>> Ranged for Ticked<R> {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(v, limit)
    }
    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.light.clone()
        } else {
            self.ticks.clone()
        }
    }
    fn range(&self) -> Range<f64> {
        self.inner.range()
    }
    fn axis_pixel_range(&self, limit: (i32, i32)) -> Range<i32> {
        self.inner.axis_pixel_range(limit)
    }
}

/// The line of a series through `points` (none for bars), in any coordinate type: the chart
/// and the legend sample are drawn by this same code.
fn stroke<DB: DrawingBackend, C: Clone + 'static>(
    points: Vec<C>,
    s: Style,
) -> Option<DynElement<'static, DB, C>> {
    let stroke = ShapeStyle::from(&s.color).stroke_width(2);
    match s.line {
        Line::Solid => Some(PathElement::new(points, stroke).into_dyn()),
        Line::Dashed => Some(DashedPathElement::new(points, 8, 5, stroke).into_dyn()),
        Line::Dotted => Some(DashedPathElement::new(points, 2, 4, stroke).into_dyn()),
        Line::Bars => None,
    }
}

/// The marker of a series at one point, in any coordinate type (see [`stroke`]).
fn mark<DB: DrawingBackend, C: Clone + 'static>(at: C, s: Style) -> DynElement<'static, DB, C> {
    match s.marker {
        Marker::Dot => Circle::new(at, 4, s.color.filled()).into_dyn(),
        Marker::Ring => Circle::new(at, 4, s.color.stroke_width(2)).into_dyn(),
        Marker::Triangle => TriangleMarker::new(at, 6, s.color.filled()).into_dyn(),
        Marker::Cross => Cross::new(at, 5, s.color.stroke_width(2)).into_dyn(),
    }
}

/// A y tick label, with as many decimals as an axis reaching `top` needs.
fn y_tick(v: f64, f: YFormat, top: f64) -> String {
    match f {
        YFormat::Percent => format!("{:.0}%", v * 100.0),
        YFormat::Number if top >= 20.0 => format!("{v:.0}"),
        YFormat::Number if top >= 2.0 => format!("{v:.1}"),
        YFormat::Number => format!("{v:.2}"),
    }
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn err(e: impl std::fmt::Display) -> String {
    format!("plot: {e}")
}

/// A part of a legend: its heading (if any) and its (label, style) entries.
type LegendSection = (Option<String>, Vec<(String, Style)>);

/// The entries of a row's legend: (heading, [(label, style)]), each label once.
fn legend_of(row: &[Panel]) -> Vec<LegendSection> {
    let mut seen: Vec<&str> = Vec::new();
    let mut sections = Vec::new();
    for p in row {
        let mut entries = Vec::new();
        for s in &p.series {
            if !seen.contains(&s.label.as_str()) {
                seen.push(&s.label);
                entries.push((s.label.clone(), s.style));
            }
        }
        if !entries.is_empty() {
            sections.push((p.legend_title.clone(), entries));
        }
    }
    sections
}

fn legend_lines(sections: &[LegendSection]) -> i32 {
    sections
        .iter()
        .map(|(h, e)| e.len() as i32 + i32::from(h.is_some()))
        .sum::<i32>()
        + sections.len() as i32
}

/// Draws a legend: per section a heading, then per entry a sample drawn like its series (the
/// same line and marker code) and the label.
fn draw_legend(area: &Area<'_>, sections: &[LegendSection]) -> Result<(), String> {
    let left =
        |size| TextStyle::from((FONT, size).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    let mut y = LEGEND_TOP;
    for (heading, entries) in sections {
        if let Some(h) = heading {
            area.draw_text(h, &left(13).color(&BLACK), (8, y))
                .map_err(err)?;
            y += LEGEND_ENTRY;
        }
        for (label, style) in entries {
            let (x0, x1) = (12, 46);
            if style.line == Line::Bars {
                area.draw(&Rectangle::new(
                    [(x0 + 8, y - 5), (x1 - 8, y + 5)],
                    style.color.filled(),
                ))
                .map_err(err)?;
            } else {
                if let Some(line) = stroke(vec![(x0, y), (x1, y)], *style) {
                    area.draw(&line).map_err(err)?;
                }
                area.draw(&mark(((x0 + x1) / 2, y), *style)).map_err(err)?;
            }
            area.draw_text(label, &left(12), (x1 + 8, y)).map_err(err)?;
            y += LEGEND_ENTRY;
        }
        y += LEGEND_ENTRY / 2;
    }
    Ok(())
}

/// Draws one panel into `area`.
fn draw_panel(area: &Area<'_>, p: &Panel) -> Result<(), String> {
    let plot_px = f64::from(area.dim_in_pixel().0) - f64::from(Y_LABEL_AREA + 3 * MARGIN);
    let xs = || p.series.iter().flat_map(|s| s.points.iter().map(|q| q.0));
    match &p.x {
        XAxis::Sizes { measured } => {
            let min = xs().fold(f64::INFINITY, f64::min).max(1.0);
            let max = xs().fold(1.0, f64::max).max(min);
            let (lo, hi) = (min / 1.5, max * 1.5);
            let labelled = size_ticks(lo, hi, measured, plot_px);
            let ticks: Vec<f64> = labelled.iter().map(|t| t.0).collect();
            let octaves = (hi / lo).log2();
            let light: Vec<f64> = if plot_px / octaves >= 8.0 {
                (lo.log2().ceil() as i32..=hi.log2().floor() as i32)
                    .map(|e| 2f64.powi(e))
                    .filter(|v| !ticks.contains(v))
                    .collect()
            } else {
                Vec::new()
            };
            let x = Ticked {
                inner: LogCoord::from((lo..hi).log_scale()),
                ticks,
                light,
            };
            chart(area, p, x, &|v| {
                tick_label(&labelled, *v, |v| size_tick(v.round() as usize))
            })
        }
        XAxis::Counts => {
            let max = xs().fold(1.0, f64::max) * 1.05;
            let mut values: Vec<f64> = xs().collect();
            values.sort_by(f64::total_cmp);
            values.dedup();
            let label = |v: f64| format!("{v:.0}");
            let ticks = spaced(values, |v| v / max * plot_px, |v| vec![label(v)]);
            let x = Ticked {
                inner: RangedCoordf64::from(0.0..max),
                ticks: ticks.iter().map(|t| t.0).collect(),
                light: Vec::new(),
            };
            chart(area, p, x, &|v| tick_label(&ticks, *v, label))
        }
        XAxis::Categories(names) => {
            let n = names.len().max(1) as f64;
            let x = Ticked {
                inner: RangedCoordf64::from(-0.5..n - 0.5),
                ticks: (0..names.len()).map(|i| i as f64).collect(),
                light: Vec::new(),
            };
            chart(area, p, x, &|v| {
                names
                    .get(v.round().max(0.0) as usize)
                    .cloned()
                    .unwrap_or_default()
            })
        }
    }
}

fn chart<R: Ranged<ValueType = f64>>(
    area: &Area<'_>,
    p: &Panel,
    x: Ticked<R>,
    x_tick: &dyn Fn(&f64) -> String,
) -> Result<(), String> {
    let ymax = p
        .y_max
        .unwrap_or_else(|| {
            p.series
                .iter()
                .flat_map(|s| s.points.iter().map(|q| q.1))
                .fold(0.0, f64::max)
                * 1.1
        })
        .max(1e-9);
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, (FONT, 15))
        .margin(MARGIN)
        .x_label_area_size(44)
        .y_label_area_size(Y_LABEL_AREA)
        .build_cartesian_2d(x, 0.0..ymax)
        .map_err(err)?;
    let y_format = p.y_format;
    chart
        .configure_mesh()
        .x_desc(&p.x_desc)
        .y_desc(&p.y_desc)
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .x_label_formatter(x_tick)
        .y_label_formatter(&|v| y_tick(*v, y_format, ymax))
        .y_labels(6)
        .y_max_light_lines(1)
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(205, 205, 205))
        .draw()
        .map_err(err)?;
    if let Some(r) = p.reference {
        let xr = chart.x_range();
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(xr.start, r), (xr.end, r)],
                RGBColor(130, 130, 130).stroke_width(1),
            )))
            .map_err(err)?;
    }
    let bars: Vec<&Series> = p
        .series
        .iter()
        .filter(|s| s.style.line == Line::Bars)
        .collect();
    let width = 0.8 / bars.len().max(1) as f64;
    for (j, s) in bars.iter().enumerate() {
        chart
            .draw_series(s.points.iter().map(|&(x, y)| {
                let x0 = x - 0.4 + j as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.92, y)], s.style.color.filled())
            }))
            .map_err(err)?;
    }
    for s in p.series.iter().filter(|s| s.style.line != Line::Bars) {
        chart
            .draw_series(stroke(s.points.clone(), s.style))
            .map_err(err)?;
        chart
            .draw_series(s.points.iter().map(|&at| mark(at, s.style)))
            .map_err(err)?;
    }
    Ok(())
}

/// Writes `fig` as an SVG file: the caption, then per row its panels (side by side, by
/// weight) and its legend at the right.
pub(crate) fn write_figure(fig: &Figure, path: &Path) -> Result<(), String> {
    let rows: Vec<&Vec<Panel>> = fig.rows.iter().filter(|r| !r.is_empty()).collect();
    if rows.is_empty() || rows.iter().all(|r| r.iter().all(|p| p.series.is_empty())) {
        return Err("nothing to plot: no figures were measured".into());
    }
    let legends: Vec<_> = rows.iter().map(|r| legend_of(r)).collect();
    let heights: Vec<u32> = legends
        .iter()
        .map(|l| ROW_MIN_HEIGHT.max((LEGEND_TOP + 10 + legend_lines(l) * LEGEND_ENTRY) as u32))
        .collect();
    let caption_height = 36;
    let height = caption_height + heights.iter().sum::<u32>();
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    let with_path = |e: String| format!("{} ({})", e, path.display());
    root.fill(&WHITE).map_err(err).map_err(with_path)?;
    let mut rest = root
        .titled(&fig.caption, (FONT, 17))
        .map_err(err)
        .map_err(with_path)?;
    for ((row, legend), h) in rows.iter().zip(&legends).zip(&heights) {
        let (area, below) = rest.split_vertically(*h);
        rest = below;
        let (panels, legend_area) = area.split_horizontally(WIDTH - LEGEND_WIDTH);
        let total: u32 = row.iter().map(|p| p.weight.max(1)).sum();
        let panels_width = WIDTH - LEGEND_WIDTH;
        let mut breaks = Vec::new();
        let mut acc = 0;
        for p in &row[..row.len() - 1] {
            acc += p.weight.max(1);
            breaks.push((panels_width * acc / total) as i32);
        }
        for (p, a) in row
            .iter()
            .zip(panels.split_by_breakpoints(breaks, [] as [i32; 0]))
        {
            draw_panel(&a, p).map_err(with_path)?;
        }
        draw_legend(&legend_area, legend).map_err(with_path)?;
    }
    root.present().map_err(err).map_err(with_path)?;
    Ok(())
}

/// "1 thread", "4 threads".
fn threads_label(n: usize) -> String {
    format!("{n} thread{}", if n == 1 { "" } else { "s" })
}

/// The figure of the main comparison (see the module documentation).
fn main_figure(report: &Report) -> Result<Figure, String> {
    let op = if report.settings.ops.contains(&Op::Send) {
        Op::Send
    } else {
        *report.settings.ops.first().ok_or("nothing to plot")?
    };
    let of_op = || {
        report
            .transports
            .iter()
            .flat_map(|t| t.cells.iter())
            .filter(move |c| c.op == op)
    };
    let mut threads: Vec<usize> = of_op().map(|c| c.threads).collect();
    threads.sort_unstable();
    threads.dedup();
    if threads.is_empty() {
        return Err("nothing to plot: no throughput cells were measured".into());
    }
    let mut sizes: Vec<f64> = of_op().map(|c| c.size as f64).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup();
    let mbit_max = of_op()
        .flat_map(|c| {
            [c.raw.as_ref(), Some(&c.rpc), c.os.as_ref()]
                .into_iter()
                .flatten()
                .map(|f| f.mbit_s.median)
        })
        .fold(1.0, f64::max)
        * 1.1;
    let mut rows = Vec::new();
    for &n in &threads {
        let tl = threads_label(n);
        let clients = format!("{n} client {}", if n == 1 { "thread" } else { "threads" });
        let (mut mbit, mut util) = (Vec::new(), Vec::new());
        for (i, t) in report.transports.iter().enumerate() {
            let mut cells: Vec<&Cell> = t
                .cells
                .iter()
                .filter(|c| c.op == op && c.threads == n)
                .collect();
            if cells.is_empty() {
                continue;
            }
            cells.sort_by_key(|c| c.size);
            let base = t.os_baseline.kind.column();
            let raw = format!("raw {}", cells[0].raw_op.name());
            let rpc = format!("rpc {}", op.name());
            type Value = fn(&Cell) -> Option<f64>;
            let lines: [(bool, String, Line, Marker, Value); 6] = [
                (false, raw, Line::Dashed, Marker::Ring, |c| {
                    c.raw.as_ref().map(|f| f.mbit_s.median)
                }),
                (false, rpc, Line::Solid, Marker::Dot, |c| {
                    Some(c.rpc.mbit_s.median)
                }),
                (false, base.into(), Line::Dotted, Marker::Triangle, |c| {
                    c.os.as_ref().map(|f| f.mbit_s.median)
                }),
                (true, "rpc/raw".into(), Line::Solid, Marker::Dot, |c| {
                    c.utilization
                }),
                (
                    true,
                    format!("raw/{base}"),
                    Line::Dashed,
                    Marker::Ring,
                    |c| c.raw_os_utilization,
                ),
                (
                    true,
                    format!("rpc/{base}"),
                    Line::Dotted,
                    Marker::Cross,
                    |c| c.rpc_os_utilization,
                ),
            ];
            for (is_ratio, what, line, marker, value) in lines {
                let points: Vec<(f64, f64)> = cells
                    .iter()
                    .filter_map(|c| value(c).map(|v| (c.size as f64, v)))
                    .collect();
                if points.is_empty() {
                    continue;
                }
                let series = Series {
                    label: format!("{} {what}, {tl}", t.transport),
                    style: Style::new(i, line, marker),
                    points,
                };
                if is_ratio {
                    util.push(series);
                } else {
                    mbit.push(series);
                }
            }
        }
        // Each row's own utilization scale (at least 0..110%, the grey line at 100%): one
        // noisy ratio in one row does not flatten the others.
        let util_max = util
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(1.0, f64::max)
            * 1.1;
        let x = XAxis::Sizes {
            measured: sizes.clone(),
        };
        let x_desc = "message size (bytes; K = 1024, M = 1048576)".to_string();
        let mut row = vec![Panel {
            title: format!("{} payload Mbit/s, {clients}", op.name()),
            legend_title: Some(format!("Mbit/s ({})", op.name())),
            x: x.clone(),
            x_desc: x_desc.clone(),
            y_desc: "Mbit/s".into(),
            y_format: YFormat::Number,
            y_max: Some(mbit_max),
            reference: None,
            weight: 3,
            series: mbit,
        }];
        // No utilization panel without raw or os figures (`--only rpc`): nothing to divide.
        if !util.is_empty() {
            row.push(Panel {
                title: format!("utilization, {clients}"),
                legend_title: Some("utilization".into()),
                x,
                x_desc,
                y_desc: "ratio".into(),
                y_format: YFormat::Percent,
                y_max: Some(util_max),
                reference: Some(1.0),
                weight: 2,
                series: util,
            });
        }
        rows.push(row);
    }
    let cores = |c: Option<usize>| c.map_or("-".to_string(), |c| c.to_string());
    Ok(Figure {
        caption: format!(
            "bench {}: {} Mbit/s {} vs message size per client thread count; window {}, CPUs client {} / server {}",
            report.placement.mode,
            op.name(),
            if report.settings.raw() {
                "and utilization"
            } else {
                "of RPC alone (--only rpc)"
            },
            report.settings.window,
            cores(report.placement.client_core),
            cores(report.placement.server_core),
        ),
        rows,
    })
}

/// Writes the plot of the `send` cells (or the first op measured): one row per client thread
/// count with the Mbit/s and the utilization against message size (see the module
/// documentation).
pub fn write_svg(report: &Report, path: &Path) -> Result<(), String> {
    write_figure(&main_figure(report)?, path)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::report::tests::{fig, report, transport};
    use crate::suite::TransportReport;

    /// The text of every `<text>` element of an SVG file (tick labels, titles, legend).
    pub(crate) fn labels(svg: &str) -> Vec<String> {
        let doc = roxmltree::Document::parse(svg).expect("the plot is well-formed XML");
        doc.descendants()
            .filter(|n| n.tag_name().name() == "text")
            .map(|n| n.text().unwrap_or_default().trim().to_string())
            .collect()
    }

    /// Whether some label holds six or more digits followed by " B" (a raw byte count,
    /// unreadable on an axis).
    pub(crate) fn has_raw_byte_count(labels: &[String]) -> bool {
        labels.iter().any(|l| {
            l.match_indices(" B")
                .any(|(i, _)| i >= 6 && l.as_bytes()[i - 6..i].iter().all(u8::is_ascii_digit))
        })
    }

    /// `name` measured at 64K, 500000 and 1M bytes x 1, 4 and 16 client threads (send), with
    /// the OS stream beside the cells of one thread when `with_os`.
    fn sweep(name: &str, with_os: bool) -> TransportReport {
        let mut t = transport(name, with_os);
        let send = t.cells[0].clone();
        t.cells = [1, 4, 16]
            .into_iter()
            .flat_map(|threads| {
                let send = send.clone();
                [64 << 10, 500_000, 1 << 20].map(move |size| {
                    let mut c = send.clone();
                    let scale = threads as f64 * size as f64 / 1e6;
                    (c.size, c.threads) = (size, threads);
                    (c.raw, c.rpc) = (Some(fig(3000.0 * scale)), fig(2000.0 * scale));
                    if threads > 1 {
                        (c.os, c.raw_os_utilization, c.rpc_os_utilization) = (None, None, None);
                    }
                    c
                })
            })
            .collect();
        t
    }

    #[test]
    fn size_ticks_read_like_sizes_and_keep_apart() {
        assert_eq!(size_tick(1024), "1K");
        assert_eq!(size_tick(64 << 10), "64K");
        assert_eq!(size_tick(1 << 20), "1M");
        assert_eq!(size_tick(16 << 20), "16M");
        assert_eq!(size_tick(1536 << 10), "1536K");
        assert_eq!(size_tick(500_000), "500000");
        assert_eq!(size_tick(64), "64");
        for (measured, px) in [
            (vec![1024.0, 65536.0, 500_000.0, 1048576.0], 480.0),
            (
                vec![
                    1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 500_000.0, 1048576.0,
                ],
                300.0,
            ),
            (vec![], 120.0),
        ] {
            let (lo, hi) = (1024.0 / 1.5, 1048576.0 * 1.5);
            let ticks = size_ticks(lo, hi, &measured, px);
            assert!(ticks.len() >= 2, "{ticks:?}");
            for (t, l) in &ticks {
                let n = *t as usize;
                assert!(measured.contains(t) || n.is_power_of_two(), "{t}");
                assert!(size_tick_labels(*t).contains(l), "{t} {l}");
            }
            // Neighbours are at least as far apart as their labels are wide.
            let x = |v: f64| (v / lo).ln() / (hi / lo).ln() * px;
            let w = |l: &str| l.len() as f64 * CHAR_PX;
            for p in ticks.windows(2) {
                let ((a, la), (b, lb)) = (&p[0], &p[1]);
                assert!(x(*b) - x(*a) >= (w(la) + w(lb)) / 2.0, "{ticks:?}");
            }
        }
        // The measured sizes are ticked first: with room, all of them, 500000 exactly; with
        // less room, 500000 rounded to K rather than left out.
        let measured = [1024.0, 65536.0, 262144.0, 500_000.0, 1048576.0];
        let at = |px| size_ticks(683.0, 1.6e6, &measured, px);
        for px in [1000.0, 480.0] {
            for m in measured {
                assert!(at(px).iter().any(|t| t.0 == m), "{:?}", at(px));
            }
        }
        assert!(at(1000.0).contains(&(500_000.0, "500000".into())));
        assert!(at(480.0).contains(&(500_000.0, "488K".into())));
    }

    /// The main plot draws every thread count (a row each, the legend names them), the
    /// utilization with raw/os and rpc/os where there are os figures, and reads its x axis
    /// in K and M.
    #[test]
    fn main_plot_has_every_thread_count_utilization_and_readable_ticks() {
        let mut verbs = sweep("verbs", true);
        verbs.os_baseline = crate::suite::Baseline::link();
        let mut r = report(vec![sweep("uds", true), sweep("tcp", false), verbs]);
        r.settings.sizes = vec![64 << 10, 500_000, 1 << 20];
        r.settings.threads = vec![1, 4, 16];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plot.svg");
        write_svg(&r, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let labels = labels(&svg);
        let has = |l: &str| labels.iter().any(|x| x == l);
        for (n, threads) in [(1, "1 thread"), (4, "4 threads"), (16, "16 threads")] {
            for t in ["uds", "tcp"] {
                for series in ["raw send", "rpc send", "rpc/raw"] {
                    let label = format!("{t} {series}, {threads}");
                    assert!(has(&label), "no {label:?} in {labels:?}");
                }
            }
            let clients = if n == 1 { "thread" } else { "threads" };
            assert!(has(&format!("send payload Mbit/s, {n} client {clients}")));
        }
        // The OS figures and the ratios against them, at one thread only (tcp had none); for
        // verbs they are the link's.
        for label in [
            "uds os, 1 thread",
            "uds raw/os, 1 thread",
            "uds rpc/os, 1 thread",
            "verbs link, 1 thread",
            "verbs rpc/link, 1 thread",
            "verbs rpc/raw, 16 threads",
        ] {
            assert!(has(label), "no {label:?} in {labels:?}");
        }
        assert!(has("utilization, 1 client thread"));
        assert!(has("utilization, 16 client threads"));
        assert!(!labels
            .iter()
            .any(|l| l.starts_with("tcp os") || l.contains("uds os, 4")));
        // Readable size ticks; 500000 is labelled exactly and 512K, next to it, is left out.
        for tick in ["64K", "1M", "500000", "128K"] {
            assert!(has(tick), "no tick {tick:?} in {labels:?}");
        }
        assert!(!has("512K"), "{labels:?}");
        assert!(!has_raw_byte_count(&labels), "{labels:?}");
        assert!(has("100%"), "{labels:?}");
    }

    #[test]
    fn nothing_to_plot_is_an_error() {
        let mut t = transport("uds", false);
        t.cells.clear();
        let dir = tempfile::tempdir().unwrap();
        let e = write_svg(&report(vec![t]), &dir.path().join("p.svg")).unwrap_err();
        assert!(e.contains("nothing to plot"), "{e}");
    }
}
