//! Plain SVG line charts (no dependency): the TTFT CDF per policy and the burst timeline.

use std::fmt::Write as _;

use super::report::{Bucket, PolicyReport};

const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

struct Series<'a> {
    name: &'a str,
    color: &'a str,
    points: Vec<(f64, f64)>,
}

struct Panel<'a> {
    title: String,
    x_label: &'a str,
    y_label: &'a str,
    x: (f64, f64),
    y: (f64, f64),
    log_x: bool,
    /// Format of the y tick labels: percent of 1 or plain.
    y_percent: bool,
    /// Shaded x ranges with a label.
    shade: Vec<(f64, f64, &'a str)>,
    series: Vec<Series<'a>>,
}

const WIDTH: f64 = 760.0;
const PANEL_HEIGHT: f64 = 300.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 44.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn nice_ticks(low: f64, high: f64, count: usize) -> Vec<f64> {
    let span = (high - low).max(1e-9);
    let raw = span / count as f64;
    let magnitude = 10_f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|step| span / step <= count as f64)
        .unwrap_or(magnitude * 10.0);
    let mut ticks = Vec::new();
    let mut tick = (low / step).ceil() * step;
    while tick <= high + step * 1e-6 {
        ticks.push(tick);
        tick += step;
    }
    ticks
}

fn label(value: f64) -> String {
    if value.abs() >= 100.0 || value == value.round() {
        format!("{value:.0}")
    } else if value.abs() >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

// Over 100 lines: one panel drawn top to bottom (frame, shading, grid, ticks, labels, series) in
// one coordinate system.
fn panel(out: &mut String, panel: &Panel<'_>, top: f64) {
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = PANEL_HEIGHT - TOP - BOTTOM;
    let (x0, x1) = if panel.log_x {
        (panel.x.0.max(1e-3).log10(), panel.x.1.max(1e-3).log10())
    } else {
        panel.x
    };
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let (y0, y1) = panel.y;
    let y1 = if y1 > y0 { y1 } else { y0 + 1.0 };
    let sx = |x: f64| {
        let x = if panel.log_x { x.max(1e-3).log10() } else { x };
        LEFT + (x - x0) / (x1 - x0) * plot_w
    };
    let sy = |y: f64| top + TOP + plot_h - (y.clamp(y0, y1) - y0) / (y1 - y0) * plot_h;
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        LEFT,
        top + 22.0,
        escape(&panel.title)
    );
    for (from, to, name) in &panel.shade {
        let (a, b) = (sx(*from).max(LEFT), sx(*to).min(LEFT + plot_w));
        let _ = writeln!(
            out,
            r##"<rect x="{a:.1}" y="{:.1}" width="{:.1}" height="{plot_h:.1}" fill="#f2d7d5"/><text x="{:.1}" y="{:.1}" font-size="11" fill="#922b21">{}</text>"##,
            top + TOP,
            (b - a).max(0.0),
            a + 4.0,
            top + TOP + 14.0,
            escape(name)
        );
    }
    // Grid and ticks.
    let y_ticks = nice_ticks(y0, y1, 5);
    for tick in &y_ticks {
        let y = sy(*tick);
        let text = if panel.y_percent {
            format!("{:.0}%", tick * 100.0)
        } else {
            label(*tick)
        };
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{text}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            y + 4.0
        );
    }
    let x_ticks: Vec<f64> = if panel.log_x {
        let mut ticks = Vec::new();
        let mut decade = 10_f64.powf(x0.floor());
        while decade <= 10_f64.powf(x1) * 1.0001 {
            for m in [1.0, 2.0, 5.0] {
                let tick = decade * m;
                if tick.log10() >= x0 - 1e-9 && tick.log10() <= x1 + 1e-9 {
                    ticks.push(tick);
                }
            }
            decade *= 10.0;
        }
        ticks
    } else {
        nice_ticks(x0, x1, 8)
    };
    for tick in &x_ticks {
        let x = sx(*tick);
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"##,
            top + TOP,
            top + TOP + plot_h,
            top + TOP + plot_h + 15.0,
            label(*tick)
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{:.1}" width="{plot_w:.1}" height="{plot_h:.1}" fill="none" stroke="#444"/>"##,
        top + TOP
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        top + PANEL_HEIGHT - 8.0,
        escape(panel.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text x="16" y="{:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 16 {:.1})">{}</text>"#,
        top + TOP + plot_h / 2.0,
        top + TOP + plot_h / 2.0,
        escape(panel.y_label)
    );
    for (index, series) in panel.series.iter().enumerate() {
        let points: Vec<String> = series
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
            .collect();
        if points.len() > 1 {
            let _ = writeln!(
                out,
                r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
                series.color,
                points.join(" ")
            );
        }
        let ly = top + TOP + 12.0 + index as f64 * 18.0;
        let lx = LEFT + plot_w + 12.0;
        let _ = writeln!(
            out,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="3"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            lx + 22.0,
            series.color,
            lx + 28.0,
            ly + 4.0,
            escape(series.name)
        );
    }
}

fn document(panels: &[Panel<'_>], caption: &str) -> String {
    let height = PANEL_HEIGHT * panels.len() as f64 + 24.0;
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">"#
    );
    out.push('\n');
    out.push_str("<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
    for (index, p) in panels.iter().enumerate() {
        panel(&mut out, p, index as f64 * PANEL_HEIGHT);
    }
    let _ = writeln!(
        out,
        r##"<text x="{LEFT}" y="{:.1}" font-size="11" fill="#555">{}</text>"##,
        height - 8.0,
        escape(caption)
    );
    out.push_str("</svg>\n");
    out
}

/// The CDF of successful requests' TTFT, one line per policy, log-scaled milliseconds.
pub fn ttft_cdf(reports: &[PolicyReport], caption: &str) -> String {
    let low = reports
        .iter()
        .filter_map(|r| r.ttft_sorted_ms.first().copied())
        .fold(f64::INFINITY, f64::min);
    let high = reports
        .iter()
        .filter_map(|r| r.ttft_sorted_ms.last().copied())
        .fold(0.0, f64::max);
    let low = if low.is_finite() {
        low.max(0.1) * 0.9
    } else {
        1.0
    };
    let high = (high * 1.1).max(low * 10.0);
    let series = reports
        .iter()
        .enumerate()
        .map(|(index, r)| {
            let n = r.ttft_sorted_ms.len();
            // At most ~400 points per line.
            let step = (n / 400).max(1);
            let mut points: Vec<(f64, f64)> = r
                .ttft_sorted_ms
                .iter()
                .enumerate()
                .filter(|(i, _)| i % step == 0 || *i + 1 == n)
                .map(|(i, v)| (*v, (i + 1) as f64 / n as f64))
                .collect();
            if let Some(first) = r.ttft_sorted_ms.first() {
                points.insert(0, (*first, 0.0));
            }
            Series {
                name: &r.arm,
                color: color(index),
                points,
            }
        })
        .collect();
    document(
        &[Panel {
            title: if reports.iter().all(|r| r.arm == r.policy) {
                "TTFT CDF per policy".to_owned()
            } else {
                "TTFT CDF per arm (policy / index mode / picker replicas)".to_owned()
            },
            x_label: "time to first token, ms (log scale)",
            y_label: "share of requests",
            x: (low, high),
            y: (0.0, 1.0),
            log_x: true,
            y_percent: true,
            shade: Vec::new(),
            series,
        }],
        caption,
    )
}

/// One series per policy: `value` at the start of each time bucket that has one.
fn timeline_series<'a>(
    reports: &[&'a PolicyReport],
    value: impl Fn(&Bucket) -> Option<f64>,
) -> Vec<Series<'a>> {
    reports
        .iter()
        .enumerate()
        .map(|(index, r)| Series {
            name: &r.arm,
            color: color(index),
            points: r
                .timeline
                .iter()
                .filter_map(|b| value(b).map(|v| (b.start_s, v)))
                .collect(),
        })
        .collect()
}

/// Hit rate and TTFT p50 per time bucket for the given policies, the burst shaded.
pub fn timeline(reports: &[&PolicyReport], burst: (f64, f64), caption: &str) -> String {
    let end = reports
        .iter()
        .filter_map(|r| r.timeline.last().map(|b| b.start_s))
        .fold(0.0, f64::max);
    let ttft_high = reports
        .iter()
        .flat_map(|r| r.timeline.iter().filter_map(|b| b.ttft_p50_ms))
        .fold(0.0, f64::max);
    let hit = timeline_series(reports, |b| b.hit_rate);
    let ttft = timeline_series(reports, |b| b.ttft_p50_ms);
    let width = reports
        .first()
        .and_then(|r| r.timeline.get(1).map(|b| b.start_s))
        .unwrap_or(1.0);
    document(
        &[
            Panel {
                title: format!("Prefix-hit rate per {width:.0} s of arrivals"),
                x_label: "replay time, s",
                y_label: "prefix-hit rate",
                x: (0.0, end.max(1.0)),
                y: (0.0, 1.0),
                log_x: false,
                y_percent: true,
                shade: vec![(burst.0, burst.1, "burst")],
                series: hit,
            },
            Panel {
                title: format!("TTFT p50 per {width:.0} s of arrivals"),
                x_label: "replay time, s",
                y_label: "TTFT p50, ms",
                x: (0.0, end.max(1.0)),
                y: (0.0, (ttft_high * 1.1).max(1.0)),
                log_x: false,
                y_percent: false,
                shade: vec![(burst.0, burst.1, "burst")],
                series: ttft,
            },
        ],
        caption,
    )
}

/// The `index`th series colour, cycling.
fn color(index: usize) -> &'static str {
    COLORS
        .get(index % COLORS.len())
        .copied()
        .unwrap_or("#000000")
}
