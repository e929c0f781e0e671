//! A small SVG writer for the plots: panels with linear or logarithmic axes, ticks,
//! labels and legends. Hand-written so the output is byte-for-byte deterministic and needs
//! no dependency; every number is printed with one decimal.

use std::fmt::Write as _;

/// Colours that stay distinguishable for colour-blind readers (Okabe–Ito), cycled.
pub const PALETTE: [&str; 8] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
];

/// How values map onto an axis.
#[derive(Clone, Copy, Debug)]
pub enum Scale {
    Linear {
        lo: f64,
        hi: f64,
    },
    /// Base 10; `lo > 0`. Values below `lo` are drawn at `lo`.
    Log {
        lo: f64,
        hi: f64,
    },
}

impl Scale {
    /// A linear scale from 0 to `max` (at least 1), or a log one when the data span more
    /// than `ratio` (exponential schedules, retry storms): from the decade at or below
    /// `min_positive` to the decade at or above `max`, so both ends are labelled.
    pub fn fit(min_positive: f64, max: f64, ratio: f64) -> Scale {
        let max = max.max(1.0);
        let min = min_positive.clamp(1.0, max);
        if max / min > ratio {
            Scale::Log {
                lo: 10f64.powf(min.log10().floor()),
                hi: 10f64.powf(max.log10().ceil()),
            }
        } else {
            Scale::Linear { lo: 0.0, hi: max }
        }
    }

    /// The lowest value drawn where it is: below it a value is clipped to the axis.
    pub fn floor(self) -> f64 {
        match self {
            Scale::Linear { lo, .. } | Scale::Log { lo, .. } => lo,
        }
    }

    /// Position in `[0, 1]` (clamped).
    fn unit(self, v: f64) -> f64 {
        let u = match self {
            Scale::Linear { lo, hi } => (v - lo) / (hi - lo),
            Scale::Log { lo, hi } => (v.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10()),
        };
        if u.is_finite() {
            u.clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    pub fn is_log(self) -> bool {
        matches!(self, Scale::Log { .. })
    }
}

/// One axis of a panel: a scale drawn from `from` to `to` pixels.
#[derive(Clone, Copy, Debug)]
pub struct Axis {
    pub scale: Scale,
    pub from: f64,
    pub to: f64,
}

impl Axis {
    pub fn px(self, v: f64) -> f64 {
        self.from + (self.to - self.from) * self.scale.unit(v)
    }
}

/// Tick values for an axis, in one kind of step: for log scales the decades, with 2 and 5
/// between when there are at most three (1–2–5); for linear ones a 1–2–5 step, or for
/// durations (`time`) a step from [`TIME_STEPS_MS`], about `count` ticks.
pub fn ticks(scale: Scale, count: usize, time: bool) -> Vec<f64> {
    match scale {
        Scale::Log { lo, hi } => {
            let decades = (hi / lo).log10().round() as i32;
            let mut out = Vec::new();
            for d in 0..=decades {
                let base = lo * 10f64.powi(d);
                out.push(base);
                if decades <= 3 && d < decades {
                    out.extend([2.0 * base, 5.0 * base]);
                }
            }
            out
        }
        Scale::Linear { lo, hi } => {
            let raw = (hi - lo) / count.max(1) as f64;
            let step = if time {
                TIME_STEPS_MS
                    .iter()
                    .copied()
                    .find(|&s| s >= raw)
                    .unwrap_or_else(|| (raw / DAY_MS).ceil() * DAY_MS)
            } else {
                let mag = 10f64.powf(raw.log10().floor());
                [1.0, 2.0, 5.0, 10.0]
                    .iter()
                    .map(|m| m * mag)
                    .find(|&s| s >= raw)
                    .unwrap_or(10.0 * mag)
            };
            let mut out = Vec::new();
            let mut v = (lo / step).ceil() * step;
            while v <= hi + step * 1e-9 {
                out.push(v);
                v += step;
            }
            out
        }
    }
}

const DAY_MS: f64 = 86_400_000.0;
const TIME_STEPS_MS: [f64; 30] = [
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    50.0,
    100.0,
    200.0,
    500.0,
    1e3,
    2e3,
    5e3,
    10e3,
    15e3,
    30e3,
    60e3,
    120e3,
    300e3,
    600e3,
    900e3,
    1_800e3,
    3_600e3,
    7_200e3,
    10_800e3,
    21_600e3,
    43_200e3,
    DAY_MS,
    2.0 * DAY_MS,
    7.0 * DAY_MS,
    14.0 * DAY_MS,
];

/// Rounds a linear axis's top up to its last tick, so the data end below a labelled line.
pub fn round_up(scale: Scale, count: usize, time: bool) -> Scale {
    match scale {
        Scale::Linear { lo, hi } => {
            let t = ticks(scale, count, time);
            let step = if t.len() > 1 { t[1] - t[0] } else { hi - lo };
            let top = t.last().copied().unwrap_or(hi);
            Scale::Linear {
                lo,
                hi: if top + step * 1e-9 < hi {
                    top + step
                } else {
                    top.max(hi)
                },
            }
        }
        log => log,
    }
}

/// Escapes text for element content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            c => out.push(c),
        }
    }
    out
}

/// `x,y x,y …` for a `points` attribute.
fn point_list(points: &[(f64, f64)]) -> String {
    let list: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    list.join(" ")
}

/// A document being written: elements appended in order.
pub struct Svg {
    width: f64,
    height: f64,
    body: String,
}

impl Svg {
    pub fn new(width: f64, height: f64) -> Self {
        Self {
            width,
            height,
            body: String::new(),
        }
    }

    /// Appends raw markup (already escaped).
    pub fn raw(&mut self, markup: &str) {
        self.body.push_str(markup);
        self.body.push('\n');
    }

    /// Text; `anchor` is `start`, `middle` or `end`; `attrs` is extra markup.
    pub fn text(&mut self, x: f64, y: f64, anchor: &str, attrs: &str, text: &str) {
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}"{attrs}>{}</text>"#,
            escape(text)
        );
    }

    pub fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), attrs: &str) {
        let _ = writeln!(
            self.body,
            r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}"{attrs}/>"#
        );
    }

    pub fn polyline(&mut self, points: &[(f64, f64)], attrs: &str) {
        let list = point_list(points);
        let _ = writeln!(
            self.body,
            r#"<polyline points="{list}" fill="none"{attrs}/>"#
        );
    }

    pub fn polygon(&mut self, points: &[(f64, f64)], attrs: &str) {
        let list = point_list(points);
        let _ = writeln!(self.body, r#"<polygon points="{list}"{attrs}/>"#);
    }

    /// A rectangle from two corners in any order.
    pub fn rect(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), attrs: &str) {
        let (x, y) = (x1.min(x2), y1.min(y2));
        let (w, h) = ((x1 - x2).abs(), (y1 - y2).abs());
        let _ = writeln!(
            self.body,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}"{attrs}/>"#
        );
    }

    pub fn circle(&mut self, (x, y): (f64, f64), r: f64, attrs: &str) {
        let _ = writeln!(
            self.body,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="{r:.1}"{attrs}/>"#
        );
    }

    pub fn finish(self, title: &str) -> String {
        let (w, h) = (self.width, self.height);
        format!(
            r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="DejaVu Sans, Verdana, sans-serif" font-size="12">
<title>{}</title>
<rect x="0" y="0" width="{w:.0}" height="{h:.0}" fill="#ffffff"/>
{}</svg>
"##,
            escape(title),
            self.body
        )
    }
}

/// A plot area with its axes, drawn as a group with `id` (so readers and tests can find it).
pub struct Panel {
    pub x: Axis,
    pub y: Axis,
}

/// How an axis labels its ticks.
pub type Label<'a> = &'a dyn Fn(f64) -> String;

/// Draws the frame, grid, ticks and labels of a panel whose plot area is `(left, top)` to
/// `(right, bottom)`, and returns its axes.
#[allow(clippy::too_many_arguments)]
pub fn panel(
    svg: &mut Svg,
    (left, top, right, bottom): (f64, f64, f64, f64),
    title: &str,
    (x_scale, x_title, x_label, x_time): (Scale, &str, Label<'_>, bool),
    (y_scale, y_title, y_label, y_time): (Scale, &str, Label<'_>, bool),
    x_ticks: Option<Vec<f64>>,
) -> Panel {
    let x = Axis {
        scale: x_scale,
        from: left,
        to: right,
    };
    let y = Axis {
        scale: y_scale,
        from: bottom,
        to: top,
    };
    svg.text(
        (left + right) / 2.0,
        top - 12.0,
        "middle",
        r#" font-size="14" font-weight="bold""#,
        title,
    );
    let grid = r##" stroke="#e0e0e0" stroke-width="1""##;
    let tick = |v: f64| format!(r##" class="tick" data-value="{v}" stroke="#333333""##);
    axis_group(svg, "y", y_scale);
    for v in ticks(y_scale, 5, y_time) {
        let py = y.px(v);
        svg.line((left, py), (right, py), grid);
        svg.line((left - 4.0, py), (left, py), &tick(v));
        svg.text(left - 7.0, py + 4.0, "end", "", &y_label(v));
    }
    svg.raw("</g>");
    axis_group(svg, "x", x_scale);
    for v in x_ticks.unwrap_or_else(|| ticks(x_scale, 6, x_time)) {
        let px = x.px(v);
        svg.line((px, top), (px, bottom), grid);
        svg.line((px, bottom), (px, bottom + 4.0), &tick(v));
        svg.text(px, bottom + 17.0, "middle", "", &x_label(v));
    }
    svg.raw("</g>");
    svg.rect(
        (left, top),
        (right, bottom),
        r##" fill="none" stroke="#333333" stroke-width="1""##,
    );
    svg.text((left + right) / 2.0, bottom + 36.0, "middle", "", x_title);
    let cy = (top + bottom) / 2.0;
    svg.text(
        left - 58.0,
        cy,
        "middle",
        &format!(r#" transform="rotate(-90 {:.1} {cy:.1})""#, left - 58.0),
        y_title,
    );
    Panel { x, y }
}

/// Opens the group of an axis's ticks, which says its scale (for readers and tests).
fn axis_group(svg: &mut Svg, axis: &str, scale: Scale) {
    let (kind, lo, hi) = match scale {
        Scale::Linear { lo, hi } => ("linear", lo, hi),
        Scale::Log { lo, hi } => ("log", lo, hi),
    };
    svg.raw(&format!(
        r#"<g class="axis" data-axis="{axis}" data-scale="{kind}" data-lo="{lo}" data-hi="{hi}">"#
    ));
}

/// A legend box at `(x, y)` (top left): one row per `(swatch markup, label)`; a swatch is
/// drawn by `draw(svg, x, y_middle, i)`.
pub fn legend(
    svg: &mut Svg,
    (x, y): (f64, f64),
    labels: &[String],
    draw: &dyn Fn(&mut Svg, f64, f64, usize),
) {
    let width = 34.0 + 7.0 * labels.iter().map(|l| l.chars().count()).max().unwrap_or(0) as f64;
    let height = 8.0 + 18.0 * labels.len() as f64;
    svg.raw(r#"<g class="legend">"#);
    svg.rect(
        (x, y),
        (x + width, y + height),
        r##" fill="#ffffff" fill-opacity="0.9" stroke="#999999""##,
    );
    for (i, label) in labels.iter().enumerate() {
        let cy = y + 13.0 + 18.0 * i as f64;
        draw(svg, x + 6.0, cy, i);
        svg.text(x + 30.0, cy + 4.0, "start", "", label);
    }
    svg.raw("</g>");
}

/// `12`, `1.5k`, `20k`, `3M`: counts on an axis.
pub fn count_label(v: f64) -> String {
    let trim = |x: f64| {
        let s = format!("{x:.1}");
        s.strip_suffix(".0").map(str::to_owned).unwrap_or(s)
    };
    if v >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if v >= 1e3 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_scales_span_whole_decades() {
        match Scale::fit(3.0, 4_500.0, 50.0) {
            Scale::Log { lo, hi } => assert_eq!((lo, hi), (1.0, 10_000.0)),
            other => panic!("{other:?}"),
        }
        assert!(!Scale::fit(100.0, 400.0, 50.0).is_log());
    }

    #[test]
    fn ticks_are_round_and_inside_the_scale() {
        let s = Scale::Linear { lo: 0.0, hi: 95.0 };
        assert_eq!(ticks(s, 5, false), vec![0.0, 20.0, 40.0, 60.0, 80.0]);
        let t = ticks(
            Scale::Linear {
                lo: 0.0,
                hi: 250_000.0,
            },
            6,
            true,
        );
        assert_eq!(t[1], 60_000.0, "a minute step for four minutes");
        assert_eq!(
            ticks(
                Scale::Log {
                    lo: 1.0,
                    hi: 1000.0
                },
                5,
                false
            ),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
        );
        match round_up(s, 5, false) {
            Scale::Linear { hi, .. } => assert_eq!(hi, 100.0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn log_axes_step_by_one_kind() {
        // Data from 3 s to 20 min: whole decades, ×10 steps only (no ×6 at minutes).
        let s = Scale::fit(3_000.0, 1_200_000.0, 50.0);
        match s {
            Scale::Log { lo, hi } => assert_eq!((lo, hi), (1e3, 1e7)),
            other => panic!("{other:?}"),
        }
        assert_eq!(ticks(s, 5, true), vec![1e3, 1e4, 1e5, 1e6, 1e7]);
        // Few decades: 1–2–5 in every one.
        let narrow = Scale::Log { lo: 1e3, hi: 1e5 };
        assert_eq!(
            ticks(narrow, 5, true),
            vec![1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5]
        );
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(escape(r#"a<b & "c">"#), "a&lt;b &amp; &quot;c&quot;&gt;");
        assert_eq!(count_label(1500.0), "1.5k");
        assert_eq!(count_label(20.0), "20");
    }
}
