//! Which query belongs to which cluster, in the form the sparse products take.

use burn::tensor::{DType, Int, Tensor};

use super::tensor::{sparse_scatter, sparse_weighted_sum};

/// The clustering of a batch's queries as the sparse products take it: each cluster a one-key
/// "top-k" of its own index, `[batch, heads, C, 1]`, with unit weights for the queries,
/// `[batch, heads, L, 1]`.
///
/// Its two halves are fast-transformers' `clustered_aggregate` ([`Self::aggregate`], a
/// [`sparse_scatter`]: the sum of each cluster's member rows) and `clustered_broadcast`
/// ([`Self::broadcast`], a [`sparse_weighted_sum`]: each query's cluster row, paper eq. 6).
/// Both skip padded queries (assignment `-1`), and both are differentiable on `Autodiff`.
pub(crate) struct QueryGroups {
    /// `[batch, heads, L]`: each query's cluster, in `0..C`, `-1` for a padded query.
    assignments: Tensor<3, Int>,
    /// `[batch, heads, C, 1]`, `identity[b, h, j, 0] = j`, in the int type of `assignments`.
    identity: Tensor<4, Int>,
    /// `[batch, heads, L, 1]` ones, in the float type of the rows moved.
    ones: Tensor<4>,
}

impl QueryGroups {
    /// The groups of `assignments` (`[batch, heads, L]`, in `0..clusters` or `-1`), moving rows
    /// of the float type `dtype`.
    pub fn new(assignments: Tensor<3, Int>, clusters: usize, dtype: DType) -> Self {
        let [batch, heads, len] = assignments.dims();
        let device = assignments.device();
        let identity = Tensor::<1, Int>::arange(0..clusters as i64, (&device, assignments.dtype()))
            .reshape([1, 1, clusters, 1])
            .expand([batch, heads, clusters, 1]);
        Self {
            identity,
            ones: Tensor::ones([batch, heads, len, 1], (&device, dtype)),
            assignments,
        }
    }

    /// `[batch, heads, L]`: each query's cluster, `-1` for a padded query.
    pub fn assignments(&self) -> Tensor<3, Int> {
        self.assignments.clone()
    }

    /// The sums of `x` over each cluster's member queries (`clustered_aggregate`, the
    /// numerator of paper eq. 3): `[batch, heads, L, F]` → `[batch, heads, C, F]`, zero for an
    /// empty cluster.
    pub fn aggregate(&self, x: Tensor<4>) -> Tensor<4> {
        let clusters = self.identity.dims()[2];
        sparse_scatter(
            self.ones.clone(),
            x,
            self.identity.clone(),
            self.assignments.clone(),
            clusters,
        )
    }

    /// The centroids of the clusters, the mean of their member queries (paper eq. 3):
    /// [`Self::aggregate`]'s sums times `inverse_counts` (`[batch, heads, C, 1]`, `1 / count`).
    /// Multiplying by the constant `1 / count` rather than dividing keeps the backward off
    /// `recip`, which NdArray's SIMD path computes to only ~12 bits.
    /// `queries`: `[batch, heads, L, E]` → `[batch, heads, C, E]`, zero for an empty cluster.
    pub fn centroids(&self, queries: Tensor<4>, inverse_counts: Tensor<4>) -> Tensor<4> {
        self.aggregate(queries) * inverse_counts
    }

    /// Each query's row of the per-cluster `x` (`clustered_broadcast`, paper eq. 6):
    /// `[batch, heads, C, F]` → `[batch, heads, L, F]`, zero for padded queries.
    pub fn broadcast(&self, x: Tensor<4>) -> Tensor<4> {
        sparse_weighted_sum(
            self.ones.clone(),
            x,
            self.identity.clone(),
            self.assignments.clone(),
        )
    }
}
