//! The SVG plot: throughput vs message size, raw and RPC, per transport.

use crate::measure::Op;
use crate::report::{size_label, Report};
use plotters::prelude::*;
use std::path::Path;

/// Line colours, shared with the scenario plots.
pub(crate) const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// (label, color index, dashed?, points)
type Series = (String, usize, bool, Vec<(f64, f64)>);

/// Writes the plot of the `send` cells (or the first op measured) at the fewest threads.
pub fn write_svg(report: &Report, path: &Path) -> Result<(), String> {
    let op = if report.settings.ops.contains(&Op::Send) {
        Op::Send
    } else {
        *report.settings.ops.first().ok_or("nothing to plot")?
    };
    let threads = *report
        .settings
        .threads
        .iter()
        .min()
        .ok_or("nothing to plot")?;
    let mut series: Vec<Series> = Vec::new();
    for (i, t) in report.transports.iter().enumerate() {
        let cells: Vec<_> = t
            .cells
            .iter()
            .filter(|c| c.op == op && c.threads == threads)
            .collect();
        let pts = |raw: bool| {
            cells
                .iter()
                .map(|c| {
                    let f = if raw { &c.raw } else { &c.rpc };
                    (c.size as f64, f.mbit_s.median)
                })
                .collect::<Vec<_>>()
        };
        series.push((format!("{} raw", t.transport), i, true, pts(true)));
        series.push((
            format!("{} rpc {}", t.transport, op.name()),
            i,
            false,
            pts(false),
        ));
    }
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.3.iter().copied()).collect();
    if all.is_empty() {
        return Err("nothing to plot: no throughput cells were measured".into());
    }
    let xmin = all
        .iter()
        .map(|p| p.0)
        .fold(f64::INFINITY, f64::min)
        .max(1.0);
    let xmax = all.iter().map(|p| p.0).fold(0.0, f64::max).max(xmin * 2.0);
    let ymax = all.iter().map(|p| p.1).fold(0.0, f64::max).max(1.0) * 1.1;

    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| format!("plot {}: {e}", path.display());
    root.fill(&WHITE).map_err(err)?;
    let cores = |c: Option<usize>| c.map_or("-".to_string(), |c| c.to_string());
    let caption = format!(
        "Payload Mbit/s vs message size: {}, {} client thread(s), window {}, CPUs client {} / server {}",
        op.name(),
        threads,
        report.settings.window,
        cores(report.placement.client_core),
        cores(report.placement.server_core),
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 16))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((xmin * 0.8..xmax * 1.25).log_scale(), 0.0..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("message size")
        .y_desc("Mbit/s")
        .x_label_formatter(&|x| size_label(*x as usize))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    for (label, ci, dashed, pts) in series {
        let color = COLORS[ci % COLORS.len()];
        let style = ShapeStyle::from(&color).stroke_width(2);
        if dashed {
            chart
                .draw_series(DashedLineSeries::new(pts.clone(), 6, 4, style))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        } else {
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
        }
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
