//! Host implementations of the ops for CPU backends (NdArray, Flex).
//!
//! The tensors already live in host memory on these backends, so each op reads its inputs
//! with `into_data`, runs plain loops — popcounts for the K-means, a single pass with a small
//! sorted buffer for the top-k, per-cluster blocks of contiguous keys for the sparse products
//! — split over the `(batch, head)` rows on all cores, and writes the result back with
//! `from_data`. They reproduce the default bodies ([`super::reference`]): bit for bit for
//! the integer outputs, to rounding for the sparse products. Float ops run in `f32`; other
//! float dtypes fall back to the default bodies.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use super::reference::{self, check_topk};
use super::{NO_CLUSTER, host_lengths, initial_centroid_positions};

/// Below this many inner-loop steps an op runs on the calling thread.
const PARALLEL_THRESHOLD: usize = 1 << 16;

/// Calls `f(row, chunk)` for each of the `rows` equal chunks of `out`, spread over the
/// available cores when `rows × cost_per_row` is large enough to pay for the threads.
fn for_each_row<T: Send>(
    out: &mut [T],
    rows: usize,
    cost_per_row: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if rows == 0 || out.is_empty() {
        return;
    }
    let row_len = out.len() / rows;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(rows);
    if threads <= 1 || rows * cost_per_row < PARALLEL_THRESHOLD {
        for (row, chunk) in out.chunks_mut(row_len).enumerate() {
            f(row, chunk);
        }
        return;
    }
    let rows_per_thread = rows.div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        for (t, block) in out.chunks_mut(rows_per_thread * row_len).enumerate() {
            scope.spawn(move || {
                for (r, chunk) in block.chunks_mut(row_len).enumerate() {
                    f(t * rows_per_thread + r, chunk);
                }
            });
        }
    });
}

/// Host-memory access to a CPU backend's tensors.
///
/// The default methods go through `into_data` (a copy when the tensor is shared); NdArray and
/// Flex override [`HostAccess::with_f32`] to borrow their storage without copying.
pub trait HostAccess: Backend {
    /// Calls `f` with the `f32` values of `x` in row-major order.
    ///
    /// # Panics
    /// If `x` is not an `f32` tensor.
    fn with_f32<R>(x: &FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
        let data = Tensor::<Self, 1>::from_primitive(TensorPrimitive::Float(x.clone())).into_data();
        f(data.as_slice::<f32>().expect("an f32 tensor"))
    }
}

/// Dims of a float tensor of rank `D`.
fn dims<B: Backend, const D: usize>(x: &FloatTensor<B>) -> [usize; D] {
    x.shape().dims()
}

fn read_ints<B: Backend, const D: usize>(x: IntTensor<B>) -> (Vec<i64>, [usize; D]) {
    let x = Tensor::<B, D, Int>::from_primitive(x);
    let dims = x.dims();
    let data = x.into_data();
    let values = match data.dtype {
        DType::I64 => data.into_vec::<i64>().expect("i64 data"),
        DType::I32 => data
            .into_vec::<i32>()
            .expect("i32 data")
            .into_iter()
            .map(i64::from)
            .collect(),
        _ => data.iter::<i64>().collect(),
    };
    (values, dims)
}

fn write_f32<B: Backend, const D: usize>(
    values: Vec<f32>,
    dims: [usize; D],
    device: &B::Device,
) -> FloatTensor<B> {
    Tensor::<B, D>::from_data(TensorData::new(values, dims), (device, DType::F32))
        .into_primitive()
        .tensor()
}

fn write_ints<B: Backend, const D: usize>(
    values: Vec<i64>,
    dims: [usize; D],
    device: &B::Device,
) -> IntTensor<B> {
    Tensor::<B, D, Int>::from_data(TensorData::new(values, dims), device).into_primitive()
}

fn is_f32<B: Backend>(x: &FloatTensor<B>) -> bool {
    x.dtype() == DType::F32
}

// ---------------------------------------------------------------------------------------------
// Hamming K-means

/// Assignment step for fewer than 2¹⁶ clusters: the key `distance · 2¹⁶ + index` of each
/// centroid is unique, so its minimum picks the nearest centroid with ties to the lowest
/// index. Both loops are simple enough to vectorise.
#[inline(always)]
fn assign_keys(codes: &[u32], centroids: &[u32], index: &[u32], out: &mut [u32]) {
    let mut keys = vec![0u32; centroids.len()];
    for (a, &code) in out.iter_mut().zip(codes) {
        for ((key, &c), &i) in keys.iter_mut().zip(centroids).zip(index) {
            *key = ((code ^ c).count_ones() << 16) | i;
        }
        *a = keys.iter().copied().min().unwrap_or(0) & 0xFFFF;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
fn assign_avx2(codes: &[u32], centroids: &[u32], index: &[u32], out: &mut [u32]) {
    assign_keys(codes, centroids, index, out)
}

/// Assignment step: the nearest centroid of each code (AVX2 when available).
fn assign(codes: &[u32], centroids: &[u32], index: &[u32], out: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("popcnt")
    {
        // SAFETY: the CPU supports the features the function is compiled for.
        unsafe { assign_avx2(codes, centroids, index, out) };
        return;
    }
    assign_keys(codes, centroids, index, out)
}

/// K-means of one `(batch, head)` row: `codes` are the `n` valid codes; writes the
/// assignments of the whole row (padded ones `-1`).
fn kmeans_row(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    assignments.fill(NO_CLUSTER);
    let clusters = initial.len();
    if n <= clusters {
        for (i, a) in assignments.iter_mut().take(n).enumerate() {
            *a = i as i64;
        }
        return;
    }
    let codes = &codes[..n];
    let mut centroids: Vec<u32> = initial.iter().map(|&p| codes[p as usize]).collect();
    let index: Vec<u32> = (0..clusters as u32).collect();
    let mut nearest = vec![0u32; n];
    let mut ones = vec![0u32; clusters * 32];
    let mut counts = vec![0u32; clusters];
    for _ in 0..iterations {
        assign(codes, &centroids, &index, &mut nearest);
        ones.fill(0);
        counts.fill(0);
        for (&code, &c) in codes.iter().zip(&nearest) {
            let c = c as usize;
            counts[c] += 1;
            let bits = &mut ones[c * 32..(c + 1) * 32];
            for (b, count) in bits.iter_mut().enumerate() {
                *count += (code >> b) & 1;
            }
        }
        for (c, centroid) in centroids.iter_mut().enumerate() {
            for b in 0..32 {
                let twice = 2 * ones[c * 32 + b];
                if twice > counts[c] {
                    *centroid |= 1 << b;
                } else if twice < counts[c] {
                    *centroid &= !(1 << b);
                }
            }
        }
    }
    assign(codes, &centroids, &index, &mut nearest);
    for (a, &c) in assignments.iter_mut().zip(&nearest) {
        *a = c as i64;
    }
}

/// Host [`ClusteringBackend::hamming_kmeans`](super::ClusteringBackend::hamming_kmeans).
pub fn hamming_kmeans<B: Backend>(
    codes: IntTensor<B>,
    query_lengths: Option<IntTensor<B>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (IntTensor<B>, IntTensor<B>) {
    assert!(clusters > 0, "clusters must be at least 1, got 0");
    if clusters >= 1 << 16 {
        return reference::hamming_kmeans::<B>(codes, query_lengths, clusters, iterations, seed);
    }
    let codes = Tensor::<B, 3, Int>::from_primitive(codes);
    let device = codes.device();
    let (codes, [batch, heads, len]) = read_ints::<B, 3>(codes.into_primitive());
    let codes: Vec<u32> = codes.iter().map(|&c| c as i32 as u32).collect();
    let lengths = host_lengths::<B>(
        "query_lengths",
        query_lengths.map(Tensor::from_primitive),
        batch,
        len,
    );
    let initial = initial_centroid_positions(&lengths, heads, clusters, seed);

    let mut assignments = vec![0i64; batch * heads * len];
    for_each_row(
        &mut assignments,
        batch * heads,
        len * clusters * (iterations + 1),
        |row, out| {
            let n = lengths[row / heads];
            kmeans_row(
                &codes[row * len..(row + 1) * len],
                n,
                &initial[row * clusters..(row + 1) * clusters],
                iterations,
                out,
            );
        },
    );
    let mut counts = vec![0i64; batch * heads * clusters];
    for (row, chunk) in assignments.chunks(len).enumerate() {
        for &a in chunk.iter().filter(|&&a| a >= 0) {
            counts[row * clusters + a as usize] += 1;
        }
    }
    (
        write_ints::<B, 3>(assignments, [batch, heads, len], &device),
        write_ints::<B, 3>(counts, [batch, heads, clusters], &device),
    )
}

// ---------------------------------------------------------------------------------------------
// Top-k

/// Indices of the `k` largest of `scores` in descending order, lower index first among
/// equal scores: one pass keeping a sorted buffer of the best `k` so far.
fn topk_row(scores: &[f32], out: &mut [i64], best: &mut Vec<(f32, u32)>) {
    let k = out.len();
    best.clear();
    for (i, &score) in scores.iter().enumerate() {
        if best.len() == k {
            if score.total_cmp(&best[k - 1].0) != std::cmp::Ordering::Greater {
                continue;
            }
            best.pop();
        }
        let at = best.partition_point(|e| e.0.total_cmp(&score) != std::cmp::Ordering::Less);
        best.insert(at, (score, i as u32));
    }
    for (o, e) in out.iter_mut().zip(best.iter()) {
        *o = e.1 as i64;
    }
}

/// Host [`ClusteringBackend::topk_indices`](super::ClusteringBackend::topk_indices).
pub fn topk_indices<B: HostAccess>(scores: FloatTensor<B>, k: usize) -> IntTensor<B> {
    if !is_f32::<B>(&scores) {
        return reference::topk_indices::<B>(scores, k);
    }
    let device = B::float_device(&scores);
    let [batch, heads, rows, len] = dims::<B, 4>(&scores);
    check_topk(k, len);
    let mut out = vec![0i64; batch * heads * rows * k];
    B::with_f32(&scores, |scores| {
        for_each_row(&mut out, batch * heads, rows * len, |row, chunk| {
            let mut best = Vec::with_capacity(k + 1);
            for (c, out_row) in chunk.chunks_mut(k).enumerate() {
                let start = (row * rows + c) * len;
                topk_row(&scores[start..start + len], out_row, &mut best);
            }
        })
    });
    write_ints::<B, 4>(out, [batch, heads, rows, k], &device)
}

// ---------------------------------------------------------------------------------------------
// Sparse products

/// `a · b` with eight independent partial sums, so that the loop vectorises.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `y += alpha · x`.
#[inline(always)]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// `out = Σ_r weights[r] · block[r]` for a `[k, dim]` block, eight output columns at a time
/// so that the partial sums stay in registers.
#[inline(always)]
fn weighted_rows(weights: &[f32], block: &[f32], dim: usize, out: &mut [f32]) {
    let split = dim / 8 * 8;
    for start in (0..split).step_by(8) {
        let mut lanes = [0f32; 8];
        for (r, &w) in weights.iter().enumerate() {
            let row = &block[r * dim + start..r * dim + start + 8];
            for l in 0..8 {
                lanes[l] += w * row[l];
            }
        }
        out[start..start + 8].copy_from_slice(&lanes);
    }
    for d in split..dim {
        out[d] = weights
            .iter()
            .enumerate()
            .map(|(r, &w)| w * block[r * dim + d])
            .sum();
    }
}

/// The valid queries of one row grouped by cluster: `order[start[j]..start[j + 1]]` are the
/// queries of cluster `j`, in increasing position.
struct Members {
    start: Vec<usize>,
    order: Vec<u32>,
}

impl Members {
    fn new(assignments: &[i64], clusters: usize) -> Self {
        let mut start = vec![0usize; clusters + 1];
        for &a in assignments.iter().filter(|&&a| a >= 0) {
            start[a as usize + 1] += 1;
        }
        for j in 0..clusters {
            start[j + 1] += start[j];
        }
        let mut next = start.clone();
        let mut order = vec![0u32; start[clusters]];
        for (i, &a) in assignments.iter().enumerate().filter(|(_, a)| **a >= 0) {
            order[next[a as usize]] = i as u32;
            next[a as usize] += 1;
        }
        Self { start, order }
    }

    fn of(&self, cluster: usize) -> &[u32] {
        &self.order[self.start[cluster]..self.start[cluster + 1]]
    }
}

/// Shapes shared by the three sparse products.
struct Sparse {
    batch: usize,
    heads: usize,
    len: usize,
    clusters: usize,
    k: usize,
    topk: Vec<i64>,
    assignments: Vec<i64>,
}

impl Sparse {
    fn read<B: Backend>(topk: IntTensor<B>, assignments: IntTensor<B>) -> Self {
        let (topk, [batch, heads, clusters, k]) = read_ints::<B, 4>(topk);
        let (assignments, [_, _, len]) = read_ints::<B, 3>(assignments);
        Self {
            batch,
            heads,
            len,
            clusters,
            k,
            topk,
            assignments,
        }
    }

    fn rows(&self) -> usize {
        self.batch * self.heads
    }

    fn members(&self, row: usize) -> Members {
        Members::new(
            &self.assignments[row * self.len..(row + 1) * self.len],
            self.clusters,
        )
    }

    /// Key indices of cluster `j` of `row`.
    fn top(&self, row: usize, j: usize) -> &[i64] {
        let start = (row * self.clusters + j) * self.k;
        &self.topk[start..start + self.k]
    }

    /// Copies the top-k rows (`width` wide) of cluster `j` into `block`, `[k, width]`.
    fn gather(&self, row: usize, j: usize, x: &[f32], width: usize, block: &mut [f32]) {
        for (r, &t) in self.top(row, j).iter().enumerate() {
            let t = t as usize;
            block[r * width..(r + 1) * width].copy_from_slice(&x[t * width..(t + 1) * width]);
        }
    }
}

/// Host [`ClusteringBackend::sparse_dot`](super::ClusteringBackend::sparse_dot).
pub fn sparse_dot<B: HostAccess>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    if !is_f32::<B>(&queries) || !is_f32::<B>(&keys) {
        return reference::sparse_dot::<B>(queries, keys, topk, assignments);
    }
    let device = B::float_device(&queries);
    let [_, _, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, _] = dims::<B, 4>(&keys);
    let sparse = Sparse::read::<B>(topk, assignments);
    let k = sparse.k;
    let mut out = vec![0f32; sparse.rows() * len * k];
    B::with_f32(&queries, |queries| {
        B::with_f32(&keys, |keys| {
            for_each_row(&mut out, sparse.rows(), len * k * dim, |row, out| {
                let members = sparse.members(row);
                let queries = &queries[row * len * dim..(row + 1) * len * dim];
                let keys = &keys[row * keys_len * dim..(row + 1) * keys_len * dim];
                let mut block = vec![0f32; k * dim];
                for j in 0..sparse.clusters {
                    let members = members.of(j);
                    if members.is_empty() {
                        continue;
                    }
                    sparse.gather(row, j, keys, dim, &mut block);
                    for &i in members {
                        let i = i as usize;
                        let q = &queries[i * dim..(i + 1) * dim];
                        for (r, o) in out[i * k..(i + 1) * k].iter_mut().enumerate() {
                            *o = dot(q, &block[r * dim..(r + 1) * dim]);
                        }
                    }
                }
            })
        })
    });
    write_f32::<B, 4>(out, [sparse.batch, sparse.heads, len, k], &device)
}

/// Host [`ClusteringBackend::sparse_weighted_sum`](super::ClusteringBackend::sparse_weighted_sum).
pub fn sparse_weighted_sum<B: HostAccess>(
    weights: FloatTensor<B>,
    values: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    if !is_f32::<B>(&weights) || !is_f32::<B>(&values) {
        return reference::sparse_weighted_sum::<B>(weights, values, topk, assignments);
    }
    let device = B::float_device(&weights);
    let [_, _, len, k] = dims::<B, 4>(&weights);
    let [_, _, keys_len, dim] = dims::<B, 4>(&values);
    let sparse = Sparse::read::<B>(topk, assignments);
    let mut out = vec![0f32; sparse.rows() * len * dim];
    B::with_f32(&weights, |weights| {
        B::with_f32(&values, |values| {
            for_each_row(&mut out, sparse.rows(), len * k * dim, |row, out| {
                let members = sparse.members(row);
                let weights = &weights[row * len * k..(row + 1) * len * k];
                let values = &values[row * keys_len * dim..(row + 1) * keys_len * dim];
                let mut block = vec![0f32; k * dim];
                for j in 0..sparse.clusters {
                    let members = members.of(j);
                    if members.is_empty() {
                        continue;
                    }
                    sparse.gather(row, j, values, dim, &mut block);
                    for &i in members {
                        let i = i as usize;
                        weighted_rows(
                            &weights[i * k..(i + 1) * k],
                            &block,
                            dim,
                            &mut out[i * dim..(i + 1) * dim],
                        );
                    }
                }
            })
        })
    });
    write_f32::<B, 4>(out, [sparse.batch, sparse.heads, len, dim], &device)
}

/// Host [`ClusteringBackend::sparse_scatter`](super::ClusteringBackend::sparse_scatter).
pub fn sparse_scatter<B: HostAccess>(
    weights: FloatTensor<B>,
    x: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
    keys_len: usize,
) -> FloatTensor<B> {
    if !is_f32::<B>(&weights) || !is_f32::<B>(&x) {
        return reference::sparse_scatter::<B>(weights, x, topk, assignments, keys_len);
    }
    let device = B::float_device(&weights);
    let [_, _, len, k] = dims::<B, 4>(&weights);
    let [_, _, _, dim] = dims::<B, 4>(&x);
    let sparse = Sparse::read::<B>(topk, assignments);
    let mut out = vec![0f32; sparse.rows() * keys_len * dim];
    B::with_f32(&weights, |weights| {
        B::with_f32(&x, |x| {
            for_each_row(&mut out, sparse.rows(), len * k * dim, |row, out| {
                let members = sparse.members(row);
                let weights = &weights[row * len * k..(row + 1) * len * k];
                let x = &x[row * len * dim..(row + 1) * len * dim];
                let mut block = vec![0f32; k * dim];
                for j in 0..sparse.clusters {
                    let members = members.of(j);
                    if members.is_empty() {
                        continue;
                    }
                    block.fill(0.0);
                    for &i in members {
                        let i = i as usize;
                        let xi = &x[i * dim..(i + 1) * dim];
                        for (r, &w) in weights[i * k..(i + 1) * k].iter().enumerate() {
                            axpy(w, xi, &mut block[r * dim..(r + 1) * dim]);
                        }
                    }
                    for (r, &t) in sparse.top(row, j).iter().enumerate() {
                        let t = t as usize;
                        axpy(
                            1.0,
                            &block[r * dim..(r + 1) * dim],
                            &mut out[t * dim..(t + 1) * dim],
                        );
                    }
                }
            })
        })
    });
    write_f32::<B, 4>(out, [sparse.batch, sparse.heads, keys_len, dim], &device)
}
