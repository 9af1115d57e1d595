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
        #[cfg(feature = "cuda")]
        "cuda",
    ]
    .to_vec()
}

/// Runs every measurement on one backend.
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
        #[cfg(feature = "cuda")]
        "cuda" => {
            let device = burn::backend::cuda::CudaDevice::default();
            let limits = Limits::device::<cubecl::cuda::CudaRuntime>(&device);
            dispatch!(burn::backend::Cuda, device, limits)
        }
        other => anyhow::bail!("backend {other:?} is not compiled into this binary"),
    }
}
