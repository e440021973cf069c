//! The SVG figure of `bench scenario --plot`.

use super::render::mode_name;
use super::*;

/// One SVG with a row per scenario run, each with its legend at the right (the layout,
/// ticks and legend of [`crate::plot`]): typed: echo Mbit/s vs encoded size (log scale),
/// one colour per transport and one line style per payload kind; clients and slow-clients:
/// calls completed vs concurrent clients per transport; structured and orb: calls/s bars
/// per mode or client shape and transport; framework: gRPC, tarpc and native bars per transport,
/// 64 B calls/s beside 1 MiB echo MB/s.
pub fn write_svg(r: &ScenarioReport, path: &Path) -> Result<(), String> {
    let names: Vec<&str> = r.scenarios.iter().map(|s| s.label()).collect();
    let figure = Figure {
        caption: format!(
            "bench scenario {}; placement: {}",
            names.join(", "),
            r.placement.summary
        ),
        rows: r.scenarios.iter().filter_map(|&s| plot_row(r, s)).collect(),
    };
    crate::plot::write_figure(&figure, path)
}

/// One bar series per `(label, colour)` of `bars`, over `rows` (one category each): bar `k`
/// of a row is `f(row)[k]`.
pub(super) fn bar_series<R, const N: usize>(
    rows: &[R],
    bars: [(&str, usize); N],
    f: &dyn Fn(&R) -> [f64; N],
) -> Vec<Series> {
    bars.into_iter()
        .enumerate()
        .map(|(k, (label, c))| Series {
            label: label.into(),
            style: Style::new(c, Line::Bars, Marker::Dot),
            points: rows
                .iter()
                .enumerate()
                .map(|(i, row)| (i as f64, f(row)[k]))
                .collect(),
        })
        .collect()
}

/// The panels of one scenario (none when it has no figures).
pub(super) fn plot_row(r: &ScenarioReport, scenario: ScenarioName) -> Option<Vec<Panel>> {
    // One colour per transport, the same in every row.
    let mut transports: Vec<&str> = Vec::new();
    for t in r
        .rows
        .iter()
        .map(|x| x.transport)
        .chain(r.framework.iter().map(|f| f.transport))
    {
        if !transports.contains(&t) {
            transports.push(t);
        }
    }
    let color = |t: &str| transports.iter().position(|&x| x == t).unwrap_or(0);
    let rows: Vec<&Row> = r
        .rows
        .iter()
        .filter(|x| x.scenario == scenario.label())
        .collect();
    let panel = |title: String, x: XAxis, x_desc: &str, y_desc: &str, series: Vec<Series>| Panel {
        title,
        legend_title: None,
        x,
        x_desc: x_desc.into(),
        y_desc: y_desc.into(),
        y_format: YFormat::Number,
        y_max: None,
        reference: None,
        weight: 1,
        series,
    };
    // Bars of `value` per category (`category` of a row) and transport.
    let bars = |category: &dyn Fn(&Row) -> String, value: &dyn Fn(&Row) -> f64| {
        let mut names: Vec<String> = Vec::new();
        for x in &rows {
            let c = category(x);
            if !names.contains(&c) {
                names.push(c);
            }
        }
        let series = transports
            .iter()
            .filter_map(|&t| {
                let points: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|x| x.transport == t)
                    .filter_map(|x| {
                        let i = names.iter().position(|n| *n == category(x))?;
                        Some((i as f64, value(x)))
                    })
                    .collect();
                (!points.is_empty()).then(|| Series {
                    label: t.to_string(),
                    style: Style::new(color(t), Line::Bars, Marker::Dot),
                    points,
                })
            })
            .collect::<Vec<_>>();
        (XAxis::Categories(names), series)
    };
    let panels = match scenario {
        ScenarioName::Typed => {
            const KINDS: [(Line, Marker); 4] = [
                (Line::Solid, Marker::Dot),
                (Line::Dashed, Marker::Ring),
                (Line::Dotted, Marker::Triangle),
                (Line::Solid, Marker::Cross),
            ];
            let mut kinds: Vec<&str> = Vec::new();
            let mut series: Vec<Series> = Vec::new();
            for x in rows.iter().filter(|x| x.mode == Some(Mode::Echo)) {
                if !kinds.contains(&x.what.as_str()) {
                    kinds.push(&x.what);
                }
                let label = format!("{} {}", x.transport, x.what);
                let point = (x.payload_bytes as f64, x.stats.mbit_s);
                match series.iter_mut().find(|s| s.label == label) {
                    Some(s) => s.points.push(point),
                    None => {
                        let k = kinds.iter().position(|&w| w == x.what).unwrap_or(0);
                        let (line, marker) = KINDS[k % KINDS.len()];
                        series.push(Series {
                            label,
                            style: Style::new(color(x.transport), line, marker),
                            points: vec![point],
                        });
                    }
                }
            }
            for s in &mut series {
                s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            vec![panel(
                "typed: echo Mbit/s of encoded payload, one call at a time".into(),
                XAxis::Sizes {
                    measured: Vec::new(),
                },
                "encoded bytes per call (K = 1024, M = 1048576)",
                "Mbit/s",
                series,
            )]
        }
        ScenarioName::Clients | ScenarioName::SlowClients => {
            let first = rows.first()?;
            let series = transports
                .iter()
                .map(|&t| Series {
                    label: format!("{t} {}", scenario.label()),
                    style: Style::new(color(t), Line::Solid, Marker::Dot),
                    points: rows
                        .iter()
                        .filter(|x| x.transport == t)
                        .map(|x| (x.load.clients as f64, x.stats.completed as f64))
                        .collect(),
                })
                .filter(|s| !s.points.is_empty())
                .collect();
            vec![panel(
                format!(
                    "{}: calls completed in {:.1} s ({})",
                    scenario.label(),
                    first.load.duration.as_secs_f64(),
                    first.what
                ),
                XAxis::Counts,
                "concurrent clients (one connection each)",
                "calls completed",
                series,
            )]
        }
        ScenarioName::Structured => {
            let (x, series) = bars(&|x| mode_name(x.mode), &|x| x.stats.calls_per_s);
            vec![panel(
                "structured (~2.2 KB request): calls/s, one call at a time".into(),
                x,
                "mode",
                "calls/s",
                series,
            )]
        }
        ScenarioName::Orb => {
            let first = rows.first()?;
            let (x, series) = bars(&|x| x.what.clone(), &|x| x.stats.calls_per_s);
            vec![panel(
                format!(
                    "orb: calls/s per client shape, {} caller threads",
                    first.load.clients
                ),
                x,
                "client shape",
                "calls/s",
                series,
            )]
        }
        ScenarioName::Framework => {
            let names: Vec<String> = r.framework.iter().map(|f| f.transport.into()).collect();
            // Per row: gRPC, tarpc on messages, native.
            let bars = |f: &dyn Fn(&FrameworkRow) -> [f64; 3]| {
                bar_series(&r.framework, [("gRPC", 4), ("tarpc", 3), ("native", 2)], f)
            };
            let x = XAxis::Categories(names);
            vec![
                panel(
                    "framework: 64 B unary calls/s".into(),
                    x.clone(),
                    "transport",
                    "calls/s",
                    bars(&|f| [f.small_calls_per_s.0, f.tarpc.0, f.small_calls_per_s.1]),
                ),
                panel(
                    "framework: 1 MiB unary echo, MB/s".into(),
                    x,
                    "transport",
                    "MB/s",
                    bars(&|f| [f.large_mb_per_s.0, f.tarpc.1, f.large_mb_per_s.1]),
                ),
            ]
        }
        ScenarioName::CAbi => {
            let names: Vec<String> = r.c_abi.iter().map(|f| f.transport.into()).collect();
            let bars =
                |f: &dyn Fn(&CAbiRow) -> [f64; 2]| bar_series(&r.c_abi, [("C", 4), ("Rust", 2)], f);
            let x = XAxis::Categories(names);
            vec![
                panel(
                    "c-abi: 0 B calls, µs per call (lower is better)".into(),
                    x.clone(),
                    "transport",
                    "µs per call",
                    bars(&|f| [f.small_us.0, f.small_us.1]),
                ),
                panel(
                    "c-abi: 1 MiB echo, MB/s".into(),
                    x,
                    "transport",
                    "MB/s",
                    bars(&|f| [f.large_mb_per_s.0, f.large_mb_per_s.1]),
                ),
            ]
        }
        ScenarioName::All => Vec::new(),
    };
    panels
        .iter()
        .any(|p| !p.series.is_empty())
        .then_some(panels)
}
