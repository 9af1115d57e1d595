//! Per-backend implementations of [`ClusteringBackend`](crate::ClusteringBackend).
//!
//! CPU backends (NdArray, Flex) run host loops ([`crate::ops::host`]); `CubeBackend` runs
//! CubeCL kernels ([`crate::kernels`]) and `Fusion` registers them as custom operations;
//! [`Autodiff`] passes the clustering ops and the top-k through (no gradient) and
//! differentiates the sparse products with the inner backend's own.
//!
//! [`Autodiff`]: burn::backend::Autodiff

#[cfg(feature = "autodiff")]
mod autodiff;
mod cpu;
#[cfg(feature = "cube")]
mod cube;
#[cfg(feature = "cube")]
mod fusion;
