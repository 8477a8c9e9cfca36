//! The report's PNG plots, drawn with `plotters` (bitmap backend). Text is
//! rendered with `ab_glyph` from a TrueType font read at run time: DejaVu
//! Sans (Debian's `fonts-dejavu-core`, which `.ci/run` installs), or the
//! file named by `CQD_PLOT_FONT`.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::curves::{Load, Point};
use crate::floors::Floor;

const FONT_PATHS: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Registers the font as "sans-serif" once.
pub fn init_font() -> Result<(), String> {
    let candidates: Vec<String> = std::env::var("CQD_PLOT_FONT")
        .into_iter()
        .chain(FONT_PATHS.iter().map(|s| s.to_string()))
        .collect();
    for path in &candidates {
        if let Ok(bytes) = std::fs::read(path) {
            // The font lives as long as the process: plotters keeps a
            // reference to the bytes in its global font table.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            return register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{path}: not a TrueType font plotters can read"));
        }
    }
    Err(format!(
        "no font for the plots: tried {candidates:?} (apt-get install fonts-dejavu-core, \
         or set CQD_PLOT_FONT to a .ttf file)"
    ))
}

const COLORS: [RGBColor; 5] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
];

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The rated points of one mode, by arrival rate.
fn series<'a>(points: &'a [Point], mode: &str) -> Vec<&'a Point> {
    points
        .iter()
        .filter(|p| p.mode == mode && matches!(p.load, Load::Rate(_)))
        .collect()
}

fn modes(points: &[Point]) -> Vec<&'static str> {
    let mut m: Vec<&'static str> = Vec::new();
    for p in points {
        if !m.contains(&p.mode) {
            m.push(p.mode);
        }
    }
    m
}

/// Handler latency (p50 solid, p99 dashed) against arrival rate, per mode,
/// with the floors as horizontal lines.
pub fn latency(path: &Path, title: &str, points: &[Point], floors: &[Floor]) -> Result<(), String> {
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max = points
        .iter()
        .map(|p| p.p99.median)
        .chain(floors.iter().map(|f| f.p50.median))
        .fold(1.0f64, f64::max)
        * 2.0;
    let min = points
        .iter()
        .map(|p| p.p50.median)
        .chain(floors.iter().map(|f| f.p50.median))
        .fold(max, f64::min)
        .max(0.01)
        / 2.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((500f64..2_000_000f64).log_scale(), (min..max).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("completions arriving per second")
        .y_desc("arrival → handler, µs")
        .x_label_formatter(&|x| rate_label(*x))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    for (i, mode) in modes(points).into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let s = series(points, mode);
        let p50: Vec<(f64, f64)> = s
            .iter()
            .map(|p| (p.load.mean_rate(), p.p50.median))
            .collect();
        let p99: Vec<(f64, f64)> = s
            .iter()
            .map(|p| (p.load.mean_rate(), p.p99.median))
            .collect();
        chart
            .draw_series(LineSeries::new(p50.clone(), color.stroke_width(3)))
            .map_err(err)?
            .label(format!("{mode} p50"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart
            .draw_series(p50.iter().map(|&xy| Circle::new(xy, 4, color.filled())))
            .map_err(err)?;
        chart
            .draw_series(DashedLineSeries::new(p99, 6, 4, color.stroke_width(1)))
            .map_err(err)?
            .label(format!("{mode} p99"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(1))
            });
    }
    for (i, f) in floors.iter().enumerate() {
        let color = if i == 0 {
            RGBColor(120, 120, 120)
        } else {
            BLACK
        };
        let y = f.p50.median;
        chart
            .draw_series(DashedLineSeries::new(
                vec![(500.0, y), (2_000_000.0, y)],
                2,
                3,
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("floor: {} p50", f.name))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Poller CPU seconds per second against arrival rate, per mode.
pub fn cpu(path: &Path, title: &str, points: &[Point]) -> Result<(), String> {
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max = points.iter().map(|p| p.cpu.max).fold(1.0f64, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((500f64..2_000_000f64).log_scale(), 0f64..max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("completions arriving per second")
        .y_desc("poller CPU seconds per second")
        .x_label_formatter(&|x| rate_label(*x))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    for (i, mode) in modes(points).into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let s = series(points, mode);
        let line: Vec<(f64, f64)> = s
            .iter()
            .map(|p| (p.load.mean_rate(), p.cpu.median))
            .collect();
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(3)))
            .map_err(err)?
            .label(mode)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        chart
            .draw_series(line.iter().map(|&xy| Circle::new(xy, 4, color.filled())))
            .map_err(err)?;
        // min–max over the runs
        chart
            .draw_series(s.iter().map(|p| {
                let x = p.load.mean_rate();
                PathElement::new(vec![(x, p.cpu.min), (x, p.cpu.max)], color.stroke_width(1))
            }))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Grouped bars: for each (group, value) a bar per contender, with a
/// min–max whisker; one panel per metric.
pub struct Bars<'a> {
    pub metric: &'a str,
    /// Per contender: (name, median, min, max).
    pub values: Vec<(String, f64, f64, f64)>,
}

/// Panels of bars side by side, one per metric.
pub fn bars(path: &Path, title: &str, panels: &[Bars<'_>]) -> Result<(), String> {
    let root = BitMapBackend::new(path, (300 * panels.len() as u32 + 60, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(err)?;
    let areas = root.split_evenly((1, panels.len()));
    for (area, panel) in areas.iter().zip(panels) {
        let n = panel.values.len();
        let top = panel.values.iter().map(|v| v.3).fold(0.0f64, f64::max) * 1.15;
        let max = top;
        let mut chart = ChartBuilder::on(area)
            .caption(panel.metric, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..n as f64, 0f64..max.max(1e-9))
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .label_style(("sans-serif", 13))
            .draw()
            .map_err(err)?;
        for (i, (name, median, min, max)) in panel.values.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let x = i as f64;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x + 0.2, 0.0), (x + 0.8, *median)],
                    color.mix(0.8).filled(),
                )))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(x + 0.5, *min), (x + 0.5, *max)],
                    BLACK.stroke_width(2),
                )))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    name.clone(),
                    (x + 0.22, max.max(*median) + top * 0.03),
                    ("sans-serif", 15).into_font(),
                )))
                .map_err(err)?;
        }
    }
    root.present().map_err(err)
}

fn rate_label(x: f64) -> String {
    if x >= 1e6 {
        format!("{}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{}k", x / 1e3)
    } else {
        format!("{x}")
    }
}
