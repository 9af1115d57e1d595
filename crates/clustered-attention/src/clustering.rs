//! Grouping the queries: LSH hashing followed by K-means in Hamming space (paper §3.2.2),
//! with the options of both and the hashing planes; the two ops themselves are
//! [`lsh_hash`] and [`hamming_kmeans`]. Also the positional baseline: contiguous blocks of
//! queries ([`QueryGrouping::PositionBlocks`], [`position_blocks`]).

use burn::config::Config;
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};
use serde::{Deserialize, Serialize};

use crate::ops::checks::check_bits;
pub use crate::ops::{Clusters, hamming_kmeans, lsh_hash};

/// What groups the queries into clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum QueryGrouping {
    /// LSH hashing, then K-means in Hamming space (paper §3.2.2): queries are grouped by
    /// content.
    #[default]
    HammingKmeans,
    /// `C` contiguous blocks of positions ([`position_blocks`]): queries are grouped by
    /// position alone, whatever their content. A baseline the paper does not have (its
    /// reviewers asked whether clusters follow position or content); the hashing options
    /// are then unused.
    PositionBlocks,
}

/// How the queries are grouped into clusters.
///
/// Defaults follow the reference implementation (fast-transformers): 10 Lloyd iterations,
/// hashing with a bias term; `bits` is 32 so that a code is one `u32` word.
#[derive(Config, Debug, PartialEq)]
pub struct ClusteringOptions {
    /// Number of clusters `C` per sequence and head (`≥ 1`). When a sequence has no more
    /// valid queries than `C`, each query is its own cluster and the attention is exact.
    pub clusters: usize,
    /// Number of hash bits `B`, in `1..=32`.
    #[config(default = 32)]
    pub bits: usize,
    /// Number of Lloyd iterations of the Hamming K-means.
    #[config(default = 10)]
    pub iterations: usize,
    /// With a random threshold per plane the Hamming distance tracks the L2 distance between
    /// queries; without it (threshold 0) it tracks their cosine distance.
    #[config(default = true)]
    pub hash_bias: bool,
    /// Seed of the hyperplanes and of the initial centroids: the same seed gives
    /// bit-identical clusters, run after run. The initial centroids of a sequence are drawn
    /// from the seed, the head and the sequence's valid length
    /// ([`initial_centroid_positions`](crate::ops::initial_centroid_positions)), so a sequence
    /// gets the same clusters alone or in any slot of any batch.
    #[config(default = 0)]
    pub seed: u64,
    /// What groups the queries: their hashes (the paper's method) or their positions.
    #[config(default = "QueryGrouping::HammingKmeans")]
    pub grouping: QueryGrouping,
}

impl ClusteringOptions {
    /// Checks the options.
    ///
    /// # Panics
    /// If `clusters` is 0 or `bits` is outside `1..=32`.
    pub fn check(&self) {
        assert!(self.clusters > 0, "clusters must be at least 1, got 0");
        check_bits(self.bits);
    }
}

/// Random hyperplanes for [`lsh_hash`], drawn on the host from a standard normal with a
/// [`Xoshiro256PlusPlus`] generator seeded by `seed`, so every backend hashes with the same
/// planes. Columns `0..dim` are the plane normals, column `dim` the thresholds (zero when
/// `hash_bias` is false), as in the sign-of-random-projections hash of the paper (§3.2.2).
///
/// # Shapes
/// Returns `[bits, dim + 1]` in the default float dtype of `device`.
///
/// # Panics
/// If `bits` is outside `1..=32`.
pub fn lsh_planes(
    bits: usize,
    dim: usize,
    hash_bias: bool,
    seed: u64,
    device: &Device,
) -> Tensor<2> {
    check_bits(bits);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut values: Vec<f32> = (0..bits * (dim + 1))
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    if !hash_bias {
        for row in values.chunks_mut(dim + 1) {
            row[dim] = 0.0;
        }
    }
    Tensor::from_data(TensorData::new(values, [bits, dim + 1]), device)
}

/// Hashes and clusters the queries with the given options (paper §3.2.2).
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`
/// - `query_lengths`: `[batch]`
/// - output: [`Clusters`] with assignments `[batch, heads, L]` and counts `[batch, heads, C]`
///
/// # Panics
/// If the options are invalid ([`ClusteringOptions::check`]) or a query length is outside
/// `0..=L`.
pub fn cluster_queries(
    queries: Tensor<4>,
    query_lengths: Option<Tensor<1, Int>>,
    options: &ClusteringOptions,
) -> Clusters {
    cluster_queries_host(queries, query_lengths, None, options)
}

/// [`cluster_queries`] given the values of `query_lengths` on the host (`known`, one per
/// sequence), which are then not read back to draw the initial centroids or the blocks.
pub(crate) fn cluster_queries_host(
    queries: Tensor<4>,
    query_lengths: Option<Tensor<1, Int>>,
    known: Option<&[usize]>,
    options: &ClusteringOptions,
) -> Clusters {
    options.check();
    if let Some(clusters) = replayed(&queries) {
        return clusters;
    }
    let clusters = compute_clusters(queries, query_lengths, known, options);
    record(&clusters);
    clusters
}

/// The clusters of a forward pass kept for its recomputation ([`with_cluster_memo`]).
pub(crate) enum ClusterMemo {
    /// Every clustering's result is appended.
    Record(Vec<Clusters>),
    /// Each clustering takes the next of these instead of computing it.
    Replay(std::collections::VecDeque<Clusters>),
}

thread_local! {
    static CLUSTER_MEMO: std::cell::RefCell<Option<ClusterMemo>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` with the clusterings of this thread recorded into or replayed from `memo`, and
/// gives `memo` back as `f` left it: a recomputed layer records its clusters in the forward
/// pass and replays them when it runs again in the backward pass, where its queries are the
/// same, instead of hashing and running K-means again. What was there before is back
/// afterwards, also when `f` panics.
pub(crate) fn with_cluster_memo<R>(memo: ClusterMemo, f: impl FnOnce() -> R) -> (R, ClusterMemo) {
    struct Restore(Option<ClusterMemo>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            CLUSTER_MEMO.with(|cell| *cell.borrow_mut() = previous);
        }
    }
    let previous = CLUSTER_MEMO.with(|cell| cell.borrow_mut().replace(memo));
    let restore = Restore(previous);
    let result = f();
    let memo = CLUSTER_MEMO
        .with(|cell| cell.borrow_mut().take())
        .expect("the cluster memo of with_cluster_memo");
    drop(restore);
    (result, memo)
}

/// The next replayed clusters, if a replaying memo is set.
///
/// # Panics
/// If the replayed clusters run out or are not shaped for `queries` (the forward pass
/// recomputed is not the one recorded).
fn replayed(queries: &Tensor<4>) -> Option<Clusters> {
    CLUSTER_MEMO.with(|cell| match cell.borrow_mut().as_mut()? {
        ClusterMemo::Record(_) => None,
        ClusterMemo::Replay(kept) => {
            let clusters = kept
                .pop_front()
                .expect("a recomputed forward pass clusters more often than it did");
            let [batch, heads, len, _] = queries.dims();
            assert_eq!(
                clusters.assignments.dims(),
                [batch, heads, len],
                "a recomputed forward pass clusters other queries than it did"
            );
            Some(clusters)
        }
    })
}

/// Appends `clusters` to a recording memo, if one is set.
fn record(clusters: &Clusters) {
    CLUSTER_MEMO.with(|cell| {
        if let Some(ClusterMemo::Record(kept)) = cell.borrow_mut().as_mut() {
            kept.push(clusters.clone());
        }
    })
}

/// [`cluster_queries_host`] without the memo.
fn compute_clusters(
    queries: Tensor<4>,
    query_lengths: Option<Tensor<1, Int>>,
    known: Option<&[usize]>,
    options: &ClusteringOptions,
) -> Clusters {
    let [batch, heads, len, dim] = queries.dims();
    if options.grouping == QueryGrouping::PositionBlocks {
        let lengths = match known {
            Some(known) => Some(known.iter().map(|&n| n as i64).collect()),
            None => query_lengths.map(|lengths| read_lengths(lengths, batch)),
        };
        return blocks(
            [batch, heads, len],
            lengths,
            options.clusters,
            &queries.device(),
        );
    }
    let planes = lsh_planes(
        options.bits,
        dim,
        options.hash_bias,
        options.seed,
        &queries.device(),
    );
    let codes = lsh_hash(queries.detach(), planes);
    crate::ops::hamming_kmeans_host(
        codes,
        query_lengths,
        known,
        options.clusters,
        options.iterations,
        options.seed,
    )
}

/// Groups the valid queries of every `(batch, head)` into `clusters` contiguous blocks of
/// positions ([`QueryGrouping::PositionBlocks`]): with `n` valid queries and `n > clusters`,
/// query `i` joins block `⌊i · clusters / n⌋`, so the blocks are in order and their sizes
/// differ by at most one; with `n ≤ clusters`, query `i` is alone in cluster `i` (the
/// attention is then exact, as with [`hamming_kmeans`]). Padded queries get
/// [`NO_CLUSTER`](crate::ops::NO_CLUSTER). Computed on the host (the lengths are read back).
///
/// # Shapes
/// - `dims`: `[batch, heads, L]`
/// - `query_lengths`: `[batch]`, each in `0..=L` (`None`: all `L`)
/// - output: [`Clusters`] with assignments `[batch, heads, L]` and counts
///   `[batch, heads, clusters]`
///
/// # Panics
/// If `clusters` is 0, `query_lengths` is not `[batch]` or a length is outside `0..=L`.
pub fn position_blocks(
    dims: [usize; 3],
    query_lengths: Option<Tensor<1, Int>>,
    clusters: usize,
    device: &Device,
) -> Clusters {
    let lengths = query_lengths.map(|lengths| read_lengths(lengths, dims[0]));
    blocks(dims, lengths, clusters, device)
}

/// The values of `query_lengths` (`[batch]`), read back.
///
/// # Panics
/// If `query_lengths` is not `[batch]`.
fn read_lengths(query_lengths: Tensor<1, Int>, batch: usize) -> Vec<i64> {
    assert!(
        query_lengths.dims() == [batch],
        "query_lengths must have shape [batch = {batch}], got {:?}",
        query_lengths.dims()
    );
    query_lengths
        .into_data()
        .try_into_vec_as::<i64>()
        .expect("i64 lengths")
}

/// [`position_blocks`] of the query lengths on the host (`None`: all `L`).
fn blocks(
    dims: [usize; 3],
    lengths: Option<Vec<i64>>,
    clusters: usize,
    device: &Device,
) -> Clusters {
    let [batch, heads, len] = dims;
    assert!(clusters > 0, "clusters must be at least 1, got 0");
    let lengths = lengths.unwrap_or_else(|| vec![len as i64; batch]);
    assert!(
        lengths.len() == batch,
        "query_lengths: {} lengths for a batch of {batch}",
        lengths.len()
    );
    let mut assignments = vec![crate::ops::NO_CLUSTER; batch * heads * len];
    let mut counts = vec![0i64; batch * heads * clusters];
    for (b, &n) in lengths.iter().enumerate() {
        assert!(
            (0..=len as i64).contains(&n),
            "query_lengths[{b}] = {n} must be in 0..={len}"
        );
        let n = n as usize;
        let block = |i: usize| if n <= clusters { i } else { i * clusters / n };
        for h in 0..heads {
            let row = (b * heads + h) * len;
            for i in 0..n {
                let j = block(i);
                assignments[row + i] = j as i64;
                counts[(b * heads + h) * clusters + j] += 1;
            }
        }
    }
    Clusters {
        assignments: Tensor::from_data(TensorData::new(assignments, [batch, heads, len]), device),
        counts: Tensor::from_data(TensorData::new(counts, [batch, heads, clusters]), device),
    }
}
