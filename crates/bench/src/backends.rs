//! The compiled backends, by the workspace's backend names ([`backend_select`]).

use anyhow::Result;
use backend_select::BackendName;

use crate::Args;
use crate::measure::{Limits, Record, run_forward, run_train};

/// The backends compiled into this binary.
pub fn compiled() -> Vec<BackendName> {
    BackendName::compiled()
}

/// Runs every measurement on one backend's default device: `wgpu`, `vulkan` and `cuda` with
/// Burn's fusion, as Burn 0.22's `Cube` backend always has it when fusion is compiled in;
/// `--mode train` on the same device with autodiff.
pub fn run(name: BackendName, args: &Args) -> Result<Vec<Record>> {
    let device = name.device()?;
    let limits = Limits::of(&device);
    match args.mode {
        crate::Mode::Forward => run_forward(name.name(), device, limits, args),
        crate::Mode::Train => run_train(name.name(), device.autodiff(), limits, args),
        crate::Mode::Encoder => unreachable!("--mode encoder runs encoder::run"),
    }
}
