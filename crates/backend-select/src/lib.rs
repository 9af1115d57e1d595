#![warn(missing_docs)]
//! The Burn backend of a program by its command-line name: [`BackendName`] for the command
//! line, [`BackendName::device`] for the [`Device`] it names.
//!
//! Burn 0.22 runs every tensor on the backend of its [`Device`], chosen at run time
//! (`burn::backend::Dispatch`); what Burn does not do is name the backends on a command line.
//! That is all this crate does: a program takes `--backend flex`, asks for
//! `BackendName::Flex.device()` and passes the [`Device`] on (`.autodiff()` to train on it).
//! Which backends exist is decided by the features of this crate (`ndarray`, `flex`, `wgpu`,
//! `vulkan`, `cuda`), each turning on Burn's backend of that name.
//!
//! # Example
//! ```
//! use backend_select::BackendName;
//! use burn::tensor::Tensor;
//!
//! let device = BackendName::Ndarray.device().expect("the doctest compiles ndarray in");
//! let x = Tensor::<2>::zeros([3, 4], &device);
//! assert_eq!(x.shape().num_elements(), 12);
//! ```

use burn::tensor::Device;

/// The backends a program can run on, by their command-line names (`ndarray`, `flex`, `wgpu`,
/// `vulkan`, `cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum BackendName {
    /// Burn's NdArray CPU backend (deprecated by Burn 0.22 in favour of Flex).
    Ndarray,
    /// Burn's Flex CPU backend.
    Flex,
    /// WGPU (Vulkan, Metal, DirectX or WebGPU; Mesa's lavapipe without a GPU), with Burn's
    /// fusion.
    Wgpu,
    /// WGPU pinned to Vulkan, with SPIR-V kernels, with fusion.
    Vulkan,
    /// CUDA (device 0), with fusion.
    Cuda,
}

impl BackendName {
    /// Every backend name, in the order of [`BackendName::compiled`].
    pub const ALL: [BackendName; 5] = [
        Self::Ndarray,
        Self::Flex,
        Self::Wgpu,
        Self::Vulkan,
        Self::Cuda,
    ];

    /// The command-line name, e.g. `ndarray`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ndarray => "ndarray",
            Self::Flex => "flex",
            Self::Wgpu => "wgpu",
            Self::Vulkan => "vulkan",
            Self::Cuda => "cuda",
        }
    }

    /// The Cargo feature that compiles the backend into a program (the same as its name).
    pub fn feature(self) -> &'static str {
        self.name()
    }

    /// The backend's default device (the first GPU where there are several), without
    /// autodiff; `Err(`[`NotCompiled`]`)` when this crate was built without the backend's
    /// feature.
    pub fn device(self) -> Result<Device, NotCompiled> {
        #[allow(unreachable_code)]
        match self {
            // Burn 0.22 deprecates NdArray in favour of Flex; it stays selectable meanwhile.
            #[cfg(feature = "ndarray")]
            #[allow(deprecated)]
            Self::Ndarray => Ok(Device::ndarray()),
            #[cfg(feature = "flex")]
            Self::Flex => Ok(Device::flex()),
            #[cfg(feature = "wgpu")]
            Self::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "vulkan")]
            Self::Vulkan => Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "cuda")]
            Self::Cuda => Ok(Device::cuda(0)),
            #[allow(unreachable_patterns)]
            other => Err(NotCompiled(other)),
        }
    }

    /// The backends compiled into this build, CPU first.
    pub fn compiled() -> Vec<BackendName> {
        Self::ALL
            .into_iter()
            .filter(|name| name.device().is_ok())
            .collect()
    }
}

impl core::fmt::Display for BackendName {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.pad(self.name())
    }
}

/// The error of [`BackendName::device`] for a backend that is not compiled into the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotCompiled(pub BackendName);

impl core::fmt::Display for NotCompiled {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "backend {} is not compiled into this program: rebuild it with `--features {}`",
            self.0,
            self.0.feature()
        )
    }
}

impl std::error::Error for NotCompiled {}
