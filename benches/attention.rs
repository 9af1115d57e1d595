//! `cargo bench -p bench`: divan micro-benchmarks of the two clustering ops and the three
//! attentions on NdArray, at batch 1, 4 heads, E = D = 64, C = 100, topk = 32, 32 bits,
//! 10 Lloyd iterations (the paper's settings), L = S ∈ {1024, 4096}.
//!
//! Each measured call ends with a read of the output to the host, so the time includes the
//! whole computation.

use burn::tensor::{Device, Distribution, Int, Tensor};
use clustered_attention::{
    AttentionInput, ClusteredAttention, FullAttention, ImprovedClusteredAttention, hamming_kmeans,
    lsh_hash, lsh_planes,
};
use divan::Bencher;

/// The NdArray CPU device (deprecated by Burn 0.22 in favour of Flex; kept for comparison with
/// earlier runs).
#[allow(deprecated)]
fn device() -> Device {
    Device::ndarray()
}

const LENGTHS: [usize; 2] = [1024, 4096];
const HEADS: usize = 4;
const DIM: usize = 64;
const CLUSTERS: usize = 100;
const TOPK: usize = 32;

fn main() {
    divan::main();
}

fn inputs(len: usize) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
    let device = device();
    let x = || {
        Tensor::<4>::random(
            [1, HEADS, len, DIM],
            Distribution::Normal(0.0, 1.0),
            &device,
        )
    };
    (x(), x(), x())
}

#[divan::bench(args = LENGTHS, sample_count = 10)]
fn lsh_hash_op(bencher: Bencher, len: usize) {
    let (queries, _, _) = inputs(len);
    let planes = lsh_planes(32, DIM, true, 0, &device());
    bencher.bench(|| lsh_hash(queries.clone(), planes.clone()).into_data());
}

#[divan::bench(args = LENGTHS, sample_count = 10)]
fn hamming_kmeans_op(bencher: Bencher, len: usize) {
    let (queries, _, _) = inputs(len);
    let planes = lsh_planes(32, DIM, true, 0, &device());
    let codes: Tensor<3, Int> = lsh_hash(queries, planes);
    bencher.bench(|| {
        hamming_kmeans(codes.clone(), None, CLUSTERS, 10, 0)
            .counts
            .into_data()
    });
}

#[divan::bench(args = LENGTHS, sample_count = 5)]
fn full(bencher: Bencher, len: usize) {
    let (q, k, v) = inputs(len);
    bencher.bench(|| {
        FullAttention::new()
            .forward(AttentionInput::new(q.clone(), k.clone(), v.clone()))
            .into_data()
    });
}

#[divan::bench(args = LENGTHS, sample_count = 10)]
fn clustered(bencher: Bencher, len: usize) {
    let (q, k, v) = inputs(len);
    bencher.bench(|| {
        ClusteredAttention::new(CLUSTERS)
            .forward(AttentionInput::new(q.clone(), k.clone(), v.clone()))
            .into_data()
    });
}

#[divan::bench(args = LENGTHS, sample_count = 10)]
fn improved(bencher: Bencher, len: usize) {
    let (q, k, v) = inputs(len);
    bencher.bench(|| {
        ImprovedClusteredAttention::new(CLUSTERS, TOPK)
            .forward(AttentionInput::new(q.clone(), k.clone(), v.clone()))
            .into_data()
    });
}
