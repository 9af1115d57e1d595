#![warn(missing_docs)]
//! Choosing the Burn backend of a program by name at run time: one [`BackendName`] for the
//! command line, one [`BackendTask`] for the work, and one macro, [`run_on!`], that runs the
//! task with the chosen backend as a type parameter.
//!
//! Which backends a program offers is decided by the program's own Cargo features, so that a
//! backend it does not offer is never compiled into it, even when another package of the same
//! build turns the backend on: [`run_on!`] and [`compiled_backends!`] are expanded in the
//! calling crate, and their arms are `#[cfg(feature = "…")]` of that crate. A program using
//! them declares the features `ndarray`, `flex`, `wgpu`, `vulkan` and `cuda`, each enabling
//! the same feature of this crate (`ndarray = ["backend-select/ndarray"]`, …).
//!
//! # Example
//! ```
//! use backend_select::{BackendName, BackendTask, run_on};
//! use clustered_attention::ClusteredAttentionBackend;
//!
//! /// Counts the elements of a random tensor on the chosen backend.
//! struct Count;
//!
//! impl BackendTask for Count {
//!     type Output = usize;
//!
//!     fn run<B: ClusteredAttentionBackend>(self, _: BackendName, device: B::Device) -> usize {
//!         let x = burn::tensor::Tensor::<B, 2>::zeros([3, 4], &device);
//!         x.shape().num_elements()
//!     }
//! }
//!
//! // A crate without the `ndarray` feature gets `Err(NotCompiled(BackendName::Ndarray))`.
//! assert_eq!(run_on!(BackendName::Ndarray, Count), Ok(12));
//! ```

use clustered_attention::ClusteredAttentionBackend;

/// The backends a program can run on, by their command-line names (`ndarray`, `flex`, `wgpu`,
/// `wgpu-unfused`, `vulkan`, `cuda`, `cuda-unfused`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum BackendName {
    /// Burn's NdArray CPU backend (`NdArray<f32>`).
    Ndarray,
    /// Burn's Flex CPU backend.
    Flex,
    /// Burn's `Wgpu`: WGPU (Vulkan, Metal, DirectX or WebGPU; Mesa's lavapipe without a GPU),
    /// with Burn's fusion.
    Wgpu,
    /// WGPU's plain `CubeBackend`: each op its own kernel launch, no fusion.
    WgpuUnfused,
    /// Burn's `Vulkan`: WGPU through Vulkan with SPIR-V kernels, with fusion.
    Vulkan,
    /// Burn's `Cuda`, with fusion.
    Cuda,
    /// CUDA's plain `CubeBackend`: each op its own kernel launch, no fusion.
    CudaUnfused,
}

impl BackendName {
    /// The command-line name, e.g. `wgpu-unfused`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ndarray => "ndarray",
            Self::Flex => "flex",
            Self::Wgpu => "wgpu",
            Self::WgpuUnfused => "wgpu-unfused",
            Self::Vulkan => "vulkan",
            Self::Cuda => "cuda",
            Self::CudaUnfused => "cuda-unfused",
        }
    }

    /// The Cargo feature that compiles the backend into a program (`wgpu` for `wgpu-unfused`,
    /// `cuda` for `cuda-unfused`).
    pub fn feature(self) -> &'static str {
        match self {
            Self::WgpuUnfused => "wgpu",
            Self::CudaUnfused => "cuda",
            other => other.name(),
        }
    }

    /// Whether the backend runs each op as its own kernel, without Burn's fusion.
    pub fn is_unfused(self) -> bool {
        matches!(self, Self::WgpuUnfused | Self::CudaUnfused)
    }
}

impl core::fmt::Display for BackendName {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.pad(self.name())
    }
}

/// Work to run on a backend chosen at run time: [`run_on!`] calls [`BackendTask::run`] with
/// the backend as the type parameter `B` and its default device.
///
/// Training needs an autodiff backend: wrap `B` in `burn::backend::Autodiff<B>`, which is a
/// [`ClusteredAttentionBackend`] whenever `B` is.
pub trait BackendTask {
    /// What the task returns.
    type Output;

    /// Runs the task on the backend `B`, named `name`, with its default `device`.
    fn run<B: ClusteredAttentionBackend>(
        self,
        name: BackendName,
        device: B::Device,
    ) -> Self::Output;
}

/// The error of [`run_on!`] for a backend that is not compiled into the program.
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

/// The concrete backend types, for [`run_on!`]; each exists when this crate has the feature.
#[doc(hidden)]
pub mod types {
    #[cfg(feature = "cuda")]
    pub use burn::backend::Cuda;
    #[cfg(feature = "flex")]
    pub use burn::backend::Flex;
    #[cfg(feature = "vulkan")]
    pub use burn::backend::Vulkan;
    #[cfg(feature = "wgpu")]
    pub use burn::backend::Wgpu;

    /// Burn's NdArray backend in `f32`.
    #[cfg(feature = "ndarray")]
    pub type NdArray = burn::backend::NdArray<f32>;

    /// WGPU's `CubeBackend` with the element types of Burn's `Wgpu`.
    #[cfg(feature = "wgpu")]
    pub type WgpuUnfused =
        burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;

    /// CUDA's `CubeBackend` with the element types of Burn's `Cuda`.
    #[cfg(feature = "cuda")]
    pub type CudaUnfused = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;
}

/// Runs `task` (a [`BackendTask`]) on the backend `name` (a [`BackendName`]), with its default
/// device: `Ok(task.run::<B>(name, device))`, or `Err(`[`NotCompiled`]`)` when the calling
/// crate does not compile that backend in (see the crate documentation for its features).
#[macro_export]
macro_rules! run_on {
    ($name:expr, $task:expr) => {{
        let name: $crate::BackendName = $name;
        let task = $task;
        #[allow(unreachable_code)]
        let result: ::core::result::Result<_, $crate::NotCompiled> = match name {
            #[cfg(feature = "ndarray")]
            $crate::BackendName::Ndarray => Ok($crate::BackendTask::run::<$crate::types::NdArray>(
                task,
                name,
                Default::default(),
            )),
            #[cfg(feature = "flex")]
            $crate::BackendName::Flex => Ok($crate::BackendTask::run::<$crate::types::Flex>(
                task,
                name,
                Default::default(),
            )),
            #[cfg(feature = "wgpu")]
            $crate::BackendName::Wgpu => Ok($crate::BackendTask::run::<$crate::types::Wgpu>(
                task,
                name,
                Default::default(),
            )),
            #[cfg(feature = "wgpu")]
            $crate::BackendName::WgpuUnfused => Ok($crate::BackendTask::run::<
                $crate::types::WgpuUnfused,
            >(task, name, Default::default())),
            #[cfg(feature = "vulkan")]
            $crate::BackendName::Vulkan => Ok($crate::BackendTask::run::<$crate::types::Vulkan>(
                task,
                name,
                Default::default(),
            )),
            #[cfg(feature = "cuda")]
            $crate::BackendName::Cuda => Ok($crate::BackendTask::run::<$crate::types::Cuda>(
                task,
                name,
                Default::default(),
            )),
            #[cfg(feature = "cuda")]
            $crate::BackendName::CudaUnfused => Ok($crate::BackendTask::run::<
                $crate::types::CudaUnfused,
            >(task, name, Default::default())),
            #[allow(unreachable_patterns)]
            other => Err($crate::NotCompiled(other)),
        };
        result
    }};
}

/// The [`BackendName`]s that the calling crate compiles in (by its features), as a `Vec`.
#[macro_export]
macro_rules! compiled_backends {
    () => {{
        let mut names: ::std::vec::Vec<$crate::BackendName> = ::std::vec::Vec::new();
        #[cfg(feature = "ndarray")]
        names.push($crate::BackendName::Ndarray);
        #[cfg(feature = "flex")]
        names.push($crate::BackendName::Flex);
        #[cfg(feature = "wgpu")]
        names.extend([$crate::BackendName::Wgpu, $crate::BackendName::WgpuUnfused]);
        #[cfg(feature = "vulkan")]
        names.push($crate::BackendName::Vulkan);
        #[cfg(feature = "cuda")]
        names.extend([$crate::BackendName::Cuda, $crate::BackendName::CudaUnfused]);
        names
    }};
}
