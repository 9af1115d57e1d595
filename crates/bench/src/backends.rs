//! The compiled backends and their dispatch.

use anyhow::Result;
use burn::backend::Autodiff;

use crate::Args;
use crate::measure::{Limits, Record, run_forward, run_train};

/// Names of the backends compiled into this binary.
pub fn compiled() -> Vec<&'static str> {
    [
        #[cfg(feature = "ndarray")]
        "ndarray",
        #[cfg(feature = "flex")]
        "flex",
        #[cfg(feature = "wgpu")]
        "wgpu",
        #[cfg(feature = "wgpu")]
        "wgpu-unfused",
        #[cfg(feature = "cuda")]
        "cuda",
        #[cfg(feature = "cuda")]
        "cuda-unfused",
    ]
    .to_vec()
}

/// The Cargo feature that compiles `backend` into the bench (`wgpu` for `wgpu-unfused`, `cuda`
/// for `cuda-unfused`).
pub fn feature(backend: &str) -> &str {
    backend.strip_suffix("-unfused").unwrap_or(backend)
}

/// Runs every measurement on one backend: `wgpu` and `cuda` are Burn's `Wgpu` and `Cuda`, with
/// Burn's fusion as Burn defaults to; `wgpu-unfused` and `cuda-unfused` are the plain
/// `CubeBackend` of the same runtime, each op its own kernel launch.
pub fn run(name: &str, args: &Args) -> Result<Vec<Record>> {
    macro_rules! dispatch {
        ($backend:ty, $device:expr, $limits:expr) => {
            match args.mode {
                crate::Mode::Forward => run_forward::<$backend>(name, $device, $limits, args),
                crate::Mode::Train => run_train::<Autodiff<$backend>>(name, $device, $limits, args),
            }
        };
    }
    match name {
        #[cfg(feature = "ndarray")]
        "ndarray" => dispatch!(
            burn::backend::NdArray<f32>,
            Default::default(),
            Limits::host()
        ),
        #[cfg(feature = "flex")]
        "flex" => dispatch!(burn::backend::Flex, Default::default(), Limits::host()),
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            let device = burn::backend::wgpu::WgpuDevice::default();
            let limits = Limits::device::<burn::backend::wgpu::WgpuRuntime>(&device);
            dispatch!(burn::backend::Wgpu, device, limits)
        }
        #[cfg(feature = "wgpu")]
        "wgpu-unfused" => {
            use burn::backend::wgpu::{CubeBackend, WgpuDevice, WgpuRuntime};
            let device = WgpuDevice::default();
            let limits = Limits::device::<WgpuRuntime>(&device);
            dispatch!(CubeBackend<WgpuRuntime, f32, i32, u32>, device, limits)
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            let device = burn::backend::cuda::CudaDevice::default();
            let limits = Limits::device::<cubecl::cuda::CudaRuntime>(&device);
            dispatch!(burn::backend::Cuda, device, limits)
        }
        #[cfg(feature = "cuda")]
        "cuda-unfused" => {
            use cubecl::cuda::CudaRuntime;
            let device = burn::backend::cuda::CudaDevice::default();
            let limits = Limits::device::<CudaRuntime>(&device);
            dispatch!(burn_cubecl::CubeBackend<CudaRuntime, f32, i32, u8>, device, limits)
        }
        other => anyhow::bail!("backend {other:?} is not compiled into this binary"),
    }
}
