//! The test suite of `clustered-attention`, one binary (each binary costs link time).
//!
//! Every check compares the crate against an independent reference written here, on the host,
//! in `f64` (attention) or with plain integer loops (hashing, K-means), with a stated
//! tolerance. Attention-level tests run on NdArray and on Flex.

mod common;

mod attention;
mod autodiff;
mod baselines;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu;
mod half;
mod inputs;
mod kmeans;
mod layer;
mod sparse;
