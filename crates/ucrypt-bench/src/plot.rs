//! Charts for benchmark reports, written as SVG and PNG with `plotters`.
//!
//! Text in a PNG is drawn from a TrueType font read at run time ([`FONT_PATH`], Debian package
//! [`FONT_PACKAGE`]) rather than found through fontconfig. An SVG names its font family and
//! leaves drawing to the viewer, so it is written even without that file: its text is then
//! laid out with estimated widths, and the PNG is skipped with a note saying what to install.
//!
//! Data points that cannot be drawn (NaN, infinite, or <= 0 on a log axis) are skipped with a
//! note; a chart with nothing left to draw is an error, never a panic.

use std::ffi::OsString;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::combinators::LogCoord;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters_backend::{BackendColor, BackendCoord, BackendTextStyle, DrawingErrorKind};

/// Width and height of every chart, in pixels (PNG) or SVG user units.
pub const SIZE_PX: (u32, u32) = (1024, 640);
/// The font PNG text is drawn with.
pub const FONT_PATH: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// The Debian package that installs [`FONT_PATH`].
pub const FONT_PACKAGE: &str = "fonts-dejavu-core";
/// The family the font is registered under; SVG viewers substitute their own sans-serif.
const FONT_FAMILY: &str = "sans-serif";
const TITLE_PT: f64 = 24.0;
const LABEL_PT: f64 = 16.0;
const TICK_PT: f64 = 14.0;
/// Series with more points than this are drawn as bare lines (markers would merge).
const MARKED_POINTS_MAX: usize = 30;

/// Distinct colours (the Tableau 10 palette), cycled when there are more series.
const PALETTE: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

fn colour(i: usize) -> RGBColor {
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    RGBColor(r, g, b)
}

/// One line: (x, y) points in the order they are joined.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Legend {
    UpperLeft,
    // Part of the API for charts whose lines rise to the left; none of today's do.
    #[allow(dead_code)]
    UpperRight,
    LowerRight,
}

#[derive(Debug, Clone)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub log_y: bool,
    /// Where x is labelled; empty: 1-2-5 steps. E.g. the block sizes measured.
    pub x_ticks: Vec<f64>,
    /// Label x in 1024-based units (512, 4K, 1M): for sizes in bytes.
    pub x_bytes: bool,
    pub legend: Legend,
    pub series: Vec<Series>,
}

/// Grouped bars: one group per entry of `groups` along x, one bar per series in each group.
#[derive(Debug, Clone)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub groups: Vec<String>,
    pub series: Vec<BarSeries>,
}

#[derive(Debug, Clone)]
pub struct BarSeries {
    pub name: String,
    /// One per group, in the order of `BarChart::groups`; `None` = not measured.
    pub values: Vec<Option<BarValue>>,
}

/// A bar at `median` with an error bar from `min` to `max`.
#[derive(Debug, Clone, Copy)]
pub struct BarValue {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// What a chart call wrote, and what it left out and why.
#[derive(Debug, Default)]
pub struct Written {
    // `bench all` links the files by their stem; tests and other callers read the list.
    #[allow(dead_code)]
    pub files: Vec<PathBuf>,
    pub notes: Vec<String>,
}

/// The distinct x values of `series`, ascending: ticks at the points measured (block sizes,
/// thread counts) for [`LineChart::x_ticks`].
pub fn x_values(series: &[Series]) -> Vec<f64> {
    let mut xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|x| x.is_finite())
        .collect();
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.dedup();
    xs
}

/// Writes `stem.svg` and `stem.png`.
pub fn line_chart(c: &LineChart, stem: &Path) -> Result<Written, String> {
    let (plot, notes) = prepare_line(c)?;
    write_both(&Plot::Line(plot), notes, stem)
}

/// Writes `stem.svg` and `stem.png`.
pub fn bar_chart(c: &BarChart, stem: &Path) -> Result<Written, String> {
    let (plot, notes) = prepare_bars(c)?;
    write_both(&Plot::Bars(plot), notes, stem)
}

/// A latency CDF: per series (name, [(percentile 0..=100, latency µs)]); x is the latency on a
/// log axis, y the percentile. Writes `stem.svg` and `stem.png`.
pub fn cdf_chart(
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
    stem: &Path,
) -> Result<Written, String> {
    let c = LineChart {
        title: title.to_string(),
        x_label: "latency (µs)".to_string(),
        y_label: "percentile (%)".to_string(),
        log_x: true,
        log_y: false,
        x_ticks: vec![],
        x_bytes: false,
        legend: Legend::LowerRight,
        series: series
            .iter()
            .map(|(name, pts)| {
                let mut points: Vec<(f64, f64)> = pts.iter().map(|&(p, lat)| (lat, p)).collect();
                points.sort_by(|a, b| a.1.total_cmp(&b.1));
                Series {
                    name: name.clone(),
                    points,
                }
            })
            .collect(),
    };
    let (mut plot, notes) = prepare_line(&c)?;
    plot.y = (0.0, 100.0);
    write_both(&Plot::Line(plot), notes, stem)
}

// ---------------------------------------------------------------- validation

/// (name, colour index, drawable points): a series keeps its colour when another is skipped.
type DrawnSeries = (String, usize, Vec<(f64, f64)>);

struct PreparedLine {
    title: String,
    x_label: String,
    y_label: String,
    log_x: bool,
    log_y: bool,
    x_ticks: Vec<f64>,
    x_bytes: bool,
    legend: Legend,
    series: Vec<DrawnSeries>,
    x: (f64, f64),
    y: (f64, f64),
}

struct PreparedBars {
    title: String,
    y_label: String,
    groups: Vec<String>,
    series: Vec<(String, Vec<Option<BarValue>>)>,
    y_max: f64,
}

enum Plot {
    Line(PreparedLine),
    Bars(PreparedBars),
}

/// Bounds of a linear axis: from zero (or below, for negative data) so bar and line heights
/// compare honestly; an axis holding one value is widened so it has a length.
fn linear_bounds(lo: f64, hi: f64, from_zero: bool) -> (f64, f64) {
    let lo = if from_zero { lo.min(0.0) } else { lo };
    if hi > lo {
        let pad = if from_zero { (hi - lo) * 0.05 } else { 0.0 };
        (lo, hi + pad)
    } else {
        (lo - 1.0, hi + 1.0)
    }
}

fn log_bounds(lo: f64, hi: f64) -> (f64, f64) {
    (lo / 1.25, hi * 1.25)
}

fn prepare_line(c: &LineChart) -> Result<(PreparedLine, Vec<String>), String> {
    let mut notes = Vec::new();
    let mut series = Vec::new();
    for (i, s) in c.series.iter().enumerate() {
        let ok = |v: f64, log: bool| v.is_finite() && (!log || v > 0.0);
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|&(x, y)| ok(x, c.log_x) && ok(y, c.log_y))
            .collect();
        let dropped = s.points.len() - pts.len();
        if dropped > 0 {
            notes.push(format!(
                "{}: series '{}': {dropped} of {} points skipped (not finite, or <= 0 on a log axis)",
                c.title,
                s.name,
                s.points.len()
            ));
        }
        if pts.is_empty() {
            notes.push(format!(
                "{}: series '{}' has nothing to draw",
                c.title, s.name
            ));
            continue;
        }
        series.push((s.name.clone(), i, pts));
    }
    let all = || series.iter().flat_map(|(_, _, p)| p.iter());
    let min_max = |f: fn(&(f64, f64)) -> f64| {
        all()
            .map(f)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            })
    };
    if series.is_empty() {
        return Err(format!(
            "chart '{}': nothing to plot (no series with finite data points)",
            c.title
        ));
    }
    let (x_lo, x_hi) = min_max(|p| p.0);
    let (y_lo, y_hi) = min_max(|p| p.1);
    let x = if c.log_x {
        log_bounds(x_lo, x_hi)
    } else {
        linear_bounds(x_lo, x_hi, false)
    };
    let y = if c.log_y {
        log_bounds(y_lo, y_hi)
    } else {
        linear_bounds(y_lo, y_hi, true)
    };
    Ok((
        PreparedLine {
            title: c.title.clone(),
            x_label: c.x_label.clone(),
            y_label: c.y_label.clone(),
            log_x: c.log_x,
            log_y: c.log_y,
            x_ticks: c.x_ticks.clone(),
            x_bytes: c.x_bytes,
            legend: c.legend,
            series,
            x,
            y,
        },
        notes,
    ))
}

fn prepare_bars(c: &BarChart) -> Result<(PreparedBars, Vec<String>), String> {
    let mut notes = Vec::new();
    let mut y_max = f64::NEG_INFINITY;
    let mut series = Vec::new();
    for s in &c.series {
        if s.values.len() != c.groups.len() {
            return Err(format!(
                "chart '{}': series '{}' has {} values for {} groups",
                c.title,
                s.name,
                s.values.len(),
                c.groups.len()
            ));
        }
        let values: Vec<Option<BarValue>> = s
            .values
            .iter()
            .map(|v| v.filter(|v| v.median.is_finite()))
            .collect();
        let dropped = s.values.iter().filter(|v| v.is_some()).count()
            - values.iter().filter(|v| v.is_some()).count();
        if dropped > 0 {
            notes.push(format!(
                "{}: series '{}': {dropped} bars with a non-finite median skipped",
                c.title, s.name
            ));
        }
        for v in values.iter().flatten() {
            y_max = y_max.max(v.median);
            if v.max.is_finite() {
                y_max = y_max.max(v.max);
            }
        }
        series.push((s.name.clone(), values));
    }
    if !y_max.is_finite() {
        return Err(format!(
            "chart '{}': nothing to plot (no measured bar)",
            c.title
        ));
    }
    if c.series
        .iter()
        .any(|s| s.values.iter().any(|v| v.is_none()))
    {
        notes.push(format!("{}: some bars were not measured", c.title));
    }
    Ok((
        PreparedBars {
            title: c.title.clone(),
            y_label: c.y_label.clone(),
            groups: c.groups.clone(),
            series,
            // Headroom above the tallest bar for the legend.
            y_max: if y_max > 0.0 { y_max * 1.2 } else { 1.0 },
        },
        notes,
    ))
}

// ---------------------------------------------------------------- output

fn font_loaded() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let bytes = std::fs::read(FONT_PATH).map_err(|e| format!("{FONT_PATH}: {e}"))?;
        // plotters keeps registered fonts for the life of the process; this runs once.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, bytes)
            .map_err(|_| format!("{FONT_PATH}: not a TrueType font"))
    })
    .clone()
}

fn with_ext(stem: &Path, ext: &str) -> PathBuf {
    // Not Path::with_extension: a stem like "seq.4k" would lose ".4k".
    let mut s = OsString::from(stem.as_os_str());
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

fn write_both(plot: &Plot, notes: Vec<String>, stem: &Path) -> Result<Written, String> {
    write_files(plot, notes, stem, font_loaded())
}

/// `font`: whether a font for PNG text was loaded, or why not.
fn write_files(
    plot: &Plot,
    mut notes: Vec<String>,
    stem: &Path,
    font: Result<(), String>,
) -> Result<Written, String> {
    let mut files = Vec::new();
    let svg_path = with_ext(stem, "svg");
    std::fs::write(&svg_path, render_svg(plot, font.is_ok())?)
        .map_err(|e| format!("{}: {e}", svg_path.display()))?;
    files.push(svg_path);
    let png_path = with_ext(stem, "png");
    match font {
        Ok(()) => {
            write_png(&png_path, &render_rgb(plot)?, SIZE_PX)?;
            files.push(png_path);
        }
        Err(e) => notes.push(format!(
            "{}: not written, no font to draw text with ({e}); install the Debian package {FONT_PACKAGE}",
            png_path.display()
        )),
    }
    Ok(Written { files, notes })
}

fn render_svg(plot: &Plot, font: bool) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = Svg {
            inner: SVGBackend::with_string(&mut svg, SIZE_PX),
            font,
        }
        .into_drawing_area();
        draw(plot, &root)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

fn render_rgb(plot: &Plot) -> Result<Vec<u8>, String> {
    let mut rgb = vec![0u8; SIZE_PX.0 as usize * SIZE_PX.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, SIZE_PX).into_drawing_area();
        draw(plot, &root)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(rgb)
}

fn write_png(path: &Path, rgb: &[u8], (w, h): (u32, u32)) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let file = std::fs::File::create(path).map_err(|e| fail(&e))?;
    let mut enc = png::Encoder::new(BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header().map_err(|e| fail(&e))?;
    writer.write_image_data(rgb).map_err(|e| fail(&e))?;
    writer.finish().map_err(|e| fail(&e))
}

/// The SVG backend, laying out text with estimated widths when no font file was loaded:
/// plotters measures text (for label areas, legends) through the font even for SVG, whose
/// text the viewer draws with its own fonts.
struct Svg<'a> {
    inner: SVGBackend<'a>,
    font: bool,
}

type E = std::io::Error;

impl DrawingBackend for Svg<'_> {
    type ErrorType = E;

    fn get_size(&self) -> (u32, u32) {
        self.inner.get_size()
    }
    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<E>> {
        self.inner.ensure_prepared()
    }
    fn present(&mut self) -> Result<(), DrawingErrorKind<E>> {
        self.inner.present()
    }
    fn draw_pixel(&mut self, p: BackendCoord, c: BackendColor) -> Result<(), DrawingErrorKind<E>> {
        self.inner.draw_pixel(p, c)
    }
    fn draw_line<S: plotters_backend::BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<E>> {
        self.inner.draw_line(from, to, style)
    }
    fn draw_rect<S: plotters_backend::BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<E>> {
        self.inner.draw_rect(upper_left, bottom_right, style, fill)
    }
    fn draw_path<S: plotters_backend::BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<E>> {
        self.inner.draw_path(path, style)
    }
    // Circles and polygons keep the trait's rasterising defaults: no chart here draws one.
    fn draw_text<T: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &T,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<E>> {
        self.inner.draw_text(text, style, pos)
    }
    fn estimate_text_size<T: BackendTextStyle>(
        &self,
        text: &str,
        style: &T,
    ) -> Result<(u32, u32), DrawingErrorKind<E>> {
        if self.font {
            return self.inner.estimate_text_size(text, style);
        }
        // An average sans-serif glyph is about 0.55 em wide.
        let em = style.size();
        let width = text.chars().count() as f64 * em * 0.55;
        Ok((width.ceil() as u32, em.ceil() as u32))
    }
}

// ---------------------------------------------------------------- drawing

/// Short tick labels: 3 significant digits, k/M/G from 100 000 (so an axis to 10 000 reads
/// 8000, 10000 rather than 8000, 10k).
pub fn fmt_tick(v: f64) -> String {
    let a = v.abs();
    let (v, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e5 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    if v == 0.0 {
        return "0".to_string();
    }
    let digits = v.abs().log10().floor() as i32;
    let decimals = (2 - digits).clamp(0, 6) as usize;
    let mut s = format!("{v:.decimals$}");
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    s + suffix
}

/// 1, 2 and 5 times the powers of ten within `lo..=hi` (all of 1..=9 times them when that
/// gives fewer than 3 ticks); `lo` > 0.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let decades = lo.log10().floor() as i32..=hi.log10().ceil() as i32;
    let within = |mantissas: &[f64]| -> Vec<f64> {
        decades
            .clone()
            .flat_map(|k| mantissas.iter().map(move |m| m * 10f64.powi(k)))
            .filter(|v| (lo..=hi).contains(v))
            .collect()
    };
    let ticks = within(&[1.0, 2.0, 5.0]);
    if ticks.len() >= 3 {
        ticks
    } else {
        within(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

/// About 5 to 10 ticks at 1, 2 or 5 times a power of ten.
fn linear_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let raw = (hi - lo) / 8.0;
    if !(raw.is_finite() && raw > 0.0) {
        return vec![lo];
    }
    let p = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// Sizes in bytes: "512", "4K", "1.5K", "1M", "2G".
pub fn fmt_bytes(v: f64) -> String {
    let mut x = v;
    let mut unit = "";
    for u in ["K", "M", "G", "T"] {
        if x.abs() < 1024.0 {
            break;
        }
        x /= 1024.0;
        unit = u;
    }
    let mut s = format!("{x:.2}");
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    s + unit
}

fn err<T: std::fmt::Display>(e: T) -> String {
    e.to_string()
}

fn draw<DB: DrawingBackend>(plot: &Plot, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
    root.fill(&WHITE).map_err(err)?;
    match plot {
        Plot::Line(p) => {
            // Ticks are chosen here, at 1, 2 and 5 times powers of ten unless the caller gave
            // them: plotters' own choice on log axes leaves decades unlabelled or crowds 900
            // next to 1000.
            let ticks = |(lo, hi): (f64, f64), log: bool, given: &[f64]| -> Vec<f64> {
                if !given.is_empty() {
                    given
                        .iter()
                        .copied()
                        .filter(|t| (lo..=hi).contains(t))
                        .collect()
                } else if log {
                    log_ticks(lo, hi)
                } else {
                    linear_ticks(lo, hi)
                }
            };
            let (xt, yt) = (ticks(p.x, p.log_x, &p.x_ticks), ticks(p.y, p.log_y, &[]));
            let (x, y) = (p.x.0..p.x.1, p.y.0..p.y.1);
            let lin = |r: std::ops::Range<f64>, ticks| Ticked {
                inner: RangedCoordf64::from(r),
                ticks,
            };
            let log = |r: std::ops::Range<f64>, ticks| Ticked {
                inner: LogCoord::from(r.log_scale()),
                ticks,
            };
            match (p.log_x, p.log_y) {
                (false, false) => draw_lines(root, p, lin(x, xt), lin(y, yt)),
                (true, false) => draw_lines(root, p, log(x, xt), lin(y, yt)),
                (false, true) => draw_lines(root, p, lin(x, xt), log(y, yt)),
                (true, true) => draw_lines(root, p, log(x, xt), log(y, yt)),
            }
        }
        Plot::Bars(p) => draw_bars(root, p),
    }
}

fn font(pt: f64) -> TextStyle<'static> {
    (FONT_FAMILY, pt).into_font().into()
}

/// An axis (linear or log) labelled at the ticks we chose.
struct Ticked<R> {
    inner: R,
    ticks: Vec<f64>,
}

impl<R: Ranged<ValueType = f64>> Ranged for Ticked<R> {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }
    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // Grid lines only at the labelled ticks, none between.
        if hint.weight().allow_light_points() {
            vec![]
        } else {
            self.ticks.clone()
        }
    }
    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

fn draw_lines<DB, X, Y>(
    root: &DrawingArea<DB, Shift>,
    p: &PreparedLine,
    x: Ticked<X>,
    y: Ticked<Y>,
) -> Result<(), String>
where
    DB: DrawingBackend,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let mut chart = ChartBuilder::on(root)
        .caption(&p.title, font(TITLE_PT))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(p.x_label.as_str())
        .y_desc(p.y_label.as_str())
        .axis_desc_style(font(LABEL_PT))
        .label_style(font(TICK_PT))
        .x_label_formatter(&|v| {
            if p.x_bytes {
                fmt_bytes(*v)
            } else {
                fmt_tick(*v)
            }
        })
        .y_label_formatter(&|v| fmt_tick(*v))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    for (name, i, pts) in &p.series {
        let c = colour(*i);
        chart
            .draw_series(
                LineSeries::new(pts.iter().copied(), c.stroke_width(2))
                    .point_size(if pts.len() <= MARKED_POINTS_MAX { 3 } else { 0 }),
            )
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(match p.legend {
            Legend::UpperLeft => SeriesLabelPosition::UpperLeft,
            Legend::UpperRight => SeriesLabelPosition::UpperRight,
            Legend::LowerRight => SeriesLabelPosition::LowerRight,
        })
        .label_font(font(TICK_PT))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    p: &PreparedBars,
) -> Result<(), String> {
    let groups = p.groups.len() as f64;
    // Group names are wrapped to the width of their group (estimated here, before the chart
    // exists, from the drawing's width less the margins and the y label area).
    let group_px = (root.dim_in_pixel().0 as f64 - 2.0 * 16.0 - 80.0) / groups.max(1.0);
    let max_chars = ((group_px * 0.9) / (TICK_PT * GLYPH_EM)).max(4.0) as usize;
    let names: Vec<Vec<String>> = p.groups.iter().map(|g| wrap(g, max_chars)).collect();
    let lines = names.iter().map(Vec::len).max().unwrap_or(1) as u32;
    let line_px = (TICK_PT * 1.25) as i32;
    let mut chart = ChartBuilder::on(root)
        .caption(&p.title, font(TITLE_PT))
        .margin(16)
        .x_label_area_size(16 + lines * line_px as u32)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..groups, 0.0..p.y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_label_formatter(&|_| String::new())
        .y_desc(p.y_label.as_str())
        .axis_desc_style(font(LABEL_PT))
        .label_style(font(TICK_PT))
        .y_label_formatter(&|v| fmt_tick(*v))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    // Each group spans [g, g + 1); its bars share the middle 80 %.
    let width = 0.8 / p.series.len().max(1) as f64;
    for (i, (name, values)) in p.series.iter().enumerate() {
        let c = colour(i);
        let bars = values.iter().enumerate().filter_map(|(g, v)| {
            let x0 = g as f64 + 0.1 + i as f64 * width;
            v.map(|v| Rectangle::new([(x0, 0.0), (x0 + width, v.median)], c.filled()))
        });
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
        // Error bars: the range of the runs, with caps a third of the bar wide.
        let ranges = values.iter().enumerate().filter_map(|(g, v)| {
            let v = (*v)?;
            if !(v.min.is_finite() && v.max.is_finite()) {
                return None;
            }
            let mid = g as f64 + 0.1 + (i as f64 + 0.5) * width;
            let cap = width / 6.0;
            Some(PathElement::new(
                vec![
                    (mid - cap, v.min),
                    (mid + cap, v.min),
                    (mid, v.min),
                    (mid, v.max),
                    (mid - cap, v.max),
                    (mid + cap, v.max),
                ],
                BLACK.stroke_width(1),
            ))
        });
        chart.draw_series(ranges).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(font(TICK_PT))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    // Group names under the axis, centred on their group.
    let style = font(TICK_PT).pos(Pos::new(HPos::Center, VPos::Top));
    for (g, name) in names.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        for (k, line) in name.iter().enumerate() {
            let y = py + 8 + k as i32 * line_px;
            root.draw(&Text::new(line.as_str(), (px, y), style.clone()))
                .map_err(err)?;
        }
    }
    Ok(())
}

/// Average glyph width of the plot font, in ems (DejaVu Sans: about 0.55).
const GLYPH_EM: f64 = 0.55;

/// Splits `text` at spaces into lines of at most `max_chars` characters; a longer word gets a
/// line of its own.
fn wrap(text: &str, max_chars: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        match lines.last_mut() {
            Some(l) if l.chars().count() + 1 + word.chars().count() <= max_chars => {
                l.push(' ');
                l.push_str(word);
            }
            _ => lines.push(word.to_string()),
        }
    }
    if lines.is_empty() {
        lines.push(String::new());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ucrypt-plot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    #[test]
    fn wraps_group_names() {
        // (text, max chars, lines)
        let rows: &[(&str, usize, &[&str])] = &[
            ("4k randread QD1", 20, &["4k randread QD1"]),
            (
                "4k randread QD1, one CPU",
                12,
                &["4k randread", "QD1, one CPU"],
            ),
            ("a verylongword b", 4, &["a", "verylongword", "b"]),
            ("", 8, &[""]),
        ];
        for &(text, max, want) in rows {
            assert_eq!(wrap(text, max), want, "{text:?} at {max}");
        }
    }

    /// (width, height) from a PNG's IHDR chunk, after checking the signature.
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be =
            |o: usize| u32::from_be_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        (be(16), be(20))
    }

    /// Every element opened is closed, in order (an XML-ish check: the SVG backend writes no
    /// comments or CDATA, and escapes text).
    fn assert_balanced(svg: &str) {
        let mut open: Vec<&str> = Vec::new();
        let mut rest = svg;
        while let Some(start) = rest.find('<') {
            let end = rest[start..].find('>').expect("unterminated tag") + start;
            let tag = &rest[start + 1..end];
            let name = |t: &str| t.split_whitespace().next().unwrap_or("").to_string();
            if let Some(closing) = tag.strip_prefix('/') {
                assert_eq!(open.pop().map(name), Some(name(closing)), "closing {tag}");
            } else if !tag.ends_with('/') && !tag.starts_with('?') {
                open.push(tag);
            }
            rest = &rest[end + 1..];
        }
        assert!(open.is_empty(), "unclosed: {open:?}");
    }

    fn font_or_skip() -> bool {
        if font_loaded().is_ok() {
            return true;
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "{FONT_PATH} missing: CI installs {FONT_PACKAGE}"
        );
        println!("SKIPPED: {FONT_PATH} missing (install {FONT_PACKAGE}); PNG not checked");
        false
    }

    /// The files of `w` are stem.svg (well-formed, naming every series) and, with the font,
    /// stem.png of SIZE_PX.
    fn check(w: &Written, stem: &Path, names: &[&str]) {
        let svg_path = with_ext(stem, "svg");
        assert_eq!(w.files[0], svg_path);
        let svg = std::fs::read_to_string(&svg_path).expect("svg");
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_balanced(&svg);
        for n in names {
            assert!(svg.contains(n), "SVG lacks series name {n:?}");
        }
        if font_or_skip() {
            let png = std::fs::read(with_ext(stem, "png")).expect("png");
            assert_eq!(png_size(&png), SIZE_PX);
            assert_eq!(w.files.len(), 2);
        }
    }

    fn line(log_x: bool, log_y: bool, series: Vec<Series>) -> LineChart {
        LineChart {
            title: "throughput by block size".into(),
            x_label: "block size (bytes)".into(),
            y_label: "MB/s".into(),
            log_x,
            log_y,
            x_ticks: vec![],
            x_bytes: false,
            legend: Legend::UpperLeft,
            series,
        }
    }

    fn s(name: &str, points: &[(f64, f64)]) -> Series {
        Series {
            name: name.into(),
            points: points.to_vec(),
        }
    }

    #[test]
    fn line_charts_write_svg_and_png() {
        let dir = tmp("line");
        // (stem, log_x, log_y, series, notes expected)
        let inline = s(
            "inline",
            &[(512.0, 900.0), (4096.0, 2100.0), (65536.0, 3000.0)],
        );
        let parallel = s(
            "parallel",
            &[(512.0, 700.0), (4096.0, 2500.0), (65536.0, 5200.0)],
        );
        let with_nan = s(
            "queued",
            &[(512.0, f64::NAN), (4096.0, 0.0), (65536.0, 10.0)],
        );
        let rows: Vec<(&str, bool, bool, Vec<Series>, usize)> = vec![
            (
                "lin",
                false,
                false,
                vec![inline.clone(), parallel.clone()],
                0,
            ),
            (
                "logx",
                true,
                false,
                vec![inline.clone(), parallel.clone()],
                0,
            ),
            (
                "logxy-nan",
                true,
                true,
                vec![inline.clone(), with_nan.clone()],
                1,
            ),
            (
                "one-point",
                false,
                false,
                vec![s("single", &[(1.0, 1.0)])],
                0,
            ),
            (
                "empty-series",
                false,
                false,
                vec![inline.clone(), s("nothing", &[])],
                1,
            ),
        ];
        for (stem, log_x, log_y, series, notes) in rows {
            let sizes = stem == "logx";
            let names: Vec<String> = series
                .iter()
                .filter(|s| !s.points.is_empty())
                .map(|s| s.name.clone())
                .collect();
            let stem = dir.join(stem);
            let mut c = line(log_x, log_y, series);
            if sizes {
                // Labelled at the sizes measured, in 1024-based units.
                c.x_ticks = vec![512.0, 4096.0, 65536.0];
                c.x_bytes = true;
            }
            let w = line_chart(&c, &stem).expect("chart");
            if sizes {
                let svg = std::fs::read_to_string(with_ext(&stem, "svg")).expect("svg");
                assert!(
                    svg.contains("\n4K\n") && svg.contains("\n64K\n"),
                    "byte labels"
                );
            }
            let names: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
            check(&w, &stem, &names);
            let chart_notes = w.notes.iter().filter(|n| !n.contains(".png")).count();
            assert_eq!(chart_notes, notes, "{stem:?}: {:?}", w.notes);
        }
        if std::env::var_os("UCRYPT_KEEP_PLOTS").is_none() {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    #[test]
    fn bar_chart_writes_svg_and_png() {
        let dir = tmp("bar");
        let v = |m: f64| {
            Some(BarValue {
                median: m,
                min: m * 0.9,
                max: m * 1.1,
            })
        };
        let c = BarChart {
            title: "4 KiB reads by policy".into(),
            y_label: "MB/s".into(),
            groups: vec!["4 KiB".into(), "64 KiB".into(), "1 MiB".into()],
            series: vec![
                BarSeries {
                    name: "inline".into(),
                    values: vec![v(900.0), v(2000.0), None],
                },
                BarSeries {
                    name: "parallel".into(),
                    values: vec![v(700.0), v(f64::NAN), v(5000.0)],
                },
            ],
        };
        let stem = dir.join("bars");
        let w = bar_chart(&c, &stem).expect("chart");
        check(&w, &stem, &["inline", "parallel", "64 KiB", "1 MiB"]);
        assert!(
            w.notes.iter().any(|n| n.contains("non-finite")),
            "{:?}",
            w.notes
        );
        assert!(
            w.notes.iter().any(|n| n.contains("not measured")),
            "{:?}",
            w.notes
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cdf_chart_writes_svg_and_png() {
        let dir = tmp("cdf");
        let pcts = [1.0, 10.0, 50.0, 90.0, 99.0, 99.9];
        let idle: Vec<(f64, f64)> = pcts.iter().map(|&p| (p, 20.0 + p)).collect();
        let busy: Vec<(f64, f64)> = pcts.iter().map(|&p| (p, 40.0 + 10.0 * p)).collect();
        let stem = dir.join("cdf");
        let w = cdf_chart(
            "4 KiB read latency at QD1",
            &[("idle".into(), idle), ("2 CPU hogs".into(), busy)],
            &stem,
        )
        .expect("chart");
        check(&w, &stem, &["idle", "2 CPU hogs", "percentile"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn nothing_to_plot_is_an_error() {
        let dir = tmp("empty");
        let stem = dir.join("x");
        let rows: Vec<(&str, Result<Written, String>)> = vec![
            ("no series", line_chart(&line(false, false, vec![]), &stem)),
            (
                "all NaN",
                line_chart(&line(false, false, vec![s("a", &[(f64::NAN, 1.0)])]), &stem),
            ),
            (
                "<= 0 on log axes",
                line_chart(
                    &line(true, true, vec![s("a", &[(0.0, 1.0), (1.0, -1.0)])]),
                    &stem,
                ),
            ),
            ("empty cdf", cdf_chart("t", &[], &stem)),
            (
                "no bars",
                bar_chart(
                    &BarChart {
                        title: "t".into(),
                        y_label: "y".into(),
                        groups: vec!["g".into()],
                        series: vec![BarSeries {
                            name: "a".into(),
                            values: vec![None],
                        }],
                    },
                    &stem,
                ),
            ),
            (
                "values/groups mismatch",
                bar_chart(
                    &BarChart {
                        title: "t".into(),
                        y_label: "y".into(),
                        groups: vec!["g".into()],
                        series: vec![BarSeries {
                            name: "a".into(),
                            values: vec![],
                        }],
                    },
                    &stem,
                ),
            ),
        ];
        for (what, r) in rows {
            assert!(r.is_err(), "{what}: {:?}", r.map(|w| w.files));
        }
        assert!(!with_ext(&stem, "svg").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn svg_without_font_file() {
        // The path taken when the font file is missing: the SVG's text is laid out with
        // estimated widths, the PNG is skipped with a note naming the package.
        let dir = tmp("nofont");
        let stem = dir.join("x");
        let (plot, notes) = prepare_line(&line(
            true,
            false,
            vec![s("inline", &[(1.0, 2.0), (8.0, 3.0)])],
        ))
        .expect("prepare");
        let missing = Err(format!("{FONT_PATH}: No such file or directory"));
        let w = write_files(&Plot::Line(plot), notes, &stem, missing).expect("svg without font");
        assert_eq!(w.files, [with_ext(&stem, "svg")]);
        let svg = std::fs::read_to_string(&w.files[0]).expect("svg");
        assert_balanced(&svg);
        assert!(svg.contains("inline") && svg.contains("MB/s"));
        assert!(!with_ext(&stem, "png").exists());
        assert_eq!(w.notes.len(), 1, "{:?}", w.notes);
        assert!(w.notes[0].contains(FONT_PACKAGE) && w.notes[0].contains("x.png"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn log_tick_rows() {
        let rows: &[(f64, f64, &[f64])] = &[
            (16.0, 1300.0, &[20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]),
            (
                400.0,
                80000.0,
                &[500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0],
            ),
            (2.5, 4.5, &[3.0, 4.0]),
        ];
        for (lo, hi, want) in rows {
            assert_eq!(log_ticks(*lo, *hi), *want, "{lo}..{hi}");
        }
    }

    #[test]
    fn linear_tick_rows() {
        let rows: &[(f64, f64, &[f64])] = &[
            (0.0, 105.0, &[0.0, 20.0, 40.0, 60.0, 80.0, 100.0]),
            (0.0, 5.5, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]),
            (-1.0, 1.0, &[-1.0, -0.5, 0.0, 0.5, 1.0]),
            (3.0, 3.0, &[3.0]),
        ];
        for (lo, hi, want) in rows {
            assert_eq!(linear_ticks(*lo, *hi), *want, "{lo}..{hi}");
        }
    }

    #[test]
    fn x_values_are_sorted_and_distinct() {
        let series = [
            s("a", &[(4096.0, 1.0), (512.0, 2.0), (f64::NAN, 3.0)]),
            s("b", &[(512.0, 1.0), (65536.0, 2.0)]),
        ];
        assert_eq!(x_values(&series), [512.0, 4096.0, 65536.0]);
    }

    #[test]
    fn byte_labels() {
        let rows = [
            (512.0, "512"),
            (4096.0, "4K"),
            (1536.0, "1.5K"),
            (1048576.0, "1M"),
            (2.0 * 1073741824.0, "2G"),
        ];
        for (v, want) in rows {
            assert_eq!(fmt_bytes(v), want, "{v}");
        }
    }

    #[test]
    fn tick_labels() {
        let rows = [
            (0.0, "0"),
            (1.0, "1"),
            (2.5, "2.5"),
            (0.125, "0.125"),
            (512.0, "512"),
            (4096.0, "4096"),
            (65536.0, "65536"),
            (250000.0, "250k"),
            (1048576.0, "1.05M"),
            (2.0e9, "2G"),
            (-20.0, "-20"),
        ];
        for (v, want) in rows {
            assert_eq!(fmt_tick(v), want, "{v}");
        }
    }
}
