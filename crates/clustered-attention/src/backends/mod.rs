//! The implementations of [`ClusteredAttentionBackend`](crate::ops::ClusteredAttentionBackend)
//! (and of [`ClusteredAttentionBackward`](crate::ops::ClusteredAttentionBackward), the ops the
//! `Autodiff` backend calls on the backend it wraps) for Burn's backends, one folder per backend,
//! the same file stem for the same op in each.
//!
//! - [`cpu`]: NdArray and Flex, host loops (and the [`HostAccess`](cpu::HostAccess) trait for
//!   other CPU backends).
//! - `cube/`: the CubeCL backend (WGPU, Vulkan, CUDA), each CubeCL kernel beside its launcher;
//!   its `mod.rs` implements the traits for Burn's `Cube` backend (`Fusion` over `CubeBackend`),
//!   each op with a kernel registered as a custom operation (`fusion.rs`) that runs the
//!   launcher when the stream executes.
//! - `autodiff.rs`: `Autodiff`, the backward nodes of the differentiable ops.
//! - `cuda` (feature `cuda`): what CUDA needs at run time, and [`cuda::toolkit`], its check.

#[cfg(feature = "autodiff")]
mod autodiff;
pub mod cpu;
// `pub(crate)`: `ops::score_products` asks `cube::score_products` on a Cube device.
#[cfg(feature = "cube")]
pub(crate) mod cube;
#[cfg(feature = "cuda")]
pub mod cuda;
