//! The test suite of `clustered-attention`, one binary (each binary costs link time).
//!
//! Every check compares the crate against an independent reference written here, on the host,
//! in `f64` (attention) or with plain integer loops (hashing, K-means), with a stated
//! tolerance. Attention-level tests run on NdArray and on Flex (and, with the `wgpu` and `cuda`
//! features, on the fused CubeCL backend).
//!
//! Burn 0.22's tensors have no backend type: a test runs on a backend by creating its tensors
//! on that backend's `Device` (`common::ndarray()`, `common::flex()`, their `.autodiff()` forms,
//! a WGPU or CUDA device), and the per-backend test modules pass each its device.
//!
//! - `common.rs`: host tensors, seeded inputs, the devices, the f64 references of the three
//!   attentions.
//! - `dropout.rs`: attention-weight dropout inside the fused ops (Philox4x32-10, the masks).
//! - `defaults.rs`: the default bodies (`ops::reference`) called on tensors of a concrete backend.
//! - `attention.rs`: full, clustered and improved attention against the references.
//! - `autodiff.rs`: gradients against full attention's and finite differences.
//! - `baselines.rs`: lsh-X, shared-full and oracle-top; dropout.
//! - `encoder.rs`: the transformer encoder against burn-nn's.
//! - `fused.rs`: the centroid and top-k attention ops and their backward passes.
//! - `gpu.rs`: the CubeCL kernels (WGPU, CUDA, fused) against the default bodies.
//! - `half.rs`: f16 and bf16 against f64.
//! - `inputs.rs`: bad input is rejected with a message naming the argument.
//! - `kmeans.rs`: hashing and K-means against plain loops.
//! - `layer.rs`: the multi-head layer against burn-nn's.
//! - `recompute.rs`: the encoder's activation dropout drawn again, its layers recomputed.
//! - `simd.rs`: the CPU tests again with each vector version of the host ops below the best.
//! - `sparse.rs`: top-k, softmax and sparse products; the per-backend test modules.

mod common;
mod defaults;

mod attention;
mod autodiff;
mod baselines;
mod dropout;
mod encoder;
mod fused;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu;
mod half;
mod inputs;
mod kmeans;
mod layer;
mod recompute;
mod simd;
mod sparse;
