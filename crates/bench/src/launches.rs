//! Kernel launches counted by CubeCL's own profiling logger (`--count-launches`).
//!
//! CubeCL 0.11 logs every kernel launch of every client as `Executing <kernel>` when its
//! profiling logger runs at level `minimal` (`cubecl-runtime`, `ServerLogger::register_execution`):
//! one string and one channel message per launch, sent from the device's thread without
//! synchronising the device (the levels above `minimal` time each kernel and serialise them).
//! [`enable`] sets that level, with the `log` crate as the logger's output, and installs a
//! `log` logger that counts those lines; [`count`] reads the count around one run. Fused
//! kernels (Burn's fusion) go through the same launch path, so they count too. Buffer copies
//! and reads are not kernel launches and do not count.
//!
//! CubeCL's configuration is global and set once: [`enable`] must run before the first
//! device is used. The count is process-wide (every device and stream).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::tensor::Device;

/// Launches logged so far.
static LAUNCHES: AtomicUsize = AtomicUsize::new(0);
/// Whether [`enable`] ran.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The `log` logger: counts CubeCL's `Executing …` lines, ignores everything else.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
struct LaunchCounter;

/// The `log` target of CubeCL's profiling output (`cubecl-runtime`'s `config/logger.rs`).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
const CUBECL_TARGET: &str = "cubecl::profiling";

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl log::Log for LaunchCounter {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.target().starts_with(CUBECL_TARGET)
    }

    fn log(&self, record: &log::Record) {
        if self.enabled(record.metadata()) && record.args().to_string().starts_with("Executing ") {
            LAUNCHES.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn flush(&self) {}
}

/// Turns the counting on: CubeCL's configuration as it would read it (`cubecl.toml` or
/// `burn.toml`, then its environment variables), with its profiling logger replaced by the
/// `minimal` level logging to the `log` crate, and a `log` logger that counts launches.
///
/// # Errors
/// When another `log` logger is installed already.
///
/// # Panics
/// When CubeCL's configuration has been read already (a Cube device was used before).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub fn enable() -> anyhow::Result<()> {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config.profiling.logger =
        serde_json::from_value(serde_json::json!({ "level": "minimal", "log": "info" }))?;
    log::set_logger(&LaunchCounter)
        .map_err(|_| anyhow::anyhow!("--count-launches: another log logger is installed"))?;
    log::set_max_level(log::LevelFilter::Info);
    CubeClRuntimeConfig::set(config);
    ENABLED.store(true, Ordering::SeqCst);
    Ok(())
}

/// How long the count must stay unchanged to be read: CubeCL's logger thread receives the
/// launches after the device has run them, asynchronously (a busy machine may hold it back
/// for tens of milliseconds).
const SETTLE: Duration = Duration::from_millis(100);

/// The count once it has not changed for [`SETTLE`].
fn settled() -> usize {
    let mut last = LAUNCHES.load(Ordering::SeqCst);
    let mut since = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(1));
        let now = LAUNCHES.load(Ordering::SeqCst);
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= SETTLE {
            return now;
        }
    }
}

/// The kernel launches of one call of `run` on `device` (the device synchronised before and
/// after, the result kept until then); `None` unless [`enable`] ran.
pub fn count<R>(device: &Device, run: impl FnOnce() -> R) -> Option<usize> {
    if !ENABLED.load(Ordering::SeqCst) {
        return None;
    }
    device.sync().expect("device sync");
    let before = settled();
    let out = run();
    device.sync().expect("device sync");
    let after = settled();
    drop(out);
    Some(after - before)
}
