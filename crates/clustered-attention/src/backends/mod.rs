//! The implementations of [`ClusteredAttentionBackend`](crate::ClusteredAttentionBackend) for
//! Burn's backends, one folder per backend, the same file stem for the same op in each.
//!
//! - [`cpu`]: NdArray and Flex, host loops (and the [`HostAccess`](cpu::HostAccess) trait for
//!   other CPU backends).
//! - `cube/`: `CubeBackend` (WGPU, Vulkan, CUDA), each CubeCL kernel beside its launcher, and
//!   `Fusion`, which registers them as custom operations.
//! - `autodiff.rs`: `Autodiff`, the backward nodes of the differentiable ops.

#[cfg(feature = "autodiff")]
mod autodiff;
pub mod cpu;
#[cfg(feature = "cube")]
mod cube;
