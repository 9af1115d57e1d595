//! The compiled backends and their dispatch, by the workspace's backend selection
//! ([`backend_select`]).

use anyhow::Result;
use backend_select::{BackendName, BackendTask, compiled_backends, run_on};
use burn::backend::Autodiff;
use clustered_attention::ClusteredAttentionBackend;

use crate::Args;
use crate::measure::{Limits, Record, run_forward, run_train};

/// The backends compiled into this binary.
pub fn compiled() -> Vec<BackendName> {
    compiled_backends!()
}

/// Runs every measurement on one backend: `wgpu` and `cuda` are Burn's `Wgpu` and `Cuda`, with
/// Burn's fusion as Burn defaults to; `wgpu-unfused` and `cuda-unfused` are the plain
/// `CubeBackend` of the same runtime, each op its own kernel launch.
pub fn run(name: BackendName, args: &Args) -> Result<Vec<Record>> {
    run_on!(name, Measure(args))?
}

/// The measurements of `--mode` on one backend.
struct Measure<'a>(&'a Args);

impl BackendTask for Measure<'_> {
    type Output = Result<Vec<Record>>;

    fn run<B: ClusteredAttentionBackend>(
        self,
        name: BackendName,
        device: B::Device,
    ) -> Self::Output {
        let (args, limits) = (self.0, limits(name));
        match args.mode {
            crate::Mode::Forward => run_forward::<B>(name.name(), device, limits, args),
            crate::Mode::Train => run_train::<Autodiff<B>>(name.name(), device, limits, args),
        }
    }
}

/// The memory limits of the backend's default device.
fn limits(name: BackendName) -> Limits {
    match name {
        #[cfg(feature = "wgpu")]
        BackendName::Wgpu | BackendName::WgpuUnfused | BackendName::Vulkan => {
            use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
            Limits::device::<WgpuRuntime>(&WgpuDevice::default())
        }
        #[cfg(feature = "cuda")]
        BackendName::Cuda | BackendName::CudaUnfused => {
            use burn::backend::cuda::CudaDevice;
            Limits::device::<cubecl::cuda::CudaRuntime>(&CudaDevice::default())
        }
        _ => Limits::host(),
    }
}
