//! The test suite of `clustered-attention`, one binary (each binary costs link time).
//!
//! Every check compares the crate against an independent reference written here, on the host,
//! in `f64` (attention) or with plain integer loops (hashing, K-means), with a stated
//! tolerance. Attention-level tests run on NdArray and on Flex.
//!
//! - `common.rs`: host tensors, seeded inputs, the f64 references of the three attentions.
//! - `attention.rs`: full, clustered and improved attention against the references.
//! - `autodiff.rs`: gradients against full attention's and finite differences.
//! - `baselines.rs`: lsh-X, shared-full and oracle-top; dropout.
//! - `fused.rs`: the centroid and top-k attention ops and their backward passes.
//! - `gpu.rs`: the CubeCL kernels (WGPU, CUDA) against the default bodies.
//! - `half.rs`: f16 and bf16 against f64.
//! - `inputs.rs`: bad input is rejected with a message naming the argument.
//! - `kmeans.rs`: hashing and K-means against plain loops.
//! - `layer.rs`: the multi-head layer against burn-nn's.
//! - `simd.rs`: the CPU tests again with each vector version of the host ops below the best.
//! - `sparse.rs`: top-k, softmax and sparse products; the per-backend test modules.

mod common;

mod attention;
mod autodiff;
mod baselines;
mod fused;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu;
mod half;
mod inputs;
mod kmeans;
mod layer;
mod simd;
mod sparse;
