//! `--mode encoder`: one training step (forward, backward, Adam update) of an N-layer
//! transformer encoder, what a Burn user trains: burn-nn's `TransformerEncoder` beside
//! clustered-attention's `ClusteredTransformerEncoder` with full, clustered and improved
//! attention, the same sizes and dropout. Each (backend, encoder, length) runs in a child
//! process of its own (this program, run again with `--encoder-child`) whose data segment is
//! capped (`RLIMIT_DATA`, which counts every private writable mapping: the heap, the
//! allocator's arenas, the tensors; [`crate::capped`]): past the cap an allocation fails and
//! the child exits with a status of its own, so a configuration that needs more memory than
//! the cap is reported "over the cap" and the machine never swaps. The cap and the memory
//! reported are two measures: the cap is on the virtual memory the child maps for its data,
//! the report is its peak resident set size (peak RSS, `VmHWM`: the pages it touched), which
//! no `setrlimit` can cap. A child is over the cap by its exit alone (an allocation failed, or
//! the kernel killed it with `SIGKILL`); any other failure is reported as a crash with its
//! exit status or signal, whatever it printed. The child reports the median step time and its
//! peak RSS. On CUDA the memory is the device's: no cap is set on the host (the driver maps
//! the device's memory into the process), a failure whose messages say the device's memory
//! ran out is reported "over the device's memory", and the peak is the most the device's
//! memory pools held at the end of a forward, a backward or an update (CubeCL's
//! `bytes_reserved`; the pools keep their pages between allocations, so this is the peak of
//! what they took, within a page).

use std::io::Write as _;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use backend_select::BackendName;
use burn::module::Module;
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoderConfig, ClusteredTransformerEncoderInput,
};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::Args;
use crate::capped::{self, Outcome};
use crate::report::{Machine, write_outputs};

/// The encoders compared: burn-nn's, then this crate's with each attention, then improved
/// attention with every layer recomputed in the backward pass
/// (`ClusteredTransformerEncoderConfig::recompute_layers` = the layer count).
pub const ENCODERS: [&str; 5] = [
    "burn-nn",
    "full",
    "clustered",
    "improved",
    "improved-recompute",
];

/// The suffix of an encoder whose layers are all recomputed in the backward pass.
const RECOMPUTE: &str = "-recompute";

/// One (backend, encoder, length): its step time and peak memory, or why there is none.
#[derive(Debug, Clone, Serialize)]
pub struct EncoderRecord {
    pub backend: String,
    pub encoder: String,
    pub length: usize,
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub d_ff: usize,
    pub batch: usize,
    pub dropout: f64,
    /// Median seconds of a training step.
    pub step_s: Option<f64>,
    /// Peak memory of the child process, MiB: its peak resident set size (peak RSS,
    /// `VmHWM`) on a CPU backend (and WGPU, whose memory is the host's on lavapipe), what the
    /// device's memory pools held on CUDA. Not the measure the cap is on (the data segment's
    /// virtual size, `RLIMIT_DATA`).
    pub peak_mib: Option<f64>,
    /// What `peak_mib` measures: `"rss"` or `"device"`.
    pub memory: Option<String>,
    /// How the child ended where it failed: its exit status or the signal that killed it,
    /// e.g. "exit status 86: an allocation failed", "killed by signal 6 (SIGABRT)".
    pub exit: Option<String>,
    /// "over the cap", a crash, or why it was not run.
    pub note: Option<String>,
}

/// What a child prints as its last line.
#[derive(Debug, Serialize, Deserialize)]
struct ChildReport {
    step_s: Vec<f64>,
    peak_mib: Option<f64>,
    memory: String,
}

/// Whether the children on `backend` run without the host's cap: CUDA, whose tensors are in
/// the device's memory (the driver's mappings of it are the process's, so a host cap would
/// count them).
fn uncapped(backend: BackendName) -> bool {
    backend == BackendName::Cuda
}

/// The cap of a child's data segment (`RLIMIT_DATA`), bytes: `--memory-gib`, or 70 % of the
/// memory available now (the host's budget of the other modes,
/// [`crate::measure::memory_budget`]).
fn memory_cap(args: &Args) -> u64 {
    crate::measure::memory_budget(args, false) as u64
}

/// Runs every (backend, encoder, length) in a child process of its own, shortest length first;
/// an encoder over the cap or over `--time-limit-s` at one length is not run at longer ones.
pub fn run(args: &Args, machine: &Machine) -> Result<()> {
    let cap = memory_cap(args);
    let cap_gib = cap as f64 / 1024f64.powi(3);
    if args.backends.iter().any(|b| !uncapped(*b)) {
        eprintln!(
            "memory cap of each child on the host backends: {cap_gib:.1} GiB of data segment \
             (RLIMIT_DATA, virtual memory; the memory reported is the peak RSS)"
        );
    }
    let encoders = selected(args)?;
    let mut lengths = args.lengths.clone();
    lengths.sort_unstable();
    let mut records = Vec::new();
    for backend in &args.backends {
        for encoder in &encoders {
            let mut stop: Option<String> = None;
            for &length in &lengths {
                let mut record = EncoderRecord {
                    backend: backend.name().to_string(),
                    encoder: encoder.to_string(),
                    length,
                    layers: args.layers,
                    d_model: args.d_model,
                    heads: args.heads(),
                    d_ff: args.d_ff,
                    batch: args.batch,
                    dropout: args.dropout(),
                    step_s: None,
                    peak_mib: None,
                    memory: None,
                    exit: None,
                    note: stop.clone(),
                };
                if stop.is_none() {
                    run_child(args, *backend, encoder, length, cap, &mut record)?;
                    if record.note.is_some() {
                        stop = Some(format!(
                            "not run: {} at L = {length}",
                            record.note.as_deref().unwrap()
                        ));
                    } else if record.step_s.is_some_and(|s| s > args.time_limit_s) {
                        stop = Some(format!(
                            "not run: over {} s a step at L = {length}",
                            args.time_limit_s
                        ));
                    }
                }
                eprintln!("{}", describe(&record));
                records.push(record);
            }
        }
    }
    write(args, machine, cap_gib, &records)
}

/// The encoders of `--only` (all of [`ENCODERS`] by default).
fn selected(args: &Args) -> Result<Vec<&'static str>> {
    if args.only.is_empty() {
        return Ok(ENCODERS.to_vec());
    }
    args.only
        .iter()
        .map(|name| {
            ENCODERS
                .iter()
                .find(|e| *e == name)
                .copied()
                .with_context(|| {
                    format!(
                        "unknown encoder {name:?} in --only (known: {})",
                        ENCODERS.join(", ")
                    )
                })
        })
        .collect()
}

/// One line of progress.
fn describe(record: &EncoderRecord) -> String {
    format!(
        "{} {} L = {}: {}",
        record.backend,
        record.encoder,
        record.length,
        cell(record)
    )
}

/// The median of `times` (at least one).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    }
}

/// A table cell: "1.87 s, 667 MiB", or the note.
fn cell(record: &EncoderRecord) -> String {
    match (record.step_s, &record.note) {
        (Some(step), _) => format!(
            "{} s, {}",
            significant(step),
            record
                .peak_mib
                .map_or("? MiB".to_string(), |mib| if mib >= 1024.0 {
                    format!("{:.2} GiB", mib / 1024.0)
                } else {
                    format!("{mib:.0} MiB")
                })
        ),
        (None, Some(note)) => note.clone(),
        (None, None) => "–".to_string(),
    }
}

/// `x` with three significant digits.
fn significant(x: f64) -> String {
    let digits = (2 - x.abs().log10().floor() as i32).max(0) as usize;
    format!("{x:.digits$}")
}

/// Runs this program again as the child of one measurement, with the data segment capped at
/// `cap` bytes (none on CUDA), and fills `record` from its report or from how it failed
/// ([`Outcome`]).
///
/// # Errors
/// When the child cannot be started, or it exits with status 0 without a report on its last
/// line of standard output.
fn run_child(
    args: &Args,
    backend: BackendName,
    encoder: &str,
    length: usize,
    cap: u64,
    record: &mut EncoderRecord,
) -> Result<()> {
    let exe = std::env::current_exe().context("finding this program to run its children")?;
    let mut command = Command::new(exe);
    command
        .args(["--mode", "encoder", "--encoder-child", encoder])
        .args(["--backends", backend.name()])
        .args(["--lengths", &length.to_string()])
        .args(["--batch", &args.batch.to_string()])
        .args(["--heads", &args.heads().to_string()])
        .args(["--layers", &args.layers.to_string()])
        .args(["--d-model", &args.d_model.to_string()])
        .args(["--d-ff", &args.d_ff.to_string()])
        .args(["--dropout", &args.dropout().to_string()])
        .args(["--clusters", &args.clusters.to_string()])
        .args(["--topk", &args.topk.to_string()])
        .args(["--bits", &args.bits.to_string()])
        .args(["--iterations", &args.iterations.to_string()])
        .args(["--runs", &args.runs.to_string()])
        .args(["--warmup", &args.warmup.to_string()]);
    let has_cap = !uncapped(backend);
    let (exit, output) = capped::run(command, has_cap.then_some(cap))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    match Outcome::of(exit, &stderr, has_cap) {
        Outcome::Reported => {
            let stdout = String::from_utf8_lossy(&output.stdout);
            let last = stdout.lines().last().unwrap_or_default();
            let report: ChildReport = serde_json::from_str(last)
                .with_context(|| format!("reading the child's report {last:?}"))?;
            record.step_s = Some(median(report.step_s));
            record.peak_mib = report.peak_mib;
            record.memory = Some(report.memory);
        }
        Outcome::OverCap(exit) => {
            let cap_gib = cap as f64 / 1024f64.powi(3);
            record.note = Some(match exit {
                capped::Exit::Killed => format!("over the cap ({cap_gib:.1} GiB): {exit}"),
                _ => format!("over the cap ({cap_gib:.1} GiB)"),
            });
            record.exit = Some(exit.to_string());
        }
        Outcome::OverDeviceMemory(exit) => {
            record.note = Some("over the device's memory".to_string());
            record.exit = Some(exit.to_string());
        }
        Outcome::Crashed(exit, last) => {
            record.note = Some(format!("crashed ({exit}): {last}"));
            record.exit = Some(exit.to_string());
        }
    }
    Ok(())
}

/// The child: builds `encoder` on the one backend and length of `args`, runs `--warmup`
/// untimed and `--runs` timed training steps, and prints its report as one JSON line. An
/// allocation that fails (past the cap) ends the process with the exit status
/// [`capped::ALLOCATION_FAILED`], which the parent reads as "over the cap".
///
/// # Errors
/// When `args` name more than one backend or length, the backend's device cannot be had, or
/// the device cannot be synchronised.
pub fn child(args: &Args, encoder: &str) -> Result<()> {
    capped::exit_on_allocation_failure();
    let [backend] = args.backends[..] else {
        bail!("--encoder-child takes one backend, got {:?}", args.backends);
    };
    let [length] = args.lengths[..] else {
        bail!("--encoder-child takes one length, got {:?}", args.lengths);
    };
    let device = backend.device()?;
    let limits = crate::measure::Limits::of(&device);
    // CUDA's memory is read from its pools; other backends' is the process's resident set.
    let device_memory = uncapped(backend);
    let device = device.autodiff();
    device.seed(0);
    // The most the device's pools held at the end of a forward, a backward or an update.
    let mut device_peak: Option<f64> = None;
    let mut sample = || {
        if let Some(mib) = limits.device_reserved_mib() {
            device_peak = Some(device_peak.map_or(mib, |peak: f64| peak.max(mib)));
        }
    };
    let sample = device_memory.then_some(&mut sample as &mut dyn FnMut());
    let x = Tensor::<3>::random(
        [args.batch, length, args.d_model],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let times = match encoder {
        "burn-nn" => {
            let model =
                TransformerEncoderConfig::new(args.d_model, args.d_ff, args.heads(), args.layers)
                    .with_dropout(args.dropout())
                    .init(&device);
            train(args, &device, model, x, sample, |m, x| {
                m.forward(TransformerEncoderInput::new(x))
            })
        }
        name => {
            let (name, recompute) = match name.strip_suffix(RECOMPUTE) {
                Some(name) => (name, args.layers),
                None => (name, 0),
            };
            let attention = match name {
                "full" => AttentionKind::Full,
                "clustered" => AttentionKind::Clustered {
                    clusters: args.clusters,
                },
                "improved" => AttentionKind::Improved {
                    clusters: args.clusters,
                    topk: args.topk,
                },
                other => bail!("unknown encoder {other:?} (known: {})", ENCODERS.join(", ")),
            };
            let model = ClusteredTransformerEncoderConfig::new(
                args.d_model,
                args.d_ff,
                args.heads(),
                args.layers,
                attention,
            )
            .with_dropout(args.dropout())
            .with_bits(args.bits)
            .with_iterations(args.iterations)
            .with_recompute_layers(recompute)
            .init(&device);
            train(args, &device, model, x, sample, |m, x| {
                m.forward(ClusteredTransformerEncoderInput::new(x))
            })
        }
    }?;
    let report = if device_memory {
        ChildReport {
            step_s: times,
            peak_mib: device_peak,
            memory: "device".to_string(),
        }
    } else {
        ChildReport {
            step_s: times,
            peak_mib: crate::measure::peak_rss_mib(),
            memory: "rss".to_string(),
        }
    };
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{}", serde_json::to_string(&report)?)?;
    Ok(())
}

/// Training steps of `model` on `x` (the loss: the mean square of the output), Adam at a
/// learning rate of 1e-4: `--warmup` untimed, then the seconds of each of `--runs`. With
/// `sample`, the device is synchronised and `sample` called after the forward, the backward
/// and the update of each step (three synchronisations a step in place of one).
fn train<M: Module>(
    args: &Args,
    device: &Device,
    mut model: M,
    x: Tensor<3>,
    mut sample: Option<&mut dyn FnMut()>,
    forward: impl Fn(&M, Tensor<3>) -> Tensor<3>,
) -> Result<Vec<f64>> {
    let mut checkpoint = || -> Result<()> {
        if let Some(sample) = sample.as_mut() {
            device.sync().context("synchronising the device")?;
            sample();
        }
        Ok(())
    };
    let mut optimizer = AdamConfig::new().init();
    let mut times = Vec::new();
    for run in 0..args.warmup + args.runs.max(1) {
        let start = Instant::now();
        let loss = forward(&model, x.clone()).powi_scalar(2).mean();
        checkpoint()?;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        checkpoint()?;
        model = optimizer.step(1e-4, model, grads);
        checkpoint()?;
        device.sync().context("synchronising the device")?;
        if run >= args.warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

/// Prints the table and writes `<name>.md`, `.csv`, `.json` and `.svg` under `--out-dir`
/// (`<name>` `encoder` by default).
fn write(args: &Args, machine: &Machine, cap_gib: f64, records: &[EncoderRecord]) -> Result<()> {
    let table = markdown(args, machine, cap_gib, records);
    // The cap, where a child had one (none on CUDA).
    let cap = args
        .backends
        .iter()
        .any(|b| !uncapped(*b))
        .then_some(cap_gib);
    #[derive(Serialize)]
    struct Output<'a> {
        machine: &'a Machine,
        command: String,
        memory_cap_gib: Option<f64>,
        records: &'a [EncoderRecord],
    }
    let output = Output {
        machine,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        memory_cap_gib: cap,
        records,
    };
    let mut svg = String::new();
    plot(
        SVGBackend::with_string(&mut svg, (1200, 520)).into_drawing_area(),
        cap,
        records,
    )
    .context("drawing the SVG plot")?;
    write_outputs(args, "encoder", &table, records, &output, Some(svg))
}

/// The table: one row per (backend, length), one column per encoder.
fn markdown(args: &Args, machine: &Machine, cap_gib: f64, records: &[EncoderRecord]) -> String {
    let encoders: Vec<&str> = ENCODERS
        .iter()
        .copied()
        .filter(|e| records.iter().any(|r| r.encoder == *e))
        .collect();
    let mut out = format!(
        "One training step (forward, backward, Adam) of a {}-layer encoder, d_model {}, {} heads, \
         d_ff {}, batch {}, dropout {}, f32; clustered {} clusters, improved {} clusters and top \
         {}. Median of {} steps after {} untimed; {}. Each in its own process, {}. {}.\n\n",
        args.layers,
        args.d_model,
        args.heads(),
        args.d_ff,
        args.batch,
        args.dropout(),
        args.clusters,
        args.clusters,
        args.topk,
        args.runs.max(1),
        args.warmup,
        if records
            .iter()
            .any(|r| r.memory.as_deref() == Some("device"))
        {
            "memory: the process's peak resident set size (peak RSS, `VmHWM`) on the host \
             backends, the most the device's memory pools held on CUDA"
        } else {
            "memory: the process's peak resident set size (peak RSS, `VmHWM`)"
        },
        if args.backends.iter().all(|b| uncapped(*b)) {
            "on the device's memory alone (no host cap)".to_string()
        } else if args.backends.iter().any(|b| uncapped(*b)) {
            format!(
                "its data segment capped at {cap_gib:.1} GiB on the host backends (RLIMIT_DATA: \
                 the virtual memory it maps for its data, a measure other than its RSS; CUDA: \
                 the device's memory alone)"
            )
        } else {
            format!(
                "its data segment capped at {cap_gib:.1} GiB (RLIMIT_DATA: the virtual memory \
                 it maps for its data, a measure other than its RSS)"
            )
        },
        machine.describe()
    );
    let memory = memory_label(records);
    out += "| backend | L |";
    for e in &encoders {
        out += &format!(" {e} (step, {memory}) |");
    }
    out += "\n|---|---:|";
    out += &"---|".repeat(encoders.len());
    out += "\n";
    let mut rows: Vec<(String, usize)> = Vec::new();
    for r in records {
        if !rows.contains(&(r.backend.clone(), r.length)) {
            rows.push((r.backend.clone(), r.length));
        }
    }
    // Each backend's lengths in order (the records are by backend, then encoder, then length).
    rows.sort_by_key(|(backend, length)| {
        let first = records.iter().position(|r| &r.backend == backend);
        (first, *length)
    });
    for (backend, length) in rows {
        out += &format!("| {backend} | {length} |");
        for e in &encoders {
            let record = records
                .iter()
                .find(|r| r.backend == backend && r.length == length && r.encoder == *e);
            out += &format!(" {} |", record.map_or("–".to_string(), cell));
        }
        out += "\n";
    }
    out
}

/// What the memory figures of `records` are, for the table's header and the plot's axis:
/// "peak RSS", "peak device memory" (CUDA), or both kinds.
fn memory_label(records: &[EncoderRecord]) -> &'static str {
    // Unmeasured records by their backend.
    let on_device = |r: &EncoderRecord| match r.memory.as_deref() {
        Some(memory) => memory == "device",
        None => r.backend == BackendName::Cuda.name(),
    };
    let has = |device: bool| records.iter().any(|r| on_device(r) == device);
    match (has(false), has(true)) {
        (true, true) => "peak RSS or device memory",
        (false, true) => "peak device memory",
        _ => "peak RSS",
    }
}

/// Two log-log panels, peak memory ([`memory_label`]) and step time against L, one line per
/// (encoder, backend); the data-segment cap, where there is one, drawn across the first (a
/// limit on another measure than the peak RSS: the virtual memory a child maps for its data).
fn plot(
    root: DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    cap_gib: Option<f64>,
    records: &[EncoderRecord],
) -> Result<()> {
    root.fill(&WHITE)?;
    let measured: Vec<&EncoderRecord> = records.iter().filter(|r| r.step_s.is_some()).collect();
    if measured.is_empty() {
        root.present()?;
        return Ok(());
    }
    let (min_l, max_l) = records.iter().fold((f64::MAX, 0.0f64), |(lo, hi), r| {
        (lo.min(r.length as f64), hi.max(r.length as f64))
    });
    let panels = root.split_evenly((1, 2));
    let memory_figure = memory_label(records);
    let series: Vec<(String, String)> = {
        let mut s: Vec<(String, String)> = measured
            .iter()
            .map(|r| (r.encoder.clone(), r.backend.clone()))
            .collect();
        s.sort();
        s.dedup();
        s
    };
    for (panel, memory) in panels.iter().zip([true, false]) {
        let value = |r: &EncoderRecord| {
            if memory {
                r.peak_mib.map(|m| m / 1024.0)
            } else {
                r.step_s
            }
        };
        let values: Vec<f64> = measured.iter().filter_map(|r| value(r)).collect();
        let lo = values.iter().cloned().fold(f64::MAX, f64::min);
        let mut hi = values.iter().cloned().fold(0.0f64, f64::max);
        if let Some(cap_gib) = cap_gib.filter(|_| memory) {
            hi = hi.max(cap_gib);
        }
        let mut chart = ChartBuilder::on(panel)
            .caption(
                if memory {
                    format!("{memory_figure} of a training step")
                } else {
                    "time of a training step".to_string()
                },
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(
                (min_l * 0.8..max_l * 1.25).log_scale(),
                (lo * 0.5..hi * 2.0).log_scale(),
            )?;
        chart
            .configure_mesh()
            .x_desc("sequence length L")
            .y_desc(if memory {
                format!("{memory_figure}, GiB")
            } else {
                "seconds (median)".to_string()
            })
            .draw()?;
        for (index, (encoder, backend)) in series.iter().enumerate() {
            let color =
                Palette99::pick(ENCODERS.iter().position(|e| e == encoder).unwrap_or(index))
                    .to_rgba();
            let points: Vec<(f64, f64)> = measured
                .iter()
                .filter(|r| &r.encoder == encoder && &r.backend == backend)
                .filter_map(|r| value(r).map(|v| (r.length as f64, v)))
                .collect();
            let style = ShapeStyle::from(&color).stroke_width(2);
            chart
                .draw_series(LineSeries::new(points.clone(), style))?
                .label(format!("{encoder} ({backend})"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        if let Some(cap_gib) = cap_gib.filter(|_| memory) {
            let style = ShapeStyle::from(&BLACK).stroke_width(1);
            chart
                .draw_series(LineSeries::new(
                    [(min_l * 0.8, cap_gib), (max_l * 1.25, cap_gib)],
                    style,
                ))?
                .label(format!("data-segment cap (RLIMIT_DATA): {cap_gib:.1} GiB"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
