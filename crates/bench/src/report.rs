//! The markdown table, CSV, JSON and SVG outputs.

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::Serialize;

use crate::Args;
use crate::measure::{OPS, Record};

/// The machine the numbers come from.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu: String,
    /// The widest vector instructions the host loops and `gemm` pick on this CPU: the CPU
    /// figures depend on it (AVX-512 runs the products about twice as fast as AVX2).
    pub vectors: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub os: String,
}

impl Machine {
    pub fn detect() -> Self {
        let mut system = sysinfo::System::new();
        system.refresh_cpu_all();
        system.refresh_memory();
        let cpu = system
            .cpus()
            .first()
            .map(|c| c.brand().trim().to_string())
            .unwrap_or_else(|| "unknown CPU".to_string());
        Self {
            cpu,
            vectors: vector_extensions().to_string(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_gib: system.total_memory() as f64 / 1024f64.powi(3),
            os: sysinfo::System::long_os_version().unwrap_or_else(|| std::env::consts::OS.into()),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} ({}, {} cores, {:.0} GiB, {})",
            self.cpu, self.vectors, self.cores, self.memory_gib, self.os
        )
    }
}

/// The vector extensions the host loops of the CPU backends run with, by the rule they pick
/// them at run time.
fn vector_extensions() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512vl") && has!("fma") {
            return "AVX-512";
        }
        if has!("avx2") && has!("fma") {
            return "AVX2 + FMA";
        }
    }
    "no AVX2"
}

#[derive(Serialize)]
struct Output<'a> {
    machine: &'a Machine,
    command: String,
    records: &'a [Record],
}

fn cell(record: Option<&Record>) -> String {
    match record {
        None => String::new(),
        Some(r) => match (r.median_s, &r.skipped) {
            (Some(t), _) => {
                let time = if t < 1.0 {
                    format!("{:.1} ms", t * 1e3)
                } else {
                    format!("{t:.2} s")
                };
                let time = match r.peak_device_mib.or(r.peak_rss_mib) {
                    Some(mib) if mib >= 1024.0 => format!("{time} ({:.1} GiB)", mib / 1024.0),
                    Some(mib) => format!("{time} ({mib:.0} MiB)"),
                    None => time,
                };
                let time = match r.forward_median_s {
                    Some(forward) => format!("{time}, {:.2}×", t / forward),
                    None => time,
                };
                let time = match r.no_dropout_median_s {
                    Some(baseline) => format!("{time}, dropout {:.2}×", t / baseline),
                    None => time,
                };
                match (r.launches, r.forward_launches) {
                    (Some(n), Some(f)) => format!("{time}; {n} launches ({f} forward)"),
                    (Some(n), None) => format!("{time}; {n} launches"),
                    _ => time,
                }
            }
            (None, Some(_)) => "skipped".into(),
            (None, None) => String::new(),
        },
    }
}

/// Markdown table: one row per (backend, length), one column per op (median times).
pub fn markdown(machine: &Machine, records: &[Record]) -> String {
    let ops: Vec<&str> = OPS
        .iter()
        .copied()
        .filter(|op| records.iter().any(|r| r.op == *op))
        .collect();
    let mut out = String::new();
    if let Some(r) = records.first() {
        let timed = records.iter().map(|r| r.runs).filter(|&n| n > 0);
        let runs = match (timed.clone().min(), timed.max()) {
            (Some(least), Some(most)) if least < most => format!("{least}–{most}"),
            (Some(n), _) => n.to_string(),
            _ => "no".into(),
        };
        out += &format!(
            "{:?} pass, batch {}, {} heads, E = D = {}, C = {}, topk = {}, {} bits, {} iterations, {}{}; median of {} timed runs{}{}{}{}. Machine: {}.\n\n",
            r.mode,
            r.batch,
            r.heads,
            r.dim,
            r.clusters,
            r.topk,
            r.bits,
            r.iterations,
            r.dtype,
            if r.dropout > 0.0 {
                format!(", attention dropout {}", r.dropout)
            } else {
                String::new()
            },
            runs,
            if records.iter().any(|r| r.peak_device_mib.is_some()) {
                "; in parentheses, the device memory held by the backend's pools (a bound on the peak, inputs included)"
            } else if records.iter().any(|r| r.peak_rss_mib.is_some()) {
                "; in parentheses, the process's peak resident memory during the measurement (inputs and the program included)"
            } else {
                ""
            },
            if records.iter().any(|r| r.forward_median_s.is_some()) {
                "; after the comma, the time over the forward pass's median, the forward pass timed in the same run right before each forward + backward"
            } else {
                ""
            },
            if records.iter().any(|r| r.no_dropout_median_s.is_some()) {
                "; after \"dropout\", the time over the median of the step without dropout, timed in the same run beside each step with it (before it and after it in turn)"
            } else {
                ""
            },
            if records.iter().any(|r| r.launches.is_some()) {
                "; after the semicolon, the kernel launches of one run (and of its forward pass), counted by CubeCL's profiling logger"
            } else {
                ""
            },
            machine.describe()
        );
    }
    out += &format!("| backend | L | {} |\n", ops.join(" | "));
    out += &format!("|---|---:|{}\n", "---:|".repeat(ops.len()));
    let mut keys: Vec<(String, usize)> = Vec::new();
    for r in records {
        let key = (r.backend.clone(), r.length);
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    for (backend, length) in keys {
        let cells: Vec<String> = ops
            .iter()
            .map(|op| {
                cell(
                    records
                        .iter()
                        .find(|r| r.backend == backend && r.length == length && r.op == *op),
                )
            })
            .collect();
        out += &format!("| {backend} | {length} | {} |\n", cells.join(" | "));
    }
    let mut products: Vec<String> = Vec::new();
    for r in records {
        let line = format!("{} {}", r.backend, r.score_products);
        if !products.contains(&line) {
            products.push(line);
        }
    }
    out += &format!(
        "\nScores of the fused attention kernels (clustered, improved): {}.\n",
        products.join("; ")
    );
    let notes: BTreeSet<String> = records
        .iter()
        .filter_map(|r| {
            r.skipped
                .as_ref()
                .map(|n| format!("- {} L={} {}: {n}", r.backend, r.length, r.op))
        })
        .collect();
    if !notes.is_empty() {
        out += "\n";
        for note in notes {
            out += &note;
            out += "\n";
        }
    }
    out
}

/// Log-log plot of time against length, one line per (attention, backend), as SVG text;
/// `None` when no record was timed.
fn plot(records: &[Record]) -> Result<Option<String>> {
    let timed: Vec<&Record> = records
        .iter()
        .filter(|r| {
            r.median_s.is_some()
                && ["full", "fused", "clustered", "improved"].contains(&r.op.as_str())
        })
        .collect();
    if timed.is_empty() {
        return Ok(None);
    }
    let mut svg = String::new();
    draw_plot(
        SVGBackend::with_string(&mut svg, (900, 600)).into_drawing_area(),
        &timed,
    )?;
    Ok(Some(svg))
}

/// Draws [`plot`]'s lines of `timed` (at least one record) on `root`.
fn draw_plot(root: DrawingArea<SVGBackend<'_>, Shift>, timed: &[&Record]) -> Result<()> {
    let (min_l, max_l) = timed.iter().fold((f64::MAX, 0.0f64), |(lo, hi), r| {
        (lo.min(r.length as f64), hi.max(r.length as f64))
    });
    let (min_t, max_t) = timed.iter().fold((f64::MAX, 0.0f64), |(lo, hi), r| {
        let t = r.median_s.unwrap();
        (lo.min(t), hi.max(t))
    });
    root.fill(&WHITE)?;
    let mode = format!("{:?}", timed[0].mode).to_lowercase();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("attention {mode} time against sequence length"),
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (min_l * 0.8..max_l * 1.25).log_scale(),
            (min_t * 0.5..max_t * 2.0).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc("sequence length L = S")
        .y_desc("seconds (median)")
        .draw()?;
    let mut series: Vec<(String, String)> = Vec::new();
    for r in timed {
        let key = (r.op.clone(), r.backend.clone());
        if !series.contains(&key) {
            series.push(key);
        }
    }
    let backends: Vec<String> = {
        let mut b: Vec<String> = series.iter().map(|(_, b)| b.clone()).collect();
        b.dedup();
        b
    };
    for (op, backend) in &series {
        let op_index = ["full", "fused", "clustered", "improved"]
            .iter()
            .position(|o| o == op)
            .unwrap();
        let color = Palette99::pick(op_index).to_rgba();
        let backend_index = backends.iter().position(|b| b == backend).unwrap_or(0);
        let points: Vec<(f64, f64)> = timed
            .iter()
            .filter(|r| &r.op == op && &r.backend == backend)
            .map(|r| (r.length as f64, r.median_s.unwrap()))
            .collect();
        let style = ShapeStyle::from(&color).stroke_width(if backend_index == 0 { 2 } else { 1 });
        chart
            .draw_series(LineSeries::new(points.clone(), style))?
            .label(format!("{op} ({backend})"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart.draw_series(points.iter().map(|&(x, y)| match backend_index % 3 {
            0 => Circle::new((x, y), 4, color.filled()).into_dyn(),
            1 => TriangleMarker::new((x, y), 5, color.filled()).into_dyn(),
            _ => Cross::new((x, y), 5, color).into_dyn(),
        }))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Prints the table and writes `<name>.md`, `.csv`, `.json` and `.svg` under `--out-dir`.
pub fn write_all(args: &Args, machine: &Machine, records: &[Record]) -> Result<()> {
    let table = markdown(machine, records);
    let output = Output {
        machine,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        records,
    };
    let svg = plot(records).context("drawing the SVG plot")?;
    let mode = format!("{:?}", args.mode).to_lowercase();
    write_outputs(args, &mode, &table, records, &output, svg)
}

/// Prints `table` and writes it, `records` as CSV, `output` as JSON and `svg` (when there is
/// one) to `<name>.md`, `.csv`, `.json` and `.svg` under `--out-dir`, each whole or not at all
/// ([`write_whole`]); `<name>` is `--name`, or `default_name`.
pub(crate) fn write_outputs<R: Serialize>(
    args: &Args,
    default_name: &str,
    table: &str,
    records: &[R],
    output: &impl Serialize,
    svg: Option<String>,
) -> Result<()> {
    println!("{table}");
    fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| default_name.to_string());
    let base = args.out_dir.join(&name);
    write_whole(&base.with_extension("md"), table.as_bytes())?;
    let mut csv = csv::Writer::from_writer(Vec::new());
    for r in records {
        csv.serialize(r)?;
    }
    let csv = csv
        .into_inner()
        .map_err(|e| anyhow::anyhow!("encoding the CSV: {}", e.error()))?;
    write_whole(&base.with_extension("csv"), &csv)?;
    write_whole(
        &base.with_extension("json"),
        serde_json::to_string_pretty(output)?.as_bytes(),
    )?;
    if let Some(svg) = svg {
        write_whole(&base.with_extension("svg"), svg.as_bytes())?;
    }
    eprintln!("wrote {}.{{md,csv,json,svg}}", base.display());
    Ok(())
}

/// Writes `bytes` to `path` whole or not at all, so that a bench killed while writing leaves
/// the previous results or the new ones: through a temporary file in the same directory
/// (tempfile), renamed over `path`.
///
/// # Errors
/// When the directory cannot be written or the rename fails; the error names the path.
fn write_whole(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut builder = tempfile::Builder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // As `std::fs::write` (0o666 less the umask), not tempfile's private 0o600.
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let mut file = builder
        .tempfile_in(dir)
        .with_context(|| format!("writing into {}", dir.display()))?;
    file.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    file.persist(path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
