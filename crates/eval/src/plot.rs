//! PNG plots of a sweep's summary, drawn with plotters' bitmap backend:
//!
//! - `scores_B{B}.png`: score against KV budget (as a percentage of the context), one line
//!   per policy, one panel per (generative task, length): tasks are rows, lengths columns;
//!   the full cache's score is the dashed grey line, and uncalibrated panels say so.
//! - `kl_B{B}.png`: `text-kl`'s mean KL(p_full ‖ p_policy) against the budget, one panel per
//!   length (top row), and its top-1 agreement with the full cache (bottom row).
//!
//! Text is drawn with DejaVu Sans embedded in the binary (`assets/`, Bitstream Vera licence)
//! through plotters' `ab_glyph` feature, so that plots render the same on a machine without
//! fontconfig or any system font. The bitmap is encoded with the `png` crate.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::report::{Report, SummaryRow};

const FONT: &str = "sans-serif";
const PANEL_WIDTH_PX: u32 = 380;
const PANEL_HEIGHT_PX: u32 = 260;
/// The strip above the panels: figure title and the legend.
const HEADER_HEIGHT_PX: u32 = 70;

/// Distinguishable line colours (Tableau 10 and black), one per policy (see `colour`).
const PALETTE: [RGBColor; 11] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
];

fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            include_bytes!("../assets/DejaVuSans.ttf"),
        )
        .is_ok()
    });
    ok.then_some(())
        .ok_or_else(|| anyhow!("the embedded font does not parse"))
}

/// The pixel size of a figure with `rows` × `cols` panels (at least two panels wide, so
/// that the title and the legend fit).
pub fn figure_size(rows: usize, cols: usize) -> (u32, u32) {
    (
        PANEL_WIDTH_PX * cols.max(2) as u32,
        HEADER_HEIGHT_PX + PANEL_HEIGHT_PX * rows.max(1) as u32,
    )
}

/// Writes every plot the report has data for into `dir`; returns the files written.
pub fn write_plots(report: &Report, dir: &Path) -> Result<Vec<PathBuf>> {
    register_font()?;
    let policies: Vec<String> = report
        .results
        .iter()
        .filter(|r| r.policy != "full")
        .map(|r| r.policy.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let block_sizes: BTreeSet<u32> = report.results.iter().map(|r| r.block_size).collect();
    let mut written = Vec::new();
    for b in block_sizes {
        let rows: Vec<&SummaryRow> = report
            .results
            .iter()
            .filter(|r| r.block_size == b)
            .collect();
        let generative: Vec<&SummaryRow> = rows
            .iter()
            .copied()
            .filter(|r| !r.task.starts_with("text-kl"))
            .collect();
        if !generative.is_empty() {
            let path = dir.join(format!("scores_B{b}.png"));
            scores_figure(&report.model, b, &generative, &policies, &path)?;
            written.push(path);
        }
        for (task, file) in [
            ("text-kl", format!("kl_B{b}.png")),
            (
                "text-kl-keep-continuation",
                format!("kl_keep_continuation_B{b}.png"),
            ),
        ] {
            let kl: Vec<&SummaryRow> = rows.iter().copied().filter(|r| r.task == task).collect();
            if !kl.is_empty() {
                let path = dir.join(file);
                kl_figure(&report.model, b, &kl, &policies, &path)?;
                written.push(path);
            }
        }
    }
    Ok(written)
}

/// Horizontal offset between neighbouring policies' points, in percentage points of the
/// budget axis: scores are coarse (a few samples), so lines often coincide, and a small
/// sideways shift keeps each one visible.
const DODGE_PERCENT: f64 = 0.7;

/// One line of a panel: (budget as % of the context, value) points in budget order, the
/// budget shifted by the policy's dodge.
fn series(
    rows: &[&SummaryRow],
    policies: &[String],
    policy: &str,
    value: impl Fn(&SummaryRow) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let i = policies.iter().position(|p| p == policy).unwrap_or(0) as f64;
    let dodge = (i - (policies.len() as f64 - 1.0) / 2.0) * DODGE_PERCENT;
    let mut pts: Vec<(f64, f64)> = rows
        .iter()
        .filter(|r| r.policy == policy)
        .filter_map(|r| {
            Some((
                100.0 * r.kv_budget? as f64 / r.context_tokens as f64 + dodge,
                value(r)?,
            ))
        })
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

/// Policies with a fixed colour, so that a policy looks the same in every figure and every
/// sweep (PagedEviction first: it is the subject).
const KNOWN_POLICIES: [&str; 11] = [
    "paged-eviction",
    "streaming-llm",
    "keydiff",
    "knorm",
    "snapkv",
    "paged-eviction:inv-k-norm",
    "paged-eviction:ratio:global",
    "tova",
    "h2o",
    "expected-attention",
    "kvzip",
];

/// A known policy's fixed colour; others take the colours after the known ones in use.
fn colour(policies: &[String], policy: &str) -> RGBColor {
    if let Some(i) = KNOWN_POLICIES.iter().position(|p| *p == policy) {
        return PALETTE[i];
    }
    let unknown = policies
        .iter()
        .filter(|p| !KNOWN_POLICIES.contains(&p.as_str()))
        .position(|p| p == policy)
        .unwrap_or(0);
    PALETTE[(KNOWN_POLICIES.len() - 1 - unknown) % PALETTE.len()]
}

fn scores_figure(
    model: &str,
    block_size: u32,
    rows: &[&SummaryRow],
    policies: &[String],
    path: &Path,
) -> Result<()> {
    let tasks: Vec<String> = rows
        .iter()
        .map(|r| r.task.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let lengths: Vec<usize> = rows
        .iter()
        .map(|r| r.context_tokens)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let title =
        format!("{model}: exact-match score vs KV budget, B = {block_size} (dashed: full cache)");
    draw_png(
        path,
        figure_size(tasks.len(), lengths.len()),
        &title,
        policies,
        |panels| {
            let areas = panels.split_evenly((tasks.len(), lengths.len()));
            for (i, task) in tasks.iter().enumerate() {
                for (j, &len) in lengths.iter().enumerate() {
                    let cell: Vec<&SummaryRow> = rows
                        .iter()
                        .copied()
                        .filter(|r| &r.task == task && r.context_tokens == len)
                        .collect();
                    let full = cell.iter().find(|r| r.policy == "full");
                    let caption = match full {
                        Some(f) if f.calibrated => format!("{task} @{len}: full {:.2}", f.score),
                        Some(f) => format!("{task} @{len}: full {:.2} UNCALIBRATED", f.score),
                        None => format!("{task} @{len}"),
                    };
                    let lines: Vec<(RGBColor, Vec<(f64, f64)>)> = policies
                        .iter()
                        .map(|p| {
                            (
                                colour(policies, p),
                                series(&cell, policies, p, |r| Some(r.score)),
                            )
                        })
                        .collect();
                    panel(
                        &areas[i * lengths.len() + j],
                        &caption,
                        "score",
                        0.0..1.05,
                        full.map(|f| f.score),
                        &lines,
                    )?;
                }
            }
            Ok(())
        },
    )
}

fn kl_figure(
    model: &str,
    block_size: u32,
    rows: &[&SummaryRow],
    policies: &[String],
    path: &Path,
) -> Result<()> {
    let lengths: Vec<usize> = rows
        .iter()
        .map(|r| r.context_tokens)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let kl_max = rows
        .iter()
        .filter_map(|r| r.kl_mean)
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    let title = format!("{model}: text-kl vs KV budget, B = {block_size}");
    draw_png(
        path,
        figure_size(2, lengths.len()),
        &title,
        policies,
        |panels| {
            let areas = panels.split_evenly((2, lengths.len()));
            for (j, &len) in lengths.iter().enumerate() {
                let cell: Vec<&SummaryRow> = rows
                    .iter()
                    .copied()
                    .filter(|r| r.context_tokens == len)
                    .collect();
                let kl: Vec<_> = policies
                    .iter()
                    .map(|p| {
                        (
                            colour(policies, p),
                            series(&cell, policies, p, |r| r.kl_mean),
                        )
                    })
                    .collect();
                panel(
                    &areas[j],
                    &format!("text-kl @{len}: mean KL, nats"),
                    "KL (nats)",
                    0.0..kl_max,
                    None,
                    &kl,
                )?;
                let top1: Vec<_> = policies
                    .iter()
                    .map(|p| {
                        (
                            colour(policies, p),
                            series(&cell, policies, p, |r| r.top1_agreement),
                        )
                    })
                    .collect();
                panel(
                    &areas[lengths.len() + j],
                    &format!("text-kl @{len}: top-1 agreement"),
                    "top-1",
                    0.0..1.05,
                    Some(1.0),
                    &top1,
                )?;
            }
            Ok(())
        },
    )
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Draws a white figure with a title and a legend, lets `body` fill the panel area, and
/// encodes the bitmap as PNG.
fn draw_png(
    path: &Path,
    size: (u32, u32),
    title: &str,
    policies: &[String],
    body: impl FnOnce(&Area) -> Result<()>,
) -> Result<()> {
    let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let (header, panels) = root.split_vertically(HEADER_HEIGHT_PX);
        header
            .draw(&Text::new(
                title.to_string(),
                (10, 8),
                (FONT, 17).into_font().color(&BLACK),
            ))
            .map_err(plot_err)?;
        // The legend: one short line and name per policy, wrapping across the width.
        let (mut x, mut y) = (10i32, 36i32);
        let legend_font = (FONT, 13).into_font().color(&BLACK);
        for p in policies {
            let w = 40
                + header
                    .estimate_text_size(p, &legend_font)
                    .map_err(plot_err)?
                    .0 as i32;
            if x + w > size.0 as i32 - 10 {
                (x, y) = (10, y + 18);
            }
            let c = colour(policies, p);
            header
                .draw(&PathElement::new(
                    vec![(x, y + 7), (x + 22, y + 7)],
                    c.stroke_width(3),
                ))
                .map_err(plot_err)?;
            header
                .draw(&Text::new(p.clone(), (x + 26, y), legend_font.clone()))
                .map_err(plot_err)?;
            x += w;
        }
        body(&panels)?;
        root.present().map_err(plot_err)?;
    }
    encode_png(path, size, &rgb)
}

/// One chart: x is the budget in % of the context, `reference` a dashed horizontal line.
fn panel(
    area: &Area,
    caption: &str,
    y_desc: &str,
    y: std::ops::Range<f64>,
    reference: Option<f64>,
    lines: &[(RGBColor, Vec<(f64, f64)>)],
) -> Result<()> {
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 14))
        .margin(6)
        .margin_right(18)
        .x_label_area_size(32)
        .y_label_area_size(44)
        .build_cartesian_2d(0.0..100.0, y.clone())
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("KV budget, % of context")
        .y_desc(y_desc)
        .x_labels(6)
        .y_labels(6)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .label_style((FONT, 11))
        .axis_desc_style((FONT, 12))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(plot_err)?;
    if let Some(r) = reference {
        let grey = RGBColor(90, 90, 90).stroke_width(2);
        chart
            .draw_series(DashedLineSeries::new([(0.0, r), (100.0, r)], 6, 4, grey))
            .map_err(plot_err)?;
    }
    for (c, pts) in lines.iter().filter(|(_, p)| !p.is_empty()) {
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(plot_err)?;
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(plot_err)?;
    }
    Ok(())
}

fn plot_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing a plot: {e:?}")
}

fn encode_png(path: &Path, size: (u32, u32), rgb: &[u8]) -> Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), size.0, size.1);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc
        .write_header()
        .with_context(|| format!("writing {}", path.display()))?;
    w.write_image_data(rgb)
        .with_context(|| format!("writing {}", path.display()))?;
    w.finish()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// What a decoded PNG looks like, for tests: its size, the fraction of pixels that are not
/// white, and how many distinct colours it has.
#[derive(Clone, Copy, Debug)]
pub struct PngSummary {
    pub width_px: u32,
    pub height_px: u32,
    pub non_white_fraction: f64,
    pub distinct_colours: usize,
}

/// Decodes an 8-bit RGB or RGBA PNG (what `write_plots` writes) and summarises it.
pub fn inspect_png(path: &Path) -> Result<PngSummary> {
    let (width_px, height_px, pixels) = decode_rgb(path)?;
    let non_white = pixels.iter().filter(|p| **p != [255, 255, 255]).count();
    let distinct: BTreeSet<[u8; 3]> = pixels.iter().copied().collect();
    Ok(PngSummary {
        width_px,
        height_px,
        non_white_fraction: non_white as f64 / pixels.len().max(1) as f64,
        distinct_colours: distinct.len(),
    })
}

/// Width, height and row-major RGB pixels of an 8-bit RGB or RGBA PNG.
fn decode_rgb(path: &Path) -> Result<(u32, u32, Vec<[u8; 3]>)> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut reader = png::Decoder::new(std::io::BufReader::new(file))
        .read_info()
        .with_context(|| format!("decoding {}", path.display()))?;
    let mut buf = vec![0u8; reader.output_buffer_size()];
    let info = reader
        .next_frame(&mut buf)
        .with_context(|| format!("decoding {}", path.display()))?;
    let channels = match (info.color_type, info.bit_depth) {
        (png::ColorType::Rgb, png::BitDepth::Eight) => 3,
        (png::ColorType::Rgba, png::BitDepth::Eight) => 4,
        other => anyhow::bail!("{}: unexpected colour type {other:?}", path.display()),
    };
    let pixels = buf[..info.buffer_size()]
        .chunks_exact(channels)
        .map(|p| [p[0], p[1], p[2]])
        .collect();
    Ok((info.width, info.height, pixels))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(
        task: &str,
        len: usize,
        policy: &str,
        budget: Option<u32>,
        score: f64,
        kl: Option<f64>,
    ) -> SummaryRow {
        SummaryRow {
            task: task.into(),
            context_tokens: len,
            policy: policy.into(),
            kv_granularity: "shared".into(),
            kv_budget: budget,
            block_size: 16,
            score,
            kl_mean: kl,
            top1_agreement: kl.map(|k| 1.0 - k),
            samples: 2,
            token_f1: None,
            rouge_l: None,
            delta_ppl: None,
            full_score: Some(1.0),
            calibrated: task != "passkey",
        }
    }

    fn report() -> Report {
        let mut results = Vec::new();
        for len in [1024, 2048] {
            for task in ["passkey", "niah-single", "text-kl"] {
                let kl = |x: f64| (task == "text-kl").then_some(x);
                results.push(row(task, len, "full", None, 1.0, kl(0.0)));
                for (i, frac) in [0.25, 0.5, 0.75].into_iter().enumerate() {
                    let b = Some((frac * len as f64) as u32);
                    results.push(row(
                        task,
                        len,
                        "paged-eviction",
                        b,
                        0.3 * i as f64,
                        kl(0.4 - 0.1 * i as f64),
                    ));
                    results.push(row(
                        task,
                        len,
                        "streaming-llm",
                        b,
                        0.2 + 0.3 * i as f64,
                        kl(0.3 - 0.1 * i as f64),
                    ));
                }
            }
        }
        Report {
            model: "test-model".into(),
            results,
        }
    }

    #[test]
    fn plots_are_written_with_the_expected_size_lines_and_text() {
        let dir = std::env::temp_dir().join(format!("pk-eval-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = write_plots(&report(), &dir).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["scores_B16.png", "kl_B16.png"]);
        // Scores: two generative tasks × two lengths; KL: two rows (KL, top-1) × two lengths.
        for f in &files {
            let s = inspect_png(f).unwrap();
            assert_eq!(
                (s.width_px, s.height_px),
                figure_size(2, 2),
                "{}",
                f.display()
            );
            assert!(
                s.non_white_fraction > 0.02 && s.non_white_fraction < 0.5,
                "{}: {s:?}",
                f.display()
            );
            let (w, _, px) = decode_rgb(f).unwrap();
            // Both policies' line colours are drawn (legend and lines).
            for c in [PALETTE[0], PALETTE[1]] {
                assert!(
                    px.contains(&[c.0, c.1, c.2]),
                    "{}: colour {c:?} missing",
                    f.display()
                );
            }
            // The title is text: dark, anti-aliased pixels in the header's first rows.
            let title_dark = px[..w as usize * 28]
                .iter()
                .filter(|p| p.iter().all(|&v| v < 80))
                .count();
            let title_grey = px[..w as usize * 28]
                .iter()
                .filter(|p| p.iter().all(|&v| v > 80 && v < 200))
                .count();
            assert!(
                title_dark > 100 && title_grey > 20,
                "{}: no title text ({title_dark} dark, {title_grey} grey pixels)",
                f.display()
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_report_without_rows_writes_nothing() {
        let dir = std::env::temp_dir().join(format!("pk-eval-plot-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(write_plots(
            &Report {
                model: "m".into(),
                results: vec![]
            },
            &dir
        )
        .unwrap()
        .is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
