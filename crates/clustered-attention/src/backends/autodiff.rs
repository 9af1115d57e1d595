//! [`Autodiff`] passes the clustering ops through to its inner backend: codes, assignments
//! and counts are integers and carry no gradient.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::ClusteringBackend;

impl<B: ClusteringBackend, C: CheckpointStrategy> ClusteringBackend for Autodiff<B, C> {
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        B::lsh_hash(queries.primitive, planes.primitive)
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Option<IntTensor<Self>>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        B::hamming_kmeans(codes, query_lengths, clusters, iterations, seed)
    }
}
