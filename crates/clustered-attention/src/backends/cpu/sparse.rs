//! Host [`sparse_dot`], [`sparse_weighted_sum`] and [`sparse_scatter`]: per `(batch, head)` and
//! cluster, the cluster's top-k rows gathered into a small block, then its member queries;
//! and [`Sparse`], the index tensors of the sparse products and the top-k attention read to
//! the host, with [`Members`], each cluster's member queries.

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};

use super::access::{HostAccess, dims, on_host, read_ints, write_float};
use super::parallel::for_each_row;
use super::simd::{self, padded};
use crate::ops::{ClusteredAttentionBackend, NO_CLUSTER, reference};

/// The valid queries of one row grouped by cluster: `order[start[j]..start[j + 1]]` are the
/// queries of cluster `j`, in increasing position.
pub(super) struct Members {
    pub(super) start: Vec<usize>,
    order: Vec<u32>,
}

impl Members {
    pub(super) fn new(assignments: &[i64], clusters: usize) -> Self {
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

    pub(super) fn of(&self, cluster: usize) -> &[u32] {
        &self.order[self.start[cluster]..self.start[cluster + 1]]
    }
}

/// Shapes shared by the three sparse products.
pub(super) struct Sparse {
    pub(super) batch: usize,
    pub(super) heads: usize,
    pub(super) len: usize,
    pub(super) clusters: usize,
    pub(super) k: usize,
    pub(super) topk: Vec<i64>,
    pub(super) assignments: Vec<i64>,
}

impl Sparse {
    pub(super) fn read<B: HostAccess>(topk: IntTensor<B>, assignments: IntTensor<B>) -> Self {
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

    pub(super) fn rows(&self) -> usize {
        self.batch * self.heads
    }

    /// Panics unless every top-k index is in `0..keys_len` and every assignment in
    /// `0..clusters` or [`NO_CLUSTER`].
    pub(super) fn check(&self, keys_len: usize) {
        if let Some(t) = self
            .topk
            .iter()
            .find(|&&t| !(0..keys_len as i64).contains(&t))
        {
            panic!("topk holds {t}, outside 0..{keys_len} (the number of keys)");
        }
        let clusters = self.clusters as i64;
        if let Some(a) = self
            .assignments
            .iter()
            .find(|&&a| a != NO_CLUSTER && !(0..clusters).contains(&a))
        {
            panic!("assignments holds {a}, outside 0..{clusters} (the clusters) and not -1");
        }
    }

    /// The members of `row`'s queries in `run`, numbered from the run's start.
    pub(super) fn members_in(&self, row: usize, run: std::ops::Range<usize>) -> Members {
        Members::new(&self.assignments[row * self.len..][run], self.clusters)
    }

    pub(super) fn members(&self, row: usize) -> Members {
        Members::new(
            &self.assignments[row * self.len..(row + 1) * self.len],
            self.clusters,
        )
    }

    /// With `k = 1`: for each query of `row`, the one key of its cluster, `u32::MAX` for a
    /// padded query.
    pub(super) fn single_keys(&self, row: usize) -> Vec<u32> {
        debug_assert_eq!(self.k, 1);
        self.assignments[row * self.len..(row + 1) * self.len]
            .iter()
            .map(|&a| {
                if a == NO_CLUSTER {
                    u32::MAX
                } else {
                    self.top(row, a as usize)[0] as u32
                }
            })
            .collect()
    }

    /// Key indices of cluster `j` of `row`.
    pub(super) fn top(&self, row: usize, j: usize) -> &[i64] {
        let start = (row * self.clusters + j) * self.k;
        &self.topk[start..start + self.k]
    }

    /// Asks the CPU to bring the top-k rows (`width` wide) of cluster `j` of `x` into its
    /// caches: they are scattered over the sequence, so the next cluster's are fetched while
    /// the current one is computed.
    pub(super) fn prefetch_top(&self, row: usize, j: usize, x: &[f32], width: usize) {
        if j < self.clusters {
            for &t in self.top(row, j) {
                let t = t as usize;
                simd::prefetch(&x[t * width..(t + 1) * width]);
            }
        }
    }

    /// Copies the top-k rows (`width` wide) of cluster `j` into `block`, `[k, padded(width)]`,
    /// leaving the padding columns as they are.
    pub(super) fn gather(&self, row: usize, j: usize, x: &[f32], width: usize, block: &mut [f32]) {
        let wp = padded(width);
        for (r, &t) in self.top(row, j).iter().enumerate() {
            let t = t as usize;
            block[r * wp..r * wp + width].copy_from_slice(&x[t * width..(t + 1) * width]);
        }
    }

    /// Copies the top-k rows (`width` wide) of cluster `j` transposed into `block`,
    /// `[width, padded(k)]`, leaving the padding columns as they are.
    pub(super) fn gather_transposed(
        &self,
        row: usize,
        j: usize,
        x: &[f32],
        width: usize,
        block: &mut [f32],
    ) {
        let kp = padded(self.k);
        assert!(
            block.len() >= width * kp,
            "a transposed block holds width × padded(k)"
        );
        let top = self.top(row, j);
        let block = &mut block[..width * kp];
        // Four rows at a time: each column of the block gets four adjacent floats per store.
        let mut quads = top.chunks_exact(4);
        for (q, quad) in quads.by_ref().enumerate() {
            let rows: [&[f32]; 4] = std::array::from_fn(|i| {
                let t = quad[i] as usize;
                &x[t * width..(t + 1) * width]
            });
            for (e, column) in block.chunks_exact_mut(kp).enumerate() {
                for (out, row) in column[4 * q..4 * q + 4].iter_mut().zip(&rows) {
                    *out = row[e];
                }
            }
        }
        let done = top.len() - quads.remainder().len();
        for (r, &t) in quads.remainder().iter().enumerate() {
            let t = t as usize;
            for (column, &v) in block
                .chunks_exact_mut(kp)
                .zip(&x[t * width..(t + 1) * width])
            {
                column[done + r] = v;
            }
        }
    }
}

/// Host [`ClusteredAttentionBackend::sparse_dot`](ClusteredAttentionBackend::sparse_dot).
pub fn sparse_dot<B: HostAccess + ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    if !on_host::<B>(&queries) || !on_host::<B>(&keys) {
        return reference::sparse_dot::<B>(queries, keys, topk, assignments);
    }
    let (device, dtype) = (queries.device(), queries.dtype());
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
                let mut block = vec![0f32; dim * padded(k)];
                for j in 0..sparse.clusters {
                    let members = members.of(j);
                    if members.is_empty() {
                        continue;
                    }
                    sparse.gather_transposed(row, j, keys, dim, &mut block);
                    sparse.prefetch_top(row, j + 1, keys, dim);
                    simd::members_times_block(queries, dim, members, &block, k, out);
                }
            })
        })
    });
    write_float::<B, 4>(out, [sparse.batch, sparse.heads, len, k], &device, dtype)
}

/// Host
/// [`ClusteredAttentionBackend::sparse_weighted_sum`](ClusteredAttentionBackend::sparse_weighted_sum).
pub fn sparse_weighted_sum<B: HostAccess + ClusteredAttentionBackend>(
    weights: FloatTensor<B>,
    values: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    if !on_host::<B>(&weights) || !on_host::<B>(&values) {
        return reference::sparse_weighted_sum::<B>(weights, values, topk, assignments);
    }
    let (device, dtype) = (weights.device(), weights.dtype());
    let [_, _, len, k] = dims::<B, 4>(&weights);
    let [_, _, keys_len, dim] = dims::<B, 4>(&values);
    let sparse = Sparse::read::<B>(topk, assignments);
    sparse.check(keys_len);
    let mut out = vec![0f32; sparse.rows() * len * dim];
    B::with_f32(&weights, |weights| {
        B::with_f32(&values, |values| {
            for_each_row(&mut out, sparse.rows(), len * k * dim, |row, out| {
                let weights = &weights[row * len * k..(row + 1) * len * k];
                let values = &values[row * keys_len * dim..(row + 1) * keys_len * dim];
                if k == 1 {
                    let sources = sparse.single_keys(row);
                    simd::scale_rows(weights, values, dim, &sources, out);
                    return;
                }
                let members = sparse.members(row);
                let mut block = vec![0f32; k * padded(dim)];
                for j in 0..sparse.clusters {
                    let members = members.of(j);
                    if members.is_empty() {
                        continue;
                    }
                    sparse.gather(row, j, values, dim, &mut block);
                    sparse.prefetch_top(row, j + 1, values, dim);
                    simd::members_times_block(weights, k, members, &block, dim, out);
                }
            })
        })
    });
    write_float::<B, 4>(out, [sparse.batch, sparse.heads, len, dim], &device, dtype)
}

/// How many rows ahead the row gathers and scatters ask for the rows they will read or write:
/// the members of a cluster lie scattered over the sequence.
const PREFETCH_ROWS: usize = 8;

/// Asks the CPU for the row (`width` wide) of `x` of the member [`PREFETCH_ROWS`] after the
/// `m`-th, if there is one.
pub(super) fn prefetch_ahead(x: &[f32], width: usize, members: &[u32], m: usize) {
    if let Some(&ahead) = members.get(m + PREFETCH_ROWS) {
        let ahead = ahead as usize;
        simd::prefetch(&x[ahead * width..(ahead + 1) * width]);
    }
}

/// Copies the rows `members` (`width` wide) of `x` into the first `width` columns of `rows`,
/// `[members.len(), padded]`, leaving the padding columns as they are.
pub(super) fn gather_rows(x: &[f32], width: usize, members: &[u32], rows: &mut [f32]) {
    let padded = rows.len() / members.len();
    for (m, (&i, row)) in members
        .iter()
        .zip(rows.chunks_exact_mut(padded))
        .enumerate()
    {
        prefetch_ahead(x, width, members, m);
        let i = i as usize;
        row[..width].copy_from_slice(&x[i * width..(i + 1) * width]);
    }
}

/// Members of a cluster that the sparse scatter and the top-k attention's backward take at a
/// time: their gathered rows stay in the core's caches, and a large cluster needs no large
/// blocks.
pub(super) const MEMBER_CHUNK: usize = 256;

/// Adds the rows of `block` (`[top.len(), padded(width)]`, its first `width` columns) to the
/// rows `top` of `out` (rows of `width`).
pub(super) fn add_block_rows(block: &[f32], top: &[i64], width: usize, out: &mut [f32]) {
    let wp = padded(width);
    for (r, &t) in top.iter().enumerate() {
        let t = t as usize;
        for (o, &b) in out[t * width..(t + 1) * width]
            .iter_mut()
            .zip(&block[r * wp..])
        {
            *o += b;
        }
    }
}

/// Host [`ClusteredAttentionBackend::sparse_scatter`](ClusteredAttentionBackend::sparse_scatter).
pub fn sparse_scatter<B: HostAccess + ClusteredAttentionBackend>(
    weights: FloatTensor<B>,
    x: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
    keys_len: usize,
) -> FloatTensor<B> {
    if !on_host::<B>(&weights) || !on_host::<B>(&x) {
        return reference::sparse_scatter::<B>(weights, x, topk, assignments, keys_len);
    }
    let (device, dtype) = (weights.device(), weights.dtype());
    let [_, _, len, k] = dims::<B, 4>(&weights);
    let [_, _, _, dim] = dims::<B, 4>(&x);
    let sparse = Sparse::read::<B>(topk, assignments);
    sparse.check(keys_len);
    let mut out = vec![0f32; sparse.rows() * keys_len * dim];
    B::with_f32(&weights, |weights| {
        B::with_f32(&x, |x| {
            for_each_row(&mut out, sparse.rows(), len * k * dim, |row, out| {
                let weights = &weights[row * len * k..(row + 1) * len * k];
                let x = &x[row * len * dim..(row + 1) * len * dim];
                if k == 1 {
                    let targets = sparse.single_keys(row);
                    simd::scatter_rows(weights, x, dim, &targets, out);
                    return;
                }
                let members = sparse.members(row);
                let fp = padded(dim);
                let mut block = vec![0f32; k * fp];
                // The members' rows, gathered in runs of at most MEMBER_CHUNK.
                let mut rows = vec![0f32; MEMBER_CHUNK * fp];
                for j in 0..sparse.clusters {
                    let members = members.of(j);
                    if members.is_empty() {
                        continue;
                    }
                    block.fill(0.0);
                    for run in members.chunks(MEMBER_CHUNK) {
                        let rows = &mut rows[..run.len() * fp];
                        gather_rows(x, dim, run, rows);
                        simd::scatter_members(weights, k, run, rows, &mut block);
                    }
                    add_block_rows(&block, sparse.top(row, j), dim, out);
                }
            })
        })
    });
    write_float::<B, 4>(
        out,
        [sparse.batch, sparse.heads, keys_len, dim],
        &device,
        dtype,
    )
}
