//! The compiled backends and their dispatch.

use anyhow::Result;
use burn::backend::Autodiff;

use crate::Args;
use crate::measure::{Record, run_forward, run_train};

/// Names of the backends compiled into this binary.
pub fn compiled() -> Vec<&'static str> {
    [
        #[cfg(feature = "ndarray")]
        "ndarray",
        #[cfg(feature = "flex")]
        "flex",
    ]
    .to_vec()
}

/// Runs every measurement on one backend.
pub fn run(name: &str, args: &Args) -> Result<Vec<Record>> {
    macro_rules! dispatch {
        ($backend:ty, $device:expr, $gpu:expr) => {
            match args.mode {
                crate::Mode::Forward => run_forward::<$backend>(name, $device, $gpu, args),
                crate::Mode::Train => run_train::<Autodiff<$backend>>(name, $device, $gpu, args),
            }
        };
    }
    match name {
        #[cfg(feature = "ndarray")]
        "ndarray" => dispatch!(burn::backend::NdArray<f32>, Default::default(), false),
        #[cfg(feature = "flex")]
        "flex" => dispatch!(burn::backend::Flex, Default::default(), false),
        other => anyhow::bail!("backend {other:?} is not compiled into this binary"),
    }
}
