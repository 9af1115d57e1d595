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
    /// autodiff.
    ///
    /// # Errors
    /// [`DeviceError::NotCompiled`] when this crate was built without the backend's feature;
    /// for CUDA, [`DeviceError::CudaHeaders`] when the CUDA headers that NVRTC compiles the
    /// kernels with are not where the CUDA runtime will look
    /// (`clustered_attention::backends::cuda::toolkit`), which would otherwise be a panic
    /// inside CubeCL at the first kernel.
    pub fn device(self) -> Result<Device, DeviceError> {
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
            Self::Cuda => match clustered_attention::backends::cuda::toolkit() {
                Ok(_) => Ok(Device::cuda(0)),
                Err(error) => Err(DeviceError::CudaHeaders(error.to_string())),
            },
            #[allow(unreachable_patterns)]
            other => Err(DeviceError::NotCompiled(other)),
        }
    }

    /// Whether the backend's feature is compiled into this build.
    pub fn is_compiled(self) -> bool {
        match self {
            Self::Ndarray => cfg!(feature = "ndarray"),
            Self::Flex => cfg!(feature = "flex"),
            Self::Wgpu => cfg!(feature = "wgpu"),
            Self::Vulkan => cfg!(feature = "vulkan"),
            Self::Cuda => cfg!(feature = "cuda"),
        }
    }

    /// The backends compiled into this build, CPU first.
    pub fn compiled() -> Vec<BackendName> {
        Self::ALL
            .into_iter()
            .filter(|name| name.is_compiled())
            .collect()
    }
}

impl core::fmt::Display for BackendName {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.pad(self.name())
    }
}

/// The error of [`BackendName::device`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceError {
    /// The backend is not compiled into the program.
    NotCompiled(BackendName),
    /// CUDA: the CUDA headers NVRTC needs are missing (what is missing, and how to fix it).
    CudaHeaders(String),
}

impl core::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotCompiled(name) => write!(
                f,
                "backend {name} is not compiled into this program: rebuild it with \
                 `--features {}`",
                name.feature()
            ),
            Self::CudaHeaders(reason) => write!(f, "backend cuda cannot compile kernels: {reason}"),
        }
    }
}

impl std::error::Error for DeviceError {}
