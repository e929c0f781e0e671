//! `plot`: SVG pictures of a policy's schedule (delay bands per retry, and the share of
//! jobs given up over time) and of a retry storm (calls and completion time against the
//! number of clients, one line per policy). Every figure comes from the policy crate.

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context as _, Result, bail};
use rebound_policy::{
    PreparedPolicy, Simulation, contention::ContentionRun, duration::format_approx, simulate,
};

use crate::{
    args::{self, Inputs, Namespace, PolicyFilter, Sampling, Seed},
    load::{self, ClusterArgs},
    output,
    simulate::policy_of,
    storm,
    svg::{self, PALETTE, Scale, Svg},
};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Delay bands per retry (min–p50–p99–max) and the share of jobs given up over time,
    /// one row per policy.
    Schedule(ScheduleArgs),
    /// Calls and time until the last client finished against the number of clients (the
    /// `storm` model), one line per policy; give several -f to compare versions.
    Storm(StormArgs),
}

/// The policies drawn and where the picture goes, for either plot.
#[derive(clap::Args)]
pub struct Common {
    #[command(flatten)]
    inputs: Inputs,
    #[command(flatten)]
    policy: PolicyFilter,
    #[command(flatten)]
    namespace: Namespace,
    /// Write the SVG here instead of stdout.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// `plot schedule`.
#[derive(clap::Args)]
pub struct ScheduleArgs {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    sampling: Sampling,
}

/// `plot storm`.
#[derive(clap::Args)]
pub struct StormArgs {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    storm: args::Storm,
    #[command(flatten)]
    seed: Seed,
    /// Seeds per point (SEED, SEED+1, …): the line is their mean, the band their range.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=100))]
    seeds: u32,
}

pub fn run(cluster: &ClusterArgs, command: &Command) -> Result<ExitCode> {
    match command {
        Command::Schedule(a) => {
            let policies = load(cluster, &a.common)?;
            let Sampling { samples, seed } = a.sampling;
            let svg = schedule_svg(&policies, samples, seed.seed);
            write(&svg, a.common.out.as_ref())
        }
        Command::Storm(a) => {
            let policies = load(cluster, &a.common)?;
            let (seed, seeds) = (a.seed.seed, a.seeds);
            let series = storm_series(&policies, &a.storm, seed, seeds);
            let svg = storm_svg(&series, &a.storm, seed, seeds);
            write(&svg, a.common.out.as_ref())
        }
    }
}

/// A policy to draw, with the name its lines carry.
pub struct Labelled {
    pub label: String,
    pub policy: PreparedPolicy,
}

/// The policies the inputs name (`--policy`: these metadata.names, all when none), labelled
/// `name`, or `name (file)` when several files hold policies of that name.
fn load(cluster: &ClusterArgs, common: &Common) -> Result<Vec<Labelled>> {
    let (inputs, namespace) = (&common.inputs, &common.namespace.namespace);
    let mut found = Vec::new();
    let groups: Vec<(String, Inputs)> = if inputs.files.is_empty() {
        vec![(String::new(), inputs.clone())]
    } else {
        inputs
            .files
            .iter()
            .map(|f| {
                let one = Inputs {
                    files: vec![f.clone()],
                    recursive: inputs.recursive,
                };
                (f.display().to_string(), one)
            })
            .collect()
    };
    for (source, group) in groups {
        let ns = load::namespace(cluster, &group, namespace.clone())?;
        for p in &ns.policies {
            let name = p.metadata.name.clone().unwrap_or_default();
            if common.policy.admits(Some(&name)) {
                let (_, _, policy) = policy_of(p, &ns.namespace)?;
                found.push((name, source.clone(), policy));
            }
        }
    }
    if found.is_empty() {
        bail!("no RetryPolicy to plot");
    }
    let sources = |name: &str| {
        let mut s: Vec<&str> = found
            .iter()
            .filter(|(n, ..)| n == name)
            .map(|(_, s, _)| s.as_str())
            .collect();
        s.dedup();
        s.len()
    };
    let labels: Vec<String> = found
        .iter()
        .map(|(name, source, _)| {
            if sources(name) > 1 {
                format!("{name} ({source})")
            } else {
                name.clone()
            }
        })
        .collect();
    Ok(found
        .into_iter()
        .zip(labels)
        .map(|((_, _, policy), label)| Labelled { label, policy })
        .collect())
}

/// Writes the SVG to `out`, or to stdout.
fn write(svg: &str, out: Option<&PathBuf>) -> Result<ExitCode> {
    match out {
        Some(path) => {
            std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?
        }
        None => output::emit(svg)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Time from the first failure to giving up for each of `samples` jobs that fail every
/// run, sorted: the same jobs (draws per sample from `seed`) as [`simulate`], so its
/// percentiles are this list's.
pub fn give_up_times(policy: &PreparedPolicy, samples: u32, seed: u64) -> Vec<u64> {
    let mut out: Vec<u64> = (0..samples)
        .map(|sample| simulate::fail_every_run(policy, sample, seed, |_, _| {}).0)
        .collect();
    out.sort_unstable();
    out
}

const WIDTH: f64 = 1000.0;
const ROW: f64 = 330.0;
const HEADER: f64 = 40.0;

/// Axis labels: `format_approx` without its zero parts (`1m`, not `1m0s`; `2s`, not `2.00s`).
fn ms_label(v: f64) -> String {
    let text = format_approx(v.round().max(0.0) as u64);
    for (zero, unit) in [(".00s", "s"), (".0s", "s"), ("m0s", "m"), ("h0m", "h")] {
        if let Some(head) = text.strip_suffix(zero) {
            return format!("{head}{unit}");
        }
    }
    text
}

/// Labels of log time axes, whose ticks are decades or 1–2–5 of milliseconds: in ms below a
/// second and whole seconds above (`100s`, not `1m40s`, which would hide the step).
fn log_ms_label(v: f64) -> String {
    if v < 1_000.0 {
        return format!("{}ms", v.round());
    }
    let digits = ((v / 1_000.0).round() as u64).to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out + "s"
}

/// The tick labels of a time axis on `scale`.
fn time_label(scale: Scale) -> svg::Label<'static> {
    if scale.is_log() {
        &log_ms_label
    } else {
        &ms_label
    }
}

/// The schedule picture: one row per policy, delay bands on the left, the share of jobs
/// given up over time on the right.
pub fn schedule_svg(policies: &[Labelled], samples: u32, seed: u64) -> String {
    let height = HEADER + ROW * policies.len() as f64;
    let mut doc = Svg::new(WIDTH, height);
    let title = "Retry schedule".to_owned();
    for (row, p) in policies.iter().enumerate() {
        let sim = simulate(&p.policy, samples, seed, true);
        let times = give_up_times(&p.policy, sim.samples, seed);
        let top = HEADER + ROW * row as f64 + 40.0;
        let bottom = top + ROW - 110.0;
        doc.raw(&format!(
            r#"<g class="policy" data-policy="{}" data-samples="{}" data-seed="{seed}">"#,
            svg::escape(&p.label),
            sim.samples
        ));
        bands(&mut doc, (80.0, top, 470.0, bottom), &p.label, &sim);
        given_up(
            &mut doc,
            (590.0, top, 960.0, bottom),
            &p.label,
            &sim,
            &times,
        );
        doc.raw("</g>");
    }
    doc.text(
        WIDTH / 2.0,
        24.0,
        "middle",
        r#" font-size="16" font-weight="bold""#,
        &format!(
            "{title}: jobs that fail every run ({} simulated per policy, seed {seed})",
            policies
                .first()
                .map(|p| simulate(&p.policy, samples, seed, false).samples)
                .unwrap_or(samples)
        ),
    );
    doc.finish(&title)
}

/// Delay before each retry: min–max (light), p50–p99 (dark), p50 (a bar across).
fn bands(doc: &mut Svg, frame: (f64, f64, f64, f64), label: &str, sim: &Simulation) {
    let (left, _, right, _) = frame;
    let retries = sim.retries.len();
    let n = retries.max(1) as f64;
    let min_positive = sim
        .retries
        .iter()
        .map(|r| r.p50_ms)
        .filter(|&v| v > 0)
        .min()
        .unwrap_or(1) as f64;
    let max = sim.retries.iter().map(|r| r.max_ms).max().unwrap_or(1) as f64;
    let y = svg::round_up(Scale::fit(min_positive, max, 50.0), 5, true);
    let x = Scale::Linear {
        lo: 0.5,
        hi: n + 0.5,
    };
    let x_ticks: Vec<f64> = if retries <= 15 {
        (1..=retries.max(1)).map(|r| r as f64).collect()
    } else {
        svg::ticks(Scale::Linear { lo: 0.0, hi: n }, 6, false)
            .into_iter()
            .filter(|&t| t >= 1.0 && t.fract() == 0.0)
            .collect()
    };
    let scale_note = if y.is_log() { " (log scale)" } else { "" };
    doc.raw(r#"<g class="panel" data-panel="delays">"#);
    let panel = svg::panel(
        doc,
        frame,
        &format!("{label}: delay before each retry"),
        (x, "retry", &|v| format!("{v:.0}"), false),
        (y, &format!("delay{scale_note}"), time_label(y), true),
        Some(x_ticks),
    );
    let floor = y.floor();
    let mut clipped_any = false;
    let width = ((right - left) / n * 0.6).clamp(0.5, 28.0);
    let color = PALETTE[0];
    for r in &sim.retries {
        let cx = panel.x.px(f64::from(r.retry));
        let (x1, x2) = (cx - width / 2.0, cx + width / 2.0);
        let py = |v: u64| panel.y.px(v as f64);
        doc.raw(&format!(
            r#"<g class="band" data-retry="{}" data-min-ms="{}" data-p50-ms="{}" data-p99-ms="{}" data-max-ms="{}">"#,
            r.retry, r.min_ms, r.p50_ms, r.p99_ms, r.max_ms
        ));
        doc.rect(
            (x1, py(r.min_ms)),
            (x2, py(r.max_ms)),
            &format!(r#" class="range" fill="{color}" fill-opacity="0.25""#),
        );
        doc.rect(
            (x1, py(r.p50_ms)),
            (x2, py(r.p99_ms).min(py(r.p50_ms) - 1.0)),
            &format!(r#" class="p50-p99" fill="{color}" fill-opacity="0.8""#),
        );
        doc.line(
            (x1, py(r.p50_ms)),
            (x2, py(r.p50_ms)),
            r##" class="p50" stroke="#000000" stroke-width="2""##,
        );
        // A minimum below the axis is drawn at its floor: say so with a downward arrow.
        if (r.min_ms as f64) < floor {
            clipped_any = true;
            clipped_mark(doc, cx, panel.y.from, " class=\"clipped\"");
        }
        doc.raw("</g>");
    }
    if sim.retries.is_empty() {
        let (top, bottom) = (panel.y.to, panel.y.from);
        doc.text(
            (left + right) / 2.0,
            (top + bottom) / 2.0,
            "middle",
            "",
            "no retries (maxAttempts 1)",
        );
    }
    let mut labels = ["min–max", "p50–p99", "p50"].map(str::to_owned).to_vec();
    if clipped_any {
        labels.push(format!("min below {}", log_ms_label(floor)));
    }
    svg::legend(
        doc,
        (left + 8.0, panel.y.to + 8.0),
        &labels,
        &|doc, x, y, i| match i {
            3 => clipped_mark(doc, x + 8.0, y + 5.0, ""),
            0 => doc.rect(
                (x, y - 6.0),
                (x + 16.0, y + 6.0),
                &format!(r#" fill="{color}" fill-opacity="0.25""#),
            ),
            1 => doc.rect(
                (x, y - 6.0),
                (x + 16.0, y + 6.0),
                &format!(r#" fill="{color}" fill-opacity="0.8""#),
            ),
            _ => doc.line(
                (x, y),
                (x + 16.0, y),
                r##" stroke="#000000" stroke-width="2""##,
            ),
        },
    );
    doc.raw("</g>");
}

/// A downward arrow with its tip at `(x, y)`: a value lies below the axis.
fn clipped_mark(doc: &mut Svg, x: f64, y: f64, attrs: &str) {
    doc.raw(&format!(
        r##"<path d="M{:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z" fill="#000000"{attrs}/>"##,
        x,
        y,
        x - 4.0,
        y - 7.0,
        x + 4.0,
        y - 7.0
    ));
}

/// Points of the curve: the share of `times` (sorted) at or below each of 400 evenly
/// spaced times up to the scale's end, a non-decreasing step drawn as a line.
fn cdf_points(times: &[u64], hi: f64) -> Vec<(f64, f64)> {
    const STEPS: u32 = 400;
    let n = times.len().max(1) as f64;
    (0..=STEPS)
        .map(|i| {
            let t = hi * f64::from(i) / f64::from(STEPS);
            let at_or_below = times.partition_point(|&x| x as f64 <= t);
            (t, at_or_below as f64 / n)
        })
        .collect()
}

/// The share of jobs given up by each time since their first failure, with p50 and p99.
fn given_up(
    doc: &mut Svg,
    frame: (f64, f64, f64, f64),
    label: &str,
    sim: &Simulation,
    times: &[u64],
) {
    let max = times.last().copied().unwrap_or(0).max(1) as f64;
    let x = svg::round_up(Scale::Linear { lo: 0.0, hi: max }, 5, true);
    let Scale::Linear { hi, .. } = x else {
        unreachable!("a linear scale stays linear")
    };
    let y = Scale::Linear { lo: 0.0, hi: 1.0 };
    doc.raw(r#"<g class="panel" data-panel="given-up">"#);
    let panel = svg::panel(
        doc,
        frame,
        &format!("{label}: jobs given up"),
        (x, "time since the first failure", &ms_label, true),
        (
            y,
            "share of jobs given up",
            &|v| format!("{:.0}%", v * 100.0),
            false,
        ),
        None,
    );
    let color = PALETTE[1];
    let points: Vec<(f64, f64)> = cdf_points(times, hi)
        .into_iter()
        .map(|(t, share)| (panel.x.px(t), panel.y.px(share)))
        .collect();
    doc.polyline(
        &points,
        &format!(r#" class="cdf" stroke="{color}" stroke-width="2""#),
    );
    let g = sim.give_up_after_ms;
    for (i, (name, ms)) in [("p50", g.p50), ("p99", g.p99)].into_iter().enumerate() {
        let px = panel.x.px(ms as f64);
        doc.raw(&format!(
            r#"<g class="marker" data-quantile="{name}" data-ms="{ms}">"#
        ));
        doc.line(
            (px, panel.y.from),
            (px, panel.y.to),
            r##" stroke="#555555" stroke-dasharray="4 3""##,
        );
        let (anchor, dx) = if px > (frame.0 + frame.2) / 2.0 {
            ("end", -4.0)
        } else {
            ("start", 4.0)
        };
        doc.text(
            px + dx,
            panel.y.from - 8.0 - 16.0 * i as f64,
            anchor,
            r##" fill="#333333""##,
            &format!("{name} {}", format_approx(ms)),
        );
        doc.raw("</g>");
    }
    doc.raw("</g>");
}

/// One point of a storm line: the runs of every seed at one number of clients.
pub struct Point {
    pub clients: u32,
    pub runs: Vec<ContentionRun>,
}

impl Point {
    fn mean(&self, figure: Figure) -> f64 {
        let sum: f64 = self.runs.iter().map(|r| figure(r) as f64).sum();
        sum / self.runs.len().max(1) as f64
    }

    fn min(&self, figure: Figure) -> u64 {
        self.runs.iter().map(figure).min().unwrap_or(0)
    }

    fn max(&self, figure: Figure) -> u64 {
        self.runs.iter().map(figure).max().unwrap_or(0)
    }
}

type Figure = fn(&ContentionRun) -> u64;

/// One policy's storm, in client order.
pub struct Series {
    pub label: String,
    pub points: Vec<Point>,
}

/// Each policy's storm for the seeds `seed..seed + seeds`: one seed's curve is jagged, so
/// the line is the mean and a band the range.
pub fn storm_series(
    policies: &[Labelled],
    flags: &args::Storm,
    seed: u64,
    seeds: u32,
) -> Vec<Series> {
    policies
        .iter()
        .map(|p| {
            let per_seed: Vec<Vec<ContentionRun>> = (0..u64::from(seeds.max(1)))
                .map(|k| storm::runs(&p.policy, flags, seed.wrapping_add(k)))
                .collect();
            let points = flags
                .clients
                .0
                .iter()
                .enumerate()
                .map(|(i, &clients)| Point {
                    clients,
                    runs: per_seed.iter().map(|runs| runs[i].clone()).collect(),
                })
                .collect();
            Series {
                label: p.label.clone(),
                points,
            }
        })
        .collect()
}

/// Line dashes and point shapes, cycled with the colours so that series that coincide
/// (two versions of one policy) still show each.
const DASHES: [&str; 6] = ["none", "7 4", "2 3", "10 3 2 3", "4 4", "12 2 2 2 2 2"];
const MARKERS: [&str; 5] = ["circle", "square", "triangle", "diamond", "triangle-down"];

/// The path of a point shape centred on `(x, y)`.
fn marker_path(shape: &str, (x, y): (f64, f64), r: f64) -> String {
    match shape {
        "square" => format!(
            "M{:.1},{:.1} h{:.1} v{:.1} h{:.1} Z",
            x - r,
            y - r,
            2.0 * r,
            2.0 * r,
            -2.0 * r
        ),
        "triangle" => format!(
            "M{x:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z",
            y - r,
            x + r,
            y + r,
            x - r,
            y + r
        ),
        "triangle-down" => format!(
            "M{x:.1},{:.1} L{:.1},{:.1} L{:.1},{:.1} Z",
            y + r,
            x + r,
            y - r,
            x - r,
            y - r
        ),
        "diamond" => format!(
            "M{x:.1},{:.1} L{:.1},{y:.1} L{x:.1},{:.1} L{:.1},{y:.1} Z",
            y - r,
            x + r,
            y + r,
            x - r
        ),
        _ => format!(
            "M{:.1},{y:.1} a{r:.1},{r:.1} 0 1,0 {:.1},0 a{r:.1},{r:.1} 0 1,0 {:.1},0 Z",
            x - r,
            2.0 * r,
            -2.0 * r
        ),
    }
}

/// The style of series `k`: colour, dash, point shape.
fn style(k: usize) -> (&'static str, &'static str, &'static str) {
    (
        PALETTE[k % PALETTE.len()],
        DASHES[k % DASHES.len()],
        MARKERS[k % MARKERS.len()],
    )
}

/// The storm picture: calls (left) and the time the last client finished (right) against
/// the number of clients, one line per policy (the mean over seeds, the range as a band);
/// a ring marks points where clients gave up.
pub fn storm_svg(series: &[Series], flags: &args::Storm, seed: u64, seeds: u32) -> String {
    let gave_up_any = series
        .iter()
        .flat_map(|s| &s.points)
        .any(|p| p.max(|r| u64::from(r.gave_up)) > 0);
    let legend_rows = series.len() as f64 + f64::from(u8::from(gave_up_any));
    let height = HEADER + 380.0 + 18.0 * legend_rows;
    let mut doc = Svg::new(WIDTH, height);
    let title = "Retry storm";
    let points = || series.iter().flat_map(|s| &s.points);
    let clients_max = points().map(|p| p.clients).max().unwrap_or(1);
    let x = svg::round_up(
        Scale::Linear {
            lo: 0.0,
            hi: f64::from(clients_max),
        },
        6,
        false,
    );
    let figures: [(&str, &str, Figure, bool, &str); 2] = [
        ("calls", "writes made", |r| r.calls, false, "calls"),
        (
            "completion",
            "last client finished",
            |r| r.completion_ms,
            true,
            "completion-ms",
        ),
    ];
    let (top, bottom) = (HEADER + 40.0, HEADER + 310.0);
    for (i, (kind, what, figure, time, attr)) in figures.into_iter().enumerate() {
        let left = 90.0 + 500.0 * i as f64;
        let min = points()
            .map(|p| p.min(figure))
            .filter(|&v| v > 0)
            .min()
            .unwrap_or(1) as f64;
        let max = points().map(|p| p.max(figure)).max().unwrap_or(1) as f64;
        let y = svg::round_up(Scale::fit(min, max, 50.0), 5, time);
        let note = if y.is_log() { " (log scale)" } else { "" };
        let label: svg::Label<'_> = if time {
            time_label(y)
        } else {
            &svg::count_label
        };
        doc.raw(&format!(r#"<g class="figure" data-figure="{kind}">"#));
        let panel = svg::panel(
            &mut doc,
            (left, top, left + 380.0, bottom),
            &format!("{what} against clients"),
            (x, "clients", &svg::count_label, false),
            (y, &format!("{what}{note}"), label, time),
            None,
        );
        for (k, s) in series.iter().enumerate() {
            let (color, dash, marker) = style(k);
            let px = |p: &Point, v: f64| (panel.x.px(f64::from(p.clients)), panel.y.px(v));
            doc.raw(&format!(
                r#"<g class="series" data-policy="{}" data-dash="{dash}" data-marker="{marker}">"#,
                svg::escape(&s.label)
            ));
            if seeds > 1 {
                let mut outline: Vec<(f64, f64)> = s
                    .points
                    .iter()
                    .map(|p| px(p, p.max(figure) as f64))
                    .collect();
                outline.extend(s.points.iter().rev().map(|p| px(p, p.min(figure) as f64)));
                doc.polygon(
                    &outline,
                    &format!(r#" class="spread" fill="{color}" fill-opacity="0.12""#),
                );
            }
            let line: Vec<(f64, f64)> = s.points.iter().map(|p| px(p, p.mean(figure))).collect();
            doc.polyline(
                &line,
                &format!(
                    r#" class="mean" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}""#
                ),
            );
            for (p, &at) in s.points.iter().zip(&line) {
                let gave_up = p.mean(|r| u64::from(r.gave_up));
                doc.raw(&format!(
                    r#"<path class="point" d="{}" fill="{color}" data-clients="{}" data-{attr}="{:.1}" data-min="{}" data-max="{}" data-gave-up="{gave_up:.1}"/>"#,
                    marker_path(marker, at, 3.5),
                    p.clients,
                    p.mean(figure),
                    p.min(figure),
                    p.max(figure),
                ));
                if gave_up > 0.0 {
                    doc.circle(
                        at,
                        7.0,
                        &format!(
                            r##" class="gave-up" fill="none" stroke="#000000" stroke-width="1.5" data-clients="{}" data-gave-up="{gave_up:.1}""##,
                            p.clients
                        ),
                    );
                }
            }
            doc.raw("</g>");
        }
        doc.raw("</g>");
    }
    let mut labels: Vec<String> = series.iter().map(|s| s.label.clone()).collect();
    if gave_up_any {
        labels.push("clients gave up (mean over seeds)".to_owned());
    }
    let count = series.len();
    svg::legend(&mut doc, (90.0, bottom + 50.0), &labels, &|doc, x, y, i| {
        if i == count {
            doc.circle(
                (x + 8.0, y),
                6.0,
                r##" fill="none" stroke="#000000" stroke-width="1.5""##,
            );
            return;
        }
        let (color, dash, marker) = style(i);
        doc.line(
            (x, y),
            (x + 16.0, y),
            &format!(r#" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}""#),
        );
        doc.raw(&format!(
            r#"<path d="{}" fill="{color}"/>"#,
            marker_path(marker, (x + 8.0, y), 3.5)
        ));
    });
    let over = if seeds > 1 {
        format!(
            "mean and range over seeds {seed}–{}",
            seed.wrapping_add(u64::from(seeds) - 1)
        )
    } else {
        format!("seed {seed}")
    };
    doc.text(
        WIDTH / 2.0,
        24.0,
        "middle",
        r#" font-size="16" font-weight="bold""#,
        &format!("{title}: {}, {over}", storm::describe(flags)),
    );
    doc.finish(title)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_labels_drop_zero_parts() {
        let labels: Vec<String> = [0.0, 250.0, 1e3, 1_500.0, 10e3, 60e3, 90e3, 600e3, 3_600e3]
            .into_iter()
            .map(ms_label)
            .collect();
        assert_eq!(
            labels,
            [
                "0ms", "250ms", "1s", "1.50s", "10s", "1m", "1m30s", "10m", "1h"
            ]
        );
    }

    #[test]
    fn the_curve_rises_to_one_at_the_last_give_up() {
        let points = cdf_points(&[10, 20, 20, 40], 40.0);
        assert_eq!(points.first(), Some(&(0.0, 0.0)));
        assert_eq!(points.last(), Some(&(40.0, 1.0)));
        assert!(
            points
                .windows(2)
                .all(|w| w[0].1 <= w[1].1 && w[0].0 < w[1].0)
        );
        let at_20 = points.iter().find(|p| p.0 == 20.0).expect("a point at 20");
        assert_eq!(at_20.1, 0.75);
    }
}
