//! The argument checks every backend shares: each panics with a message that names the
//! argument and the shapes.

use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{Int, Tensor};

#[cfg(doc)]
use super::ClusteredAttentionBackend;
use super::{MAX_BITS, QueryClusters};

/// Whether `1 ≤ bits ≤ 32`.
///
/// # Errors
/// A sentence naming `bits` and the range.
pub(crate) fn validate_bits(bits: usize) -> Result<(), String> {
    if (1..=MAX_BITS).contains(&bits) {
        Ok(())
    } else {
        Err(format!(
            "bits must be in 1..={MAX_BITS} (codes are u32 words), got {bits}"
        ))
    }
}

/// Panics unless `1 ≤ bits ≤ 32` ([`validate_bits`]).
pub(crate) fn check_bits(bits: usize) {
    if let Err(message) = validate_bits(bits) {
        panic!("{message}");
    }
}

/// Checks `bits` ([`check_bits`]) and that `planes [bits, E + 1]` fit `queries [batch, heads, L,
/// E]`.
///
/// # Panics
/// If `bits` is outside `1..=32` or `planes` does not have `E + 1` columns.
pub(crate) fn check_planes(queries: [usize; 4], planes: [usize; 2]) {
    let [bits, columns] = planes;
    check_bits(bits);
    assert!(
        columns == queries[3] + 1,
        "planes must have shape [bits, E + 1] = [{bits}, {}] for queries of shape {:?}, got {:?}",
        queries[3] + 1,
        queries,
        planes
    );
}

/// Checks the shapes of a [`ClusteredAttentionBackend::centroid_attention`] call and returns
/// those of the centroids and the values.
///
/// # Panics
/// If `centroids [batch, heads, C, E]`, `keys [batch, heads, S, E]` and
/// `values [batch, heads, S, D]` disagree, or `topk > S`.
pub(crate) fn check_centroid_attention(
    centroids: [usize; 4],
    keys: [usize; 4],
    values: [usize; 4],
    topk: usize,
) -> ([usize; 4], [usize; 4]) {
    assert!(
        centroids[..2] == keys[..2]
            && keys[..3] == values[..3]
            && centroids[3] == keys[3]
            && keys[2] > 0,
        "centroids {centroids:?}, keys {keys:?} and values {values:?} must be \
         [batch, heads, C, E], [batch, heads, S, E] and [batch, heads, S, D] with S > 0"
    );
    assert!(
        topk <= keys[2],
        "topk must be in 0..={} (the number of keys), got {topk}",
        keys[2]
    );
    (centroids, values)
}

/// Checks the shapes of a [`ClusteredAttentionBackend::improved_attention`] call's clustering and
/// returns `C`.
///
/// # Panics
/// If `assignments` is not `[batch, heads, L]` or `inverse_counts` not `[batch, heads, C, 1]`.
pub(crate) fn check_query_clusters(
    queries: [usize; 4],
    clusters: &QueryClusters<impl Backend>,
) -> usize {
    let [batch, heads, len, _] = queries;
    let assignments: [usize; 3] = clusters.assignments.shape().dims();
    let inverse: [usize; 4] = clusters.inverse_counts.shape().dims();
    assert!(
        assignments == [batch, heads, len] && inverse[..2] == [batch, heads] && inverse[3] == 1,
        "clusters.assignments {assignments:?} must be [batch, heads, L] = {:?} and \
         clusters.inverse_counts {inverse:?} [batch, heads, C, 1]",
        [batch, heads, len]
    );
    inverse[2]
}

/// Checks the shapes of a [`ClusteredAttentionBackend::top_attention`] call.
///
/// # Panics
/// If `queries [batch, heads, L, E]`, `keys [batch, heads, S, E]`, `values [batch, heads, S, D]`,
/// `assignments [batch, heads, L]`, `topk [batch, heads, C, k]`, `mass [batch, heads, C, 1]`
/// and `rest [batch, heads, C, D]` disagree, or `k` is 0 or above `S`.
pub(crate) fn check_top_attention(
    queries: [usize; 4],
    keys: [usize; 4],
    values: [usize; 4],
    assignments: [usize; 3],
    topk: [usize; 4],
    mass: [usize; 4],
    rest: [usize; 4],
) {
    let [batch, heads, len, dim] = queries;
    let [_, _, keys_len, dim_v] = values;
    let [_, _, clusters, k] = topk;
    assert!(
        keys == [batch, heads, keys_len, dim]
            && assignments == [batch, heads, len]
            && topk[..2] == [batch, heads]
            && mass == [batch, heads, clusters, 1]
            && rest == [batch, heads, clusters, dim_v],
        "queries {queries:?}, keys {keys:?}, values {values:?}, assignments {assignments:?}, \
         topk {topk:?}, mass {mass:?} and rest {rest:?} must be [batch, heads, L, E], \
         [batch, heads, S, E], [batch, heads, S, D], [batch, heads, L], [batch, heads, C, k], \
         [batch, heads, C, 1] and [batch, heads, C, D]"
    );
    check_topk(k, keys_len);
}

/// [`check_top_attention`] of a call's tensors as the backend receives them.
///
/// # Panics
/// As [`check_top_attention`].
#[cfg(feature = "cube")]
pub(crate) fn check_cluster_top<B: Backend>(
    queries: &burn::backend::tensor::FloatTensor<B>,
    keys: &burn::backend::tensor::FloatTensor<B>,
    values: &burn::backend::tensor::FloatTensor<B>,
    clusters: &super::ClusterTop<B>,
) {
    check_top_attention(
        queries.shape().dims(),
        keys.shape().dims(),
        values.shape().dims(),
        clusters.assignments.shape().dims(),
        clusters.topk.shape().dims(),
        clusters.mass.shape().dims(),
        clusters.rest.shape().dims(),
    );
}

/// Panics unless `1 ≤ k ≤ len`.
pub(crate) fn check_topk(k: usize, len: usize) {
    assert!(
        (1..=len).contains(&k),
        "topk must be in 1..={len} (the number of keys), got {k}"
    );
}

/// The lengths tensor `name` (`[batch]`) read to the host by `read`, once `dims` has given its
/// shape, and checked against its sequence's length `seq_len`: one length per batch item (all
/// `seq_len` when `None`). The backends' readers of optional lengths are this with their own
/// tensor type.
///
/// # Panics
/// If the tensor is not `[batch]` or holds a length outside `0..=seq_len`.
pub(crate) fn checked_lengths<T>(
    name: &str,
    lengths: Option<T>,
    batch: usize,
    seq_len: usize,
    dims: impl FnOnce(&T) -> Vec<usize>,
    read: impl FnOnce(T) -> Vec<i64>,
) -> Vec<usize> {
    let Some(lengths) = lengths else {
        return vec![seq_len; batch];
    };
    let dims = dims(&lengths);
    assert!(
        dims == [batch],
        "{name} must have shape [batch] = [{batch}], got {dims:?}"
    );
    read(lengths)
        .into_iter()
        .enumerate()
        .map(|(b, len)| {
            // −1: the lengths of a padding mask, row b of which is not one (`padding_lengths`).
            assert!(
                len != -1,
                "{name}[{b}] = -1: mask_pad [{batch}, {seq_len}] must mask a suffix of each row \
                 (padding); row {b} unmasks a position after a masked one"
            );
            assert!(
                (0..=seq_len as i64).contains(&len),
                "{name}[{b}] = {len} is outside 0..={seq_len} (the sequence length)"
            );
            len as usize
        })
        .collect()
}

/// The values `known` of the lengths tensor `name` that the caller has on the host, as the
/// `read` of [`checked_lengths`] takes them.
///
/// # Panics
/// If `known` does not have one length per batch item.
pub(crate) fn known_lengths(name: &str, known: &[usize], batch: usize) -> Vec<i64> {
    assert!(
        known.len() == batch,
        "{name}: {} host lengths for a batch of {batch}",
        known.len()
    );
    known.iter().map(|&n| n as i64).collect()
}

/// Reads the lengths tensor `name` (`[batch]`) to the host and checks it against its
/// sequence's length `seq_len`.
///
/// Returns one length per batch item (all `seq_len` when `None`).
///
/// # Panics
/// If the tensor is not `[batch]` or holds a length outside `0..=seq_len`.
pub(crate) fn host_lengths(
    name: &str,
    lengths: Option<Tensor<1, Int>>,
    batch: usize,
    seq_len: usize,
) -> Vec<usize> {
    let dims = |lengths: &Tensor<1, Int>| lengths.dims().to_vec();
    let read = |lengths: Tensor<1, Int>| lengths.into_data().iter::<i64>().collect();
    checked_lengths(name, lengths, batch, seq_len, dims, read)
}
