//! Per-backend implementations of [`ClusteringBackend`](crate::ClusteringBackend).
//!
//! CPU backends use the default bodies ([`crate::ops::reference`]); [`Autodiff`] passes the
//! inner primitives through, since the clustering ops carry no gradient.
//!
//! [`Autodiff`]: burn::backend::Autodiff

#[cfg(feature = "autodiff")]
mod autodiff;
mod cpu;
#[cfg(feature = "cube")]
mod cube;
#[cfg(feature = "cube")]
mod fusion;
