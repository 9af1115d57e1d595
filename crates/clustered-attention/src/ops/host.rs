//! Host implementations of the ops for CPU backends (NdArray, Flex).
//!
//! The tensors already live in host memory on these backends, so each op borrows its float inputs
//! (copying only non-contiguous ones), runs loops — the projections of four queries on all hash
//! planes at once, for the K-means vector popcounts over sixteen codes (AVX-512) or per-byte
//! distance tables (elsewhere), a vectorised `exp` for the softmax, a single pass with a small
//! sorted buffer for the top-k, per-cluster blocks of gathered keys for the sparse products and the
//! per-query top-k attention, all in the private `simd` module, and the `gemm` crate's products for
//! the centroid attention — split over rows on rayon's global pool (the one the backends use), and
//! writes the result back with `from_data`. They reproduce the default bodies
//! ([`super::reference`]): bit for bit for the integer outputs, to rounding for the float ones.
//! Float ops compute and accumulate in `f32`: `f16` and `bf16` inputs are widened on the way in and
//! the results rounded to the input's dtype on the way out; `f64` inputs fall back to the default
//! bodies.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use rayon::prelude::*;

use super::reference::{self, check_planes, check_topk};
use super::simd::{self, padded};
use super::{NO_CLUSTER, host_lengths, initial_centroid_positions};

/// How many tasks the `items` (cluster rows, queries) of each of `rows` `(batch, head)`s split
/// into, so that the pool's threads share the work of fewer `(batch, head)`s than threads:
/// tasks of `least` items or more, one with enough `(batch, head)`s.
fn head_splits(rows: usize, items: usize, least: usize) -> usize {
    rayon::current_num_threads()
        .div_ceil(rows.max(1))
        .min(items.div_ceil(least))
        .max(1)
}

/// Below this many inner-loop steps an op runs on the calling thread.
const PARALLEL_THRESHOLD: usize = 1 << 16;

/// Calls `f(row, chunk)` for each of the `rows` equal chunks of `out`, on rayon's global
/// thread pool (the one NdArray, Flex and their matrix products use, so that no two pools
/// compete for the cores) when `rows × cost_per_row` is large enough to pay for it.
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
    if rows == 1 || rows * cost_per_row < PARALLEL_THRESHOLD {
        for (row, chunk) in out.chunks_mut(row_len).enumerate() {
            f(row, chunk);
        }
        return;
    }
    out.par_chunks_mut(row_len)
        .enumerate()
        .for_each(|(row, chunk)| f(row, chunk));
}

/// Host-memory access to a CPU backend's tensors.
///
/// The default methods go through `into_data` (a copy when the tensor is shared); NdArray and
/// Flex override [`HostAccess::with_f32`] to borrow their `f32` storage without copying, and
/// NdArray [`HostAccess::ints_to_vec`] to copy its int storage in one piece.
pub trait HostAccess: Backend {
    /// Calls `f` with the values of `x` in row-major order, as `f32` (`f16` and `bf16` values
    /// are widened exactly).
    ///
    /// # Panics
    /// If `x` is not an `f32`, `f16` or `bf16` tensor.
    fn with_f32<R>(x: &FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
        let data = Tensor::<Self, 1>::from_primitive(TensorPrimitive::Float(x.clone())).into_data();
        match data.dtype {
            DType::F32 => f(data.as_slice::<f32>().expect("an f32 tensor")),
            DType::F16 | DType::BF16 => f(&data.convert::<f32>().into_vec::<f32>().expect("f32")),
            other => panic!("expected an f32, f16 or bf16 tensor, got {other:?}"),
        }
    }

    /// The values of the int tensor `x` in row-major order, as `i64`.
    fn ints_to_vec(x: IntTensor<Self>) -> Vec<i64> {
        ints_through_data::<Self>(x)
    }
}

/// The values of the int tensor `x` in row-major order, as `i64`, through `into_data`: the
/// default [`HostAccess::ints_to_vec`].
pub(crate) fn ints_through_data<B: Backend>(x: IntTensor<B>) -> Vec<i64> {
    let data = Tensor::<B, 1, Int>::from_primitive(x).into_data();
    match data.dtype {
        DType::I64 => data.into_vec::<i64>().expect("i64 data"),
        DType::I32 => data
            .into_vec::<i32>()
            .expect("i32 data")
            .into_iter()
            .map(i64::from)
            .collect(),
        _ => data.iter::<i64>().collect(),
    }
}

/// Dims of a float tensor of rank `D`.
fn dims<B: Backend, const D: usize>(x: &FloatTensor<B>) -> [usize; D] {
    x.shape().dims()
}

fn read_ints<B: HostAccess, const D: usize>(x: IntTensor<B>) -> (Vec<i64>, [usize; D]) {
    let dims = x.shape().dims();
    (B::ints_to_vec(x), dims)
}

/// A float tensor of `dtype` from `f32` values (rounded to nearest for `f16` and `bf16`).
fn write_float<B: Backend, const D: usize>(
    values: Vec<f32>,
    dims: [usize; D],
    device: &B::Device,
    dtype: DType,
) -> FloatTensor<B> {
    let data = TensorData::new(values, dims).convert_dtype(dtype);
    Tensor::<B, D>::from_data(data, (device, dtype))
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

/// Reads `key_lengths` (`[batch]`) to the host: all `keys_len` when `None`.
///
/// # Panics
/// If the tensor is not `[batch]` or a length is outside `1..=keys_len`.
fn key_lengths_on_host<B: Backend>(
    key_lengths: Option<IntTensor<B>>,
    batch: usize,
    keys_len: usize,
) -> Vec<usize> {
    let lengths = host_lengths(
        "key_lengths",
        key_lengths.map(Tensor::<B, 1, Int>::from_primitive),
        batch,
        keys_len,
    );
    if let Some(b) = lengths.iter().position(|&n| n == 0) {
        panic!("key_lengths[{b}] = 0: every sequence needs at least one key");
    }
    lengths
}

/// Whether the host loops take `x`: `f32`, or a half type they widen to `f32`.
fn on_host<B: Backend>(x: &FloatTensor<B>) -> bool {
    matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

// ---------------------------------------------------------------------------------------------
// Hashing and softmax

/// Host [`ClusteringBackend::lsh_hash`](super::ClusteringBackend::lsh_hash): the projections
/// of four queries on all planes at a time, compared and packed in registers.
pub fn lsh_hash<B: HostAccess>(queries: FloatTensor<B>, planes: FloatTensor<B>) -> IntTensor<B> {
    if !on_host::<B>(&queries) || !on_host::<B>(&planes) {
        return reference::lsh_hash::<B>(queries, planes);
    }
    let device = B::float_device(&queries);
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [bits, columns] = dims::<B, 2>(&planes);
    check_planes([batch, heads, len, dim], [bits, columns]);
    // Planes transposed, `[E, 32]`; unused bits get zero normals and an infinite threshold.
    let mut normals = vec![0f32; dim * 32];
    let mut thresholds = [f32::INFINITY; 32];
    B::with_f32(&planes, |planes| {
        for (b, plane) in planes.chunks_exact(dim + 1).enumerate() {
            for (e, &v) in plane[..dim].iter().enumerate() {
                normals[e * 32 + b] = v;
            }
            thresholds[b] = plane[dim];
        }
    });
    let mut codes = vec![0u32; batch * heads * len];
    B::with_f32(&queries, |queries| {
        for_each_row(&mut codes, batch * heads, len * dim * 32, |row, out| {
            let queries = &queries[row * len * dim..(row + 1) * len * dim];
            simd::hash_rows(queries, dim, &normals, &thresholds, out);
        })
    });
    let codes = codes.into_iter().map(|c| i64::from(c as i32)).collect();
    write_ints::<B, 3>(codes, [batch, heads, len], &device)
}

/// Host [`ClusteringBackend::attention_softmax`](super::ClusteringBackend::attention_softmax)
/// of a rank-4 `f32`, `f16` or `bf16` tensor, computed in `f32` on a copy: one pass for the
/// maximum, one for the exponentials and their sum, one for the scaling, per row, with a
/// vectorised `exp` (other ranks and dtypes use the backend's softmax).
pub fn attention_softmax<B: HostAccess>(x: FloatTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let last = shape.num_dims() - 1;
    if !on_host::<B>(&x) || shape.num_dims() != 4 || shape[last] == 0 {
        return B::softmax(x, last);
    }
    let (device, dtype) = (B::float_device(&x), x.dtype());
    let dims = dims::<B, 4>(&x);
    let width = dims[3];
    let rows = dims[0] * dims[1] * dims[2];
    let mut out = B::with_f32(&x, <[f32]>::to_vec);
    for_each_row(&mut out, rows, width, |_, row| {
        simd::softmax_rows(row, width)
    });
    write_float::<B, 4>(out, dims, &device, dtype)
}

// ---------------------------------------------------------------------------------------------
// Hamming K-means

/// Assignment step for fewer than 2¹⁶ clusters: the key `distance · 2¹⁶ + index` of each
/// centroid is unique, so its minimum picks the nearest centroid with ties to the lowest
/// index. Sixteen codes at a time go through all centroids, their minima in one vector.
#[inline(always)]
fn assign(codes: &[u32], centroids: &[u32], out: &mut [u32]) {
    const W: usize = 16;
    let nearest = |code: &[u32; W]| {
        let mut best = [u32::MAX; W];
        for (j, &c) in centroids.iter().enumerate() {
            for l in 0..W {
                best[l] = best[l].min(((code[l] ^ c).count_ones() << 16) | j as u32);
            }
        }
        best.map(|key| key & 0xFFFF)
    };
    let mut chunks = codes.chunks_exact(W);
    let mut outs = out.chunks_exact_mut(W);
    for (code, out) in (&mut chunks).zip(&mut outs) {
        out.copy_from_slice(&nearest(code.try_into().unwrap()));
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        let mut code = [0u32; W];
        code[..tail.len()].copy_from_slice(tail);
        let best = nearest(&code);
        outs.into_remainder().copy_from_slice(&best[..tail.len()]);
    }
}

/// Most clusters [`NearestTable`] handles: a centroid index takes the low 10 bits of its keys.
const TABLE_CLUSTERS: usize = 1 << 10;

/// The assignment step by table lookups, for CPUs without vector popcounts: a code's distance
/// to every centroid is the sum of four table rows, one per byte of the code.
///
/// Row `(p, v)` holds, for each centroid `j`, the Hamming distance of the byte value `v` to
/// byte `p` of centroid `j`, times 2¹⁰; the rows of byte 0 also hold `j` in the low 10 bits.
/// The sum of a code's four rows is then `distance · 2¹⁰ + j` (at most 32 · 2¹⁰ + 1023), and
/// its minimum picks the nearest centroid with ties to the lowest index, as [`assign`] does.
/// The columns past the last centroid, up to a multiple of 16, hold distance 33 and never win.
struct NearestTable {
    /// `[4, 256, padded]` keys.
    rows: Vec<u16>,
    /// Columns per row: the number of clusters rounded up to 16.
    padded: usize,
}

impl NearestTable {
    /// Lanes of the minimum (one AVX2 register of `u16`).
    const W: usize = 16;

    fn new(clusters: usize) -> Self {
        assert!(
            clusters <= TABLE_CLUSTERS,
            "a nearest-centroid table holds at most {TABLE_CLUSTERS} clusters, got {clusters}"
        );
        let padded = clusters.div_ceil(Self::W) * Self::W;
        Self {
            rows: vec![0; 4 * 256 * padded],
            padded,
        }
    }

    /// Fills the rows for `centroids` (as many as the table was made for). Row `v` of a byte
    /// is row `v & (v − 1)` (`v` without its lowest set bit `b`) plus or minus 2¹⁰ where bit
    /// `b` of the centroid's byte is clear or set.
    #[inline(always)]
    fn fill(&mut self, centroids: &[u32]) {
        let cp = self.padded;
        const ONE: u16 = 1 << 10;
        let mut step = vec![0u16; 8 * cp];
        for (p, byte_rows) in self.rows.chunks_exact_mut(256 * cp).enumerate() {
            let (first, later) = byte_rows.split_at_mut(cp);
            for j in 0..cp {
                let byte = centroids.get(j).map(|&c| (c >> (8 * p)) & 0xFF);
                first[j] = match (byte, p) {
                    (Some(byte), 0) => ((byte.count_ones() << 10) | j as u32) as u16,
                    (Some(byte), _) => (byte.count_ones() << 10) as u16,
                    (None, 0) => ((33 << 10) | j as u32) as u16,
                    (None, _) => 0,
                };
                for b in 0..8 {
                    step[b * cp + j] = match byte {
                        Some(byte) if byte >> b & 1 == 1 => ONE.wrapping_neg(),
                        Some(_) => ONE,
                        None => 0,
                    };
                }
            }
            for v in 1..256 {
                let (done, rest) = later.split_at_mut((v - 1) * cp);
                let base = v & (v - 1);
                let from = if base == 0 {
                    &*first
                } else {
                    &done[(base - 1) * cp..base * cp]
                };
                let b = v.trailing_zeros() as usize;
                let step = &step[b * cp..(b + 1) * cp];
                for ((out, &from), &step) in rest[..cp].iter_mut().zip(from).zip(step) {
                    *out = from.wrapping_add(step);
                }
            }
        }
    }

    /// Writes the index of the nearest centroid of each code to `out`.
    #[inline(always)]
    fn assign(&self, codes: &[u32], out: &mut [u32]) {
        const W: usize = NearestTable::W;
        let cp = self.padded;
        for (&code, out) in codes.iter().zip(out) {
            let row = |p: usize| {
                let v = (code >> (8 * p)) as usize & 0xFF;
                &self.rows[(p * 256 + v) * cp..(p * 256 + v + 1) * cp]
            };
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            let mut best = [u16::MAX; W];
            for (((a, b), c), d) in r0
                .chunks_exact(W)
                .zip(r1.chunks_exact(W))
                .zip(r2.chunks_exact(W))
                .zip(r3.chunks_exact(W))
            {
                for l in 0..W {
                    best[l] = best[l].min(a[l] + b[l] + c[l] + d[l]);
                }
            }
            let key = best.iter().fold(u16::MAX, |m, &k| m.min(k));
            *out = u32::from(key) & (TABLE_CLUSTERS as u32 - 1);
        }
    }
}

/// The assignment step: by `table` when there is one, else by [`assign`].
#[inline(always)]
fn assign_all(table: &mut Option<NearestTable>, codes: &[u32], centroids: &[u32], out: &mut [u32]) {
    match table {
        Some(table) => {
            table.fill(centroids);
            table.assign(codes, out);
        }
        None => assign(codes, centroids, out),
    }
}

/// K-means of one `(batch, head)` row: `codes` are the `n` valid codes; writes the
/// assignments of the whole row (padded ones `-1`). With `TABLE`, the assignment steps use a
/// [`NearestTable`] when there are at most [`TABLE_CLUSTERS`] clusters. Stops at a fixed
/// point: once an update leaves every centroid as it was, each remaining iteration would
/// repeat it, so the assignments are those of all `iterations` (the benchmark's codes reach
/// one within four).
#[inline(always)]
fn kmeans_row_body<const TABLE: bool>(
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
    let mut nearest = vec![0u32; n];
    let mut ones = vec![0u32; clusters * 32];
    let mut counts = vec![0u32; clusters];
    let mut table = (TABLE && clusters <= TABLE_CLUSTERS).then(|| NearestTable::new(clusters));
    // `nearest` holds the assignment to the current centroids once an update changes none.
    let mut fixed_point = false;
    for _ in 0..iterations {
        assign_all(&mut table, codes, &centroids, &mut nearest);
        ones.fill(0);
        counts.fill(0);
        for (&code, &c) in codes.iter().zip(&nearest) {
            let c = c as usize;
            counts[c] += 1;
            let bits: &mut [u32; 32] = (&mut ones[c * 32..(c + 1) * 32]).try_into().unwrap();
            for (b, count) in bits.iter_mut().enumerate() {
                *count += (code >> b) & 1;
            }
        }
        let mut changed = false;
        for (c, centroid) in centroids.iter_mut().enumerate() {
            let old = *centroid;
            for b in 0..32 {
                let twice = 2 * ones[c * 32 + b];
                if twice > counts[c] {
                    *centroid |= 1 << b;
                } else if twice < counts[c] {
                    *centroid &= !(1 << b);
                }
            }
            changed |= *centroid != old;
        }
        // Unchanged centroids give the same assignment and update again: every remaining
        // iteration would repeat this one.
        if !changed {
            fixed_point = true;
            break;
        }
    }
    if !fixed_point {
        assign_all(&mut table, codes, &centroids, &mut nearest);
    }
    for (a, &c) in assignments.iter_mut().zip(&nearest) {
        *a = c as i64;
    }
}

/// [`kmeans_row_body`] with AVX-512 vector popcounts (`vpopcntd`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512vpopcntdq,avx2,popcnt")]
fn kmeans_row_avx512(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    kmeans_row_body::<false>(codes, n, initial, iterations, assignments)
}

/// [`kmeans_row_body`] with AVX2 and a [`NearestTable`] (AVX2 has no vector popcount).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
fn kmeans_row_avx2(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    kmeans_row_body::<true>(codes, n, initial, iterations, assignments)
}

/// K-means of one row, compiled for the best vector instructions the CPU has.
fn kmeans_row(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f")
            && has!("avx512vl")
            && has!("avx512bw")
            && has!("avx512vpopcntdq")
            && has!("avx2")
            && has!("popcnt")
        {
            // SAFETY: the CPU supports the features the function is compiled for.
            return unsafe { kmeans_row_avx512(codes, n, initial, iterations, assignments) };
        }
        if has!("avx2") && has!("popcnt") {
            // SAFETY: as above.
            return unsafe { kmeans_row_avx2(codes, n, initial, iterations, assignments) };
        }
    }
    kmeans_row_body::<true>(codes, n, initial, iterations, assignments)
}

/// Host [`ClusteringBackend::hamming_kmeans`](super::ClusteringBackend::hamming_kmeans).
pub fn hamming_kmeans<B: HostAccess>(
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

/// Host [`ClusteringBackend::topk_indices`](super::ClusteringBackend::topk_indices).
pub fn topk_indices<B: HostAccess>(scores: FloatTensor<B>, k: usize) -> IntTensor<B> {
    if !on_host::<B>(&scores) {
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
                simd::topk_row(&scores[start..start + len], out_row, &mut best);
            }
        })
    });
    write_ints::<B, 4>(out, [batch, heads, rows, k], &device)
}

// ---------------------------------------------------------------------------------------------
// Centroid attention

/// Cluster rows per block of the host centroid attention: all the clusters of a head in the
/// paper's settings, so that each part of the keys and values is packed for `gemm` once per
/// head.
const CENTROID_ROWS: usize = 128;

/// Keys per task of the host centroid attention's backward: a `(batch, head)` splits into
/// tasks of four parts, so that the pool's threads share the work whatever the number of
/// heads; each task has its own block of the centroids' gradient, summed afterwards.
const KEY_CHUNK: usize = 4 * KEY_PART;

/// Keys per part of the host centroid attention: a block's scores against one part,
/// `128 × 512` floats (256 KiB), and the part's keys and values stay in a core's L2 cache
/// through the top-k, the softmax and the products, whatever the sequence length (as in
/// flash attention).
const KEY_PART: usize = 512;

thread_local! {
    /// The scores block of the host centroid attention, reused between calls.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst[m × n] = lhs[m × k] · rhs[k × n]` with the `gemm` crate on the calling thread; each
/// operand is given by its pointer, column stride and row stride (in elements).
///
/// # Safety
/// Every element the strides address must lie in its allocation, and `dst` must not overlap
/// `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_into(
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize, isize),
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_add(false, [m, n, k], dst, lhs, rhs) }
}

/// [`matmul_into`], adding the product to `dst`'s contents when `accumulate` is true.
///
/// # Safety
/// As [`matmul_into`].
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_add(
    accumulate: bool,
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize, isize),
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
) {
    // SAFETY: forwarded from the caller; without `accumulate` (gemm's `read_dst`), dst's old
    // contents are ignored.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            dst.1,
            dst.2,
            accumulate,
            lhs.0,
            lhs.1,
            lhs.2,
            rhs.0,
            rhs.1,
            rhs.2,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Host [`ClusteringBackend::centroid_attention`](super::ClusteringBackend::centroid_attention)
/// in `f32` (`f16` and `bf16` widened), one pass over the keys as flash attention makes it:
/// for every block of up to 128 cluster rows of a `(batch, head)` (fewer rows when there are
/// fewer `(batch, head)`s than threads), on rayon's pool, and every part of 512 valid keys,
/// the part's scores (a `gemm` product into a per-thread scratch block), each row's top-k so
/// far updated, the online softmax (the rows' running maxima and sums, `e^(scores − max)` in
/// place), and the product of the part's weights outside the current top-k with its values
/// added to the rescaled output rows. A key that leaves a row's top-k in a later part adds
/// its weight times its value then, so the output is the rest of `Aᶜ V` without a
/// subtraction. Also returns each row's log-sum-exp of the scores (`f32`), which the backward
/// pass uses.
pub fn centroid_attention<B: HostAccess + super::ClusteringBackend>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
) -> super::CentroidAttention<B> {
    let empty = [&centroids, &values]
        .iter()
        .any(|x| x.shape().num_elements() == 0);
    if empty || ![&centroids, &keys, &values].iter().all(|x| on_host::<B>(x)) {
        return reference::centroid_attention::<B>(centroids, keys, values, key_lengths, topk);
    }
    let (device, dtype) = (B::float_device(&centroids), centroids.dtype());
    let [batch, heads, clusters, dim] = dims::<B, 4>(&centroids);
    let [_, _, keys_len, _] = dims::<B, 4>(&keys);
    let [_, _, _, dim_v] = dims::<B, 4>(&values);
    reference::check_centroid_attention(
        [batch, heads, clusters, dim],
        dims::<B, 4>(&keys),
        dims::<B, 4>(&values),
        topk,
    );
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    // One block of rows of one (batch, head) per task; `top_k` keeps chunks non-empty. With
    // fewer (batch, head)s than threads, a head's rows split into as many blocks as it takes
    // to give every thread one (of 16 rows or more): each block packs the keys once more.
    let top_k = topk.max(1);
    let blocks = head_splits(batch * heads, clusters, 16);
    let block_rows = clusters.div_ceil(blocks).clamp(1, CENTROID_ROWS);
    let mut out = vec![0f32; batch * heads * clusters * dim_v];
    let mut top = vec![0i64; batch * heads * clusters * top_k];
    let mut top_weights = vec![0f32; batch * heads * clusters * top_k];
    let mut log_sum_exp = vec![0f32; batch * heads * clusters];
    B::with_f32(&centroids, |centroids| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                let task = |bh: usize, r0: usize, block: CentroidRows| {
                    let valid = lengths[bh / heads];
                    let rows = block.log_sum_exp.len();
                    let centroids = &centroids[(bh * clusters + r0) * dim..][..rows * dim];
                    let keys = &keys[bh * keys_len * dim..][..valid * dim];
                    let values = &values[bh * keys_len * dim_v..][..valid * dim_v];
                    SCRATCH.with_borrow_mut(|scores| {
                        scores.resize(rows * KEY_PART, 0.0);
                        centroid_rows_forward(
                            centroids,
                            keys,
                            values,
                            [dim, dim_v, topk],
                            scores,
                            block,
                        );
                    });
                };
                let parts = out
                    .chunks_mut(clusters * dim_v)
                    .zip(top.chunks_mut(clusters * top_k))
                    .zip(top_weights.chunks_mut(clusters * top_k))
                    .zip(log_sum_exp.chunks_mut(clusters))
                    .enumerate()
                    .flat_map(|(bh, (((o, t), w), l))| {
                        let rows = block_rows;
                        o.chunks_mut(rows * dim_v)
                            .zip(t.chunks_mut(rows * top_k))
                            .zip(w.chunks_mut(rows * top_k))
                            .zip(l.chunks_mut(rows))
                            .enumerate()
                            .map(move |(i, (((o, t), w), l))| {
                                let block = CentroidRows {
                                    out: o,
                                    top: t,
                                    top_weights: w,
                                    log_sum_exp: l,
                                };
                                (bh, i * rows, block)
                            })
                    });
                if batch * heads * clusters * keys_len * (dim + dim_v) < PARALLEL_THRESHOLD {
                    parts.for_each(|(bh, r0, block)| task(bh, r0, block));
                } else {
                    parts
                        .collect::<Vec<_>>()
                        .into_par_iter()
                        .for_each(|(bh, r0, block)| task(bh, r0, block));
                }
            })
        })
    });
    let shape = [batch, heads, clusters, topk];
    super::CentroidAttention {
        values: write_float::<B, 4>(out, [batch, heads, clusters, dim_v], &device, dtype),
        top: (topk > 0).then(|| {
            (
                write_ints::<B, 4>(top, shape, &device),
                write_float::<B, 4>(top_weights, shape, &device, dtype),
            )
        }),
        log_sum_exp: Some(write_float::<B, 4>(
            log_sum_exp,
            [batch, heads, clusters, 1],
            &device,
            DType::F32,
        )),
    }
}

/// `scores [rows × n] = centroids [rows × E] · part_keysᵀ`: the scores of a block of cluster
/// rows against a part of `n` keys, row stride `n`.
///
/// # Panics
/// If `scores` holds fewer than `rows × n` floats.
fn part_scores(centroids: &[f32], part_keys: &[f32], dim: usize, scores: &mut [f32]) {
    let (rows, n) = (centroids.len() / dim, part_keys.len() / dim);
    let scores = &mut scores[..rows * n];
    // SAFETY: scores [rows × n], centroids [rows × E] and part_keys [n × E] are addressed
    // within their slices, and scores overlaps neither operand.
    unsafe {
        matmul_into(
            [rows, n, dim],
            (scores.as_mut_ptr(), 1, n as isize),
            (centroids.as_ptr(), 1, dim as isize),
            (part_keys.as_ptr(), dim as isize, 1),
        );
    }
}

/// The outputs of one block of cluster rows of the host centroid attention: the rest of
/// `Aᶜ V` `[rows, D]`, the top-k keys and their weights `[rows, k]` (one ignored column when
/// `k = 0`), and the log-sum-exp of the scores `[rows]`.
struct CentroidRows<'a> {
    out: &'a mut [f32],
    top: &'a mut [i64],
    top_weights: &'a mut [f32],
    log_sum_exp: &'a mut [f32],
}

/// The centroid attention of one block of cluster rows against the `valid` keys and values
/// of its `(batch, head)`, one part of [`KEY_PART`] keys at a time; `scores` is scratch of at
/// least `rows × KEY_PART` floats.
fn centroid_rows_forward(
    centroids: &[f32],
    keys: &[f32],
    values: &[f32],
    [dim, dim_v, topk]: [usize; 3],
    scores: &mut [f32],
    block: CentroidRows,
) {
    let rows = block.log_sum_exp.len();
    let valid = keys.len() / dim;
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut sum = vec![0f32; rows];
    let mut best: Vec<Vec<(f32, u32)>> = (0..rows).map(|_| Vec::with_capacity(topk + 1)).collect();
    let mut evicted = Vec::new();
    for offset in (0..valid).step_by(KEY_PART) {
        let n = (valid - offset).min(KEY_PART);
        let part = &mut scores[..rows * n];
        let part_keys = &keys[offset * dim..(offset + n) * dim];
        let part_values = &values[offset * dim_v..(offset + n) * dim_v];
        part_scores(centroids, part_keys, dim, part);
        for (r, row) in part.chunks_exact_mut(n).enumerate() {
            let best = &mut best[r];
            evicted.clear();
            let entered = simd::topk_offer(row, offset, topk, best, &mut evicted);
            let (new_max, part_sum) = simd::exp_row(row, max[r]);
            let out = &mut block.out[r * dim_v..(r + 1) * dim_v];
            if offset > 0 && new_max != max[r] {
                let factor = simd::exp_f32(max[r] - new_max);
                sum[r] *= factor;
                out.iter_mut().for_each(|o| *o *= factor);
            }
            sum[r] += part_sum;
            max[r] = new_max;
            // Keys of earlier parts that left the top-k join the rest now.
            if !evicted.is_empty() {
                simd::add_weighted_rows(&evicted, new_max, values, out);
            }
            // The weights of this part's keys in the top-k so far stay out of the product.
            if entered {
                for &(_, key) in best.iter() {
                    if let Some(i) = (key as usize).checked_sub(offset).filter(|&i| i < n) {
                        row[i] = 0.0;
                    }
                }
            }
        }
        // SAFETY: out [rows × D] (+)= part [rows × n] · values [n × D], within their slices.
        unsafe {
            matmul_add(
                offset > 0,
                [rows, dim_v, n],
                (block.out.as_mut_ptr(), 1, dim_v as isize),
                (part.as_ptr(), 1, n as isize),
                (part_values.as_ptr(), 1, dim_v as isize),
            );
        }
    }
    for r in 0..rows {
        let inv = 1.0 / sum[r];
        block.out[r * dim_v..(r + 1) * dim_v]
            .iter_mut()
            .for_each(|o| *o *= inv);
        block.log_sum_exp[r] = max[r] + sum[r].ln();
        if topk == 0 {
            continue;
        }
        let top = &mut block.top[r * topk..(r + 1) * topk];
        let weights = &mut block.top_weights[r * topk..(r + 1) * topk];
        // With fewer valid keys than k, the padded keys follow in order, with weight 0 (as
        // a ranking of the whole row with the padded scores at -inf gives them).
        let padded = (valid..).map(|key| (f32::NEG_INFINITY, key as u32));
        for ((t, w), (score, key)) in top
            .iter_mut()
            .zip(weights.iter_mut())
            .zip(best[r].iter().copied().chain(padded))
        {
            *t = key as i64;
            *w = simd::exp_f32(score - max[r]) * inv;
        }
    }
}

thread_local! {
    /// The gradient block of the host centroid attention's backward, beside [`SCRATCH`].
    static GRAD_SCRATCH: std::cell::RefCell<Vec<f32>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A task of the host centroid attention's backward: its `(batch, head)`, the first of its
/// keys, and its share of the centroids' gradient and its keys' and values' gradients.
type CentroidTask<'a> = (
    usize,
    usize,
    (&'a mut [f32], (&'a mut [f32], &'a mut [f32])),
);

/// Host
/// [`ClusteringBackend::centroid_attention_backward`](super::ClusteringBackend::centroid_attention_backward)
/// in `f32` (`f16` and `bf16` widened), one pass over the keys as flash attention's backward
/// makes it: `rowsum(Aᶜ ⊙ dA)` of every cluster row from the forward outputs, then per
/// `(batch, head)` and chunk of 2048 valid keys on rayon's pool, per block of up to 128
/// cluster rows and per part of 512 keys, the part's scores and `dA = grad_values · valuesᵀ`
/// (two `gemm` products into per-thread scratch blocks), the top-k weights' gradients at the
/// top-k keys, `Aᶜ` from the scores and the forward's log-sum-exps with the softmax's
/// Jacobian in place, then `dS · keys` added to the chunk's block of the centroids' gradient
/// and `dSᵀ · centroids` and `Rᵀ · grad_values` (`R`: `Aᶜ` without the top-k keys) to the
/// part's keys' and values' gradients; the chunks' blocks are summed in order of their keys.
/// Falls back to the default body when `forward` has no log-sum-exps.
#[allow(clippy::too_many_arguments)]
pub fn centroid_attention_backward<B: HostAccess + super::ClusteringBackend>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Option<IntTensor<B>>,
    forward: super::CentroidAttention<B>,
    grad_values: FloatTensor<B>,
    grad_top_weights: Option<FloatTensor<B>>,
) -> super::CentroidAttentionGrads<B> {
    let empty = [&centroids, &values]
        .iter()
        .any(|x| x.shape().num_elements() == 0);
    let floats = [&centroids, &keys, &values, &grad_values, &forward.values];
    let on_host_all = floats.iter().all(|x| on_host::<B>(x))
        && grad_top_weights.as_ref().is_none_or(|x| on_host::<B>(x))
        && forward.top.as_ref().is_none_or(|(_, w)| on_host::<B>(w))
        && forward
            .log_sum_exp
            .as_ref()
            .is_some_and(|x| on_host::<B>(x));
    if empty || !on_host_all || forward.top.is_some() != grad_top_weights.is_some() {
        return reference::centroid_attention_backward::<B>(
            centroids,
            keys,
            values,
            key_lengths,
            forward,
            grad_values,
            grad_top_weights,
        );
    }
    let (device, dtype) = (B::float_device(&centroids), centroids.dtype());
    let [batch, heads, clusters, dim] = dims::<B, 4>(&centroids);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    let mut grad_keys = vec![0f32; batch * heads * keys_len * dim];
    let mut grad_vals = vec![0f32; batch * heads * keys_len * dim_v];
    let grad_centroids = centroid_backward_into::<B>(
        [centroids, keys, values],
        key_lengths,
        forward,
        grad_values,
        grad_top_weights,
        (&mut grad_keys, &mut grad_vals),
    );
    super::CentroidAttentionGrads {
        centroids: write_float::<B, 4>(
            grad_centroids,
            [batch, heads, clusters, dim],
            &device,
            dtype,
        ),
        keys: write_float::<B, 4>(grad_keys, [batch, heads, keys_len, dim], &device, dtype),
        values: write_float::<B, 4>(grad_vals, [batch, heads, keys_len, dim_v], &device, dtype),
    }
}

/// The body of [`centroid_attention_backward`] once its inputs are known to be on the host,
/// with the log-sum-exps and the top-k (or neither): adds the keys' and values' gradients to
/// `grad_keys` `[batch, heads, S, E]` and `grad_vals` `[batch, heads, S, D]` and returns the
/// centroids' gradient `[batch, heads, C, E]`.
fn centroid_backward_into<B: HostAccess + super::ClusteringBackend>(
    [centroids, keys, values]: [FloatTensor<B>; 3],
    key_lengths: Option<IntTensor<B>>,
    forward: super::CentroidAttention<B>,
    grad_values: FloatTensor<B>,
    grad_top_weights: Option<FloatTensor<B>>,
    (grad_keys, grad_vals): (&mut [f32], &mut [f32]),
) -> Vec<f32> {
    let [batch, heads, clusters, dim] = dims::<B, 4>(&centroids);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    reference::check_centroid_attention(
        [batch, heads, clusters, dim],
        dims::<B, 4>(&keys),
        [batch, heads, keys_len, dim_v],
        0,
    );
    for (name, x) in [
        ("grad_values", &grad_values),
        ("forward.values", &forward.values),
    ] {
        assert!(
            dims::<B, 4>(x) == [batch, heads, clusters, dim_v],
            "{name} {:?} must be [batch, heads, C, D] = {:?}",
            dims::<B, 4>(x),
            [batch, heads, clusters, dim_v]
        );
    }
    let log_sum_exp = forward.log_sum_exp.expect("checked above");
    assert!(
        dims::<B, 4>(&log_sum_exp) == [batch, heads, clusters, 1],
        "forward.log_sum_exp {:?} must be [batch, heads, C, 1] = {:?}",
        dims::<B, 4>(&log_sum_exp),
        [batch, heads, clusters, 1]
    );
    let (top, top_weights, k) = match forward.top {
        Some((top, weights)) => {
            let (top, shape) = read_ints::<B, 4>(top);
            let grad_shape = dims::<B, 4>(grad_top_weights.as_ref().expect("checked above"));
            assert!(
                shape == grad_shape
                    && shape == dims::<B, 4>(&weights)
                    && shape[..3] == [batch, heads, clusters],
                "forward.top {shape:?}, its weights {:?} and grad_top_weights {grad_shape:?} \
                 must all be [batch, heads, C, k] with [batch, heads, C] = {:?}",
                dims::<B, 4>(&weights),
                [batch, heads, clusters]
            );
            if let Some(t) = top.iter().find(|&&t| !(0..keys_len as i64).contains(&t)) {
                panic!("forward.top holds {t}, outside 0..{keys_len} (the number of keys)");
            }
            (top, Some(weights), shape[3])
        }
        None => (Vec::new(), None, 0),
    };
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    // δ = rowsum(Aᶜ ⊙ dA) = grad_values · rest + grad_top_weights · top weights, per row.
    let mut delta = vec![0f32; batch * heads * clusters];
    B::with_f32(&grad_values, |grad_values| {
        B::with_f32(&forward.values, |rest| {
            let rows = grad_values
                .chunks_exact(dim_v)
                .zip(rest.chunks_exact(dim_v));
            for (d, (g, r)) in delta.iter_mut().zip(rows) {
                *d = g.iter().zip(r).map(|(&g, &r)| g * r).sum();
            }
        })
    });
    if let (Some(weights), Some(grad_top)) = (&top_weights, &grad_top_weights) {
        B::with_f32(weights, |weights| {
            B::with_f32(grad_top, |grad_top| {
                let rows = weights.chunks_exact(k).zip(grad_top.chunks_exact(k));
                for (d, (w, g)) in delta.iter_mut().zip(rows) {
                    *d += w.iter().zip(g).map(|(&w, &g)| w * g).sum::<f32>();
                }
            })
        });
    }
    let mut grad_centroids = vec![0f32; batch * heads * clusters * dim];
    let chunks_of = |bh: usize| lengths[bh / heads].div_ceil(KEY_CHUNK);
    let chunks: usize = (0..batch * heads).map(chunks_of).sum();
    let mut partial = vec![0f32; chunks * clusters * dim];
    assert!(
        grad_keys.len() == batch * heads * keys_len * dim
            && grad_vals.len() == batch * heads * keys_len * dim_v,
        "the keys' and values' gradient buffers must hold [batch, heads, S, E] and \
         [batch, heads, S, D] floats"
    );
    let no_top = [];
    B::with_f32(&centroids, |centroids| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                B::with_f32(&grad_values, |grad_values| {
                    B::with_f32(&log_sum_exp, |log_sum_exp| {
                        let with_top = |f: &mut dyn FnMut(&[f32])| match &grad_top_weights {
                            Some(g) => B::with_f32(g, f),
                            None => f(&no_top),
                        };
                        with_top(&mut |grad_top: &[f32]| {
                            let task = |(bh, first, (dc, (dk, dv))): CentroidTask| {
                                let n = dk.len() / dim;
                                let keys = &keys[(bh * keys_len + first) * dim..][..n * dim];
                                let values =
                                    &values[(bh * keys_len + first) * dim_v..][..n * dim_v];
                                let head = CentroidHead {
                                    centroids: head_rows(centroids, bh, clusters * dim),
                                    grad_values: head_rows(grad_values, bh, clusters * dim_v),
                                    top: &top[bh * clusters * k..][..clusters * k],
                                    grad_top: head_rows(grad_top, bh, clusters * k),
                                    log_sum_exp: head_rows(log_sum_exp, bh, clusters),
                                    delta: head_rows(&delta, bh, clusters),
                                };
                                SCRATCH.with_borrow_mut(|scores| {
                                    GRAD_SCRATCH.with_borrow_mut(|grads| {
                                        let rows = clusters.min(CENTROID_ROWS);
                                        scores.resize(rows * KEY_PART, 0.0);
                                        grads.resize(rows * KEY_PART, 0.0);
                                        centroid_head_backward(
                                            &head,
                                            first,
                                            keys,
                                            values,
                                            [dim, dim_v, k],
                                            (scores, grads),
                                            (dc, dk, dv),
                                        );
                                    })
                                });
                            };
                            // One task per chunk of a (batch, head)'s valid keys: the keys' and
                            // values' gradients of the chunk, and its share of the centroids'
                            // gradient in a block of its own.
                            let mut tasks = Vec::with_capacity(partial.len() / (clusters * dim));
                            let mut blocks = partial.chunks_exact_mut(clusters * dim);
                            let heads_grads = grad_keys
                                .chunks_mut(keys_len * dim)
                                .zip(grad_vals.chunks_mut(keys_len * dim_v));
                            for (bh, (dk, dv)) in heads_grads.enumerate() {
                                let valid = lengths[bh / heads];
                                let chunks = dk[..valid * dim]
                                    .chunks_mut(KEY_CHUNK * dim)
                                    .zip(dv[..valid * dim_v].chunks_mut(KEY_CHUNK * dim_v));
                                for (i, grads) in chunks.enumerate() {
                                    let dc = blocks.next().expect("a block per chunk");
                                    tasks.push((bh, i * KEY_CHUNK, (dc, grads)));
                                }
                            }
                            let cost = clusters * KEY_CHUNK * (dim + dim_v);
                            if tasks.len() == 1 || tasks.len() * cost < PARALLEL_THRESHOLD {
                                tasks.into_iter().for_each(task);
                            } else {
                                tasks.into_par_iter().for_each(task);
                            }
                        })
                    })
                })
            })
        })
    });
    // The centroids' gradient: the chunks' shares in order of their keys.
    let mut blocks = partial.chunks_exact(clusters * dim);
    for (bh, dc) in grad_centroids.chunks_mut(clusters * dim).enumerate() {
        for block in blocks.by_ref().take(chunks_of(bh)) {
            for (o, &x) in dc.iter_mut().zip(block) {
                *o += x;
            }
        }
    }
    grad_centroids
}

/// The `bh`-th run of `n` values of `x`.
fn head_rows(x: &[f32], bh: usize, n: usize) -> &[f32] {
    &x[bh * n..(bh + 1) * n]
}

/// One `(batch, head)` of the centroid attention's backward: the scaled centroids `[C, E]`,
/// the gradient of the rest of `Aᶜ V` `[C, D]`, the top-k indices and their weights'
/// gradient `[C, k]` (empty without top-k), and each row's log-sum-exp of the scores and
/// `rowsum(Aᶜ ⊙ dA)` `[C]`.
struct CentroidHead<'a> {
    centroids: &'a [f32],
    grad_values: &'a [f32],
    top: &'a [i64],
    grad_top: &'a [f32],
    log_sum_exp: &'a [f32],
    delta: &'a [f32],
}

/// The backward of one [`CentroidHead`] against a run of its valid keys and values, from key
/// `first` on, a block of up to [`CENTROID_ROWS`] rows against a part of [`KEY_PART`] keys at
/// a time; `scratch` is two blocks of at least `min(C, 128) × KEY_PART` floats. Writes the
/// run's share of the centroids' gradients and adds the run's keys' and values' gradients to
/// what `grad_keys` and `grad_values` hold.
fn centroid_head_backward(
    head: &CentroidHead,
    first: usize,
    keys: &[f32],
    values: &[f32],
    [dim, dim_v, k]: [usize; 3],
    (scores, grads): (&mut [f32], &mut [f32]),
    (grad_centroids, grad_keys, grad_values): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let clusters = head.log_sum_exp.len();
    let valid = keys.len() / dim;
    for r0 in (0..clusters).step_by(CENTROID_ROWS) {
        let rows = (clusters - r0).min(CENTROID_ROWS);
        let centroids = &head.centroids[r0 * dim..(r0 + rows) * dim];
        let grad_out = &head.grad_values[r0 * dim_v..(r0 + rows) * dim_v];
        let grad_centroids = &mut grad_centroids[r0 * dim..(r0 + rows) * dim];
        for offset in (0..valid).step_by(KEY_PART) {
            let n = (valid - offset).min(KEY_PART);
            let (weights, grads) = (&mut scores[..rows * n], &mut grads[..rows * n]);
            let part_keys = &keys[offset * dim..(offset + n) * dim];
            let part_values = &values[offset * dim_v..(offset + n) * dim_v];
            part_scores(centroids, part_keys, dim, weights);
            // SAFETY (the other four products): every operand is addressed within its slice,
            // the scratch blocks as [rows × n], the part's keys [n × E] and values [n × D],
            // the block's centroids and their gradient [rows × E], grad_out [rows × D], and
            // the part's keys' and values' gradients [n × E] and [n × D]; no destination
            // overlaps an operand.
            unsafe {
                // dA = grad_out · valuesᵀ.
                matmul_into(
                    [rows, n, dim_v],
                    (grads.as_mut_ptr(), 1, n as isize),
                    (grad_out.as_ptr(), 1, dim_v as isize),
                    (part_values.as_ptr(), dim_v as isize, 1),
                );
            }
            for (r, (w, g)) in weights
                .chunks_exact_mut(n)
                .zip(grads.chunks_exact_mut(n))
                .enumerate()
            {
                let c = r0 + r;
                let top = &head.top[c * k..(c + 1) * k];
                let in_part = |t: i64| (t as usize).checked_sub(first + offset).filter(|&i| i < n);
                // A top-k key's weight reaches the output through the top-k weights only.
                for (&t, &g_top) in top.iter().zip(&head.grad_top[c * k..(c + 1) * k]) {
                    if let Some(i) = in_part(t) {
                        g[i] = g_top;
                    }
                }
                simd::softmax_backward_part(w, g, head.log_sum_exp[c], head.delta[c]);
                // The rest's weights for the values' gradient: Aᶜ without the top-k keys.
                for &t in top {
                    if let Some(i) = in_part(t) {
                        w[i] = 0.0;
                    }
                }
            }
            let (grad_keys, grad_values) = (
                &mut grad_keys[offset * dim..(offset + n) * dim],
                &mut grad_values[offset * dim_v..(offset + n) * dim_v],
            );
            unsafe {
                // The centroids' gradient dS · keys.
                matmul_add(
                    offset > 0,
                    [rows, dim, n],
                    (grad_centroids.as_mut_ptr(), 1, dim as isize),
                    (grads.as_ptr(), 1, n as isize),
                    (part_keys.as_ptr(), 1, dim as isize),
                );
                // The keys' gradient dSᵀ · centroids.
                matmul_add(
                    true,
                    [n, dim, rows],
                    (grad_keys.as_mut_ptr(), 1, dim as isize),
                    (grads.as_ptr(), n as isize, 1),
                    (centroids.as_ptr(), 1, dim as isize),
                );
                // The values' gradient Rᵀ · grad_out.
                matmul_add(
                    true,
                    [n, dim_v, rows],
                    (grad_values.as_mut_ptr(), 1, dim_v as isize),
                    (weights.as_ptr(), n as isize, 1),
                    (grad_out.as_ptr(), 1, dim_v as isize),
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sparse products

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
    fn read<B: HostAccess>(topk: IntTensor<B>, assignments: IntTensor<B>) -> Self {
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

    /// Panics unless every top-k index is in `0..keys_len` and every assignment in
    /// `0..clusters` or [`NO_CLUSTER`].
    fn check(&self, keys_len: usize) {
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
    fn members_in(&self, row: usize, run: std::ops::Range<usize>) -> Members {
        Members::new(&self.assignments[row * self.len..][run], self.clusters)
    }

    fn members(&self, row: usize) -> Members {
        Members::new(
            &self.assignments[row * self.len..(row + 1) * self.len],
            self.clusters,
        )
    }

    /// With `k = 1`: for each query of `row`, the one key of its cluster, `u32::MAX` for a
    /// padded query.
    fn single_keys(&self, row: usize) -> Vec<u32> {
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
    fn top(&self, row: usize, j: usize) -> &[i64] {
        let start = (row * self.clusters + j) * self.k;
        &self.topk[start..start + self.k]
    }

    /// Asks the CPU to bring the top-k rows (`width` wide) of cluster `j` of `x` into its
    /// caches: they are scattered over the sequence, so the next cluster's are fetched while
    /// the current one is computed.
    fn prefetch_top(&self, row: usize, j: usize, x: &[f32], width: usize) {
        if j < self.clusters {
            for &t in self.top(row, j) {
                let t = t as usize;
                simd::prefetch(&x[t * width..(t + 1) * width]);
            }
        }
    }

    /// Copies the top-k rows (`width` wide) of cluster `j` into `block`, `[k, padded(width)]`,
    /// leaving the padding columns as they are.
    fn gather(&self, row: usize, j: usize, x: &[f32], width: usize, block: &mut [f32]) {
        let wp = padded(width);
        for (r, &t) in self.top(row, j).iter().enumerate() {
            let t = t as usize;
            block[r * wp..r * wp + width].copy_from_slice(&x[t * width..(t + 1) * width]);
        }
    }

    /// Copies the top-k rows (`width` wide) of cluster `j` transposed into `block`,
    /// `[width, padded(k)]`, leaving the padding columns as they are.
    fn gather_transposed(&self, row: usize, j: usize, x: &[f32], width: usize, block: &mut [f32]) {
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

/// Host [`ClusteringBackend::sparse_dot`](super::ClusteringBackend::sparse_dot).
pub fn sparse_dot<B: HostAccess>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    if !on_host::<B>(&queries) || !on_host::<B>(&keys) {
        return reference::sparse_dot::<B>(queries, keys, topk, assignments);
    }
    let (device, dtype) = (B::float_device(&queries), queries.dtype());
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
                    simd::dot_members(queries, dim, members, &block, k, out);
                }
            })
        })
    });
    write_float::<B, 4>(out, [sparse.batch, sparse.heads, len, k], &device, dtype)
}

/// Host [`ClusteringBackend::sparse_weighted_sum`](super::ClusteringBackend::sparse_weighted_sum).
pub fn sparse_weighted_sum<B: HostAccess>(
    weights: FloatTensor<B>,
    values: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    if !on_host::<B>(&weights) || !on_host::<B>(&values) {
        return reference::sparse_weighted_sum::<B>(weights, values, topk, assignments);
    }
    let (device, dtype) = (B::float_device(&weights), weights.dtype());
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
                    simd::weighted_members(weights, k, members, &block, dim, out);
                }
            })
        })
    });
    write_float::<B, 4>(out, [sparse.batch, sparse.heads, len, dim], &device, dtype)
}

/// Host [`ClusteringBackend::top_attention`](super::ClusteringBackend::top_attention) in
/// `f32` (`f16` and `bf16` widened): per `(batch, head)` (per run of its queries when there
/// are fewer `(batch, head)`s than threads) on rayon's pool and per cluster, the cluster's
/// top-k keys (transposed) and values gathered into small blocks, then for four member queries
/// at a time the scores, their softmax and the weighted sum in registers, plus the cluster's
/// rest row.
pub fn top_attention<B: HostAccess + super::ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: super::ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
) -> FloatTensor<B> {
    let floats = [&queries, &keys, &values, &clusters.mass, &clusters.rest];
    if !floats.iter().all(|x| on_host::<B>(x)) {
        return reference::top_attention::<B>(queries, keys, values, clusters, key_lengths, scale);
    }
    let (device, dtype) = (B::float_device(&queries), queries.dtype());
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    reference::check_top_attention(
        [batch, heads, len, dim],
        dims::<B, 4>(&keys),
        [batch, heads, keys_len, dim_v],
        clusters.assignments.shape().dims(),
        clusters.topk.shape().dims(),
        dims::<B, 4>(&clusters.mass),
        dims::<B, 4>(&clusters.rest),
    );
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    let sparse = Sparse::read::<B>(clusters.topk, clusters.assignments);
    sparse.check(keys_len);
    let (k, num_clusters) = (sparse.k, sparse.clusters);
    let (kp, dp) = (padded(k), padded(dim_v));
    let mut out = vec![0f32; sparse.rows() * len * dim_v];
    B::with_f32(&queries, |queries| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                B::with_f32(&clusters.mass, |mass| {
                    B::with_f32(&clusters.rest, |rest| {
                        // One task per run of a (batch, head)'s queries: with fewer
                        // (batch, head)s than threads, a head's queries split into runs, each
                        // gathering the keys and values of the clusters it meets.
                        let runs = head_splits(sparse.rows(), len, 1024);
                        let run_len = len.div_ceil(runs);
                        let task = |(row, first, out): (usize, usize, &mut [f32])| {
                            let run = first..first + out.len() / dim_v;
                            let members = sparse.members_in(row, run.clone());
                            let valid = lengths[row / heads];
                            let queries =
                                &queries[(row * len + run.start) * dim..][..run.len() * dim];
                            let keys = &keys[row * keys_len * dim..(row + 1) * keys_len * dim];
                            let values =
                                &values[row * keys_len * dim_v..(row + 1) * keys_len * dim_v];
                            let mut key_t = vec![0f32; dim * kp];
                            let mut value_block = vec![0f32; k * dp];
                            let mut bias = vec![f32::NEG_INFINITY; kp];
                            let mut scratch = vec![0f32; 4 * kp];
                            let mut rest_row = vec![0f32; dp];
                            for j in 0..num_clusters {
                                let members = members.of(j);
                                if members.is_empty() {
                                    continue;
                                }
                                sparse.gather_transposed(row, j, keys, dim, &mut key_t);
                                sparse.gather(row, j, values, dim_v, &mut value_block);
                                sparse.prefetch_top(row, j + 1, keys, dim);
                                sparse.prefetch_top(row, j + 1, values, dim_v);
                                for (b, &t) in bias.iter_mut().zip(sparse.top(row, j)) {
                                    *b = if (t as usize) < valid {
                                        0.0
                                    } else {
                                        f32::NEG_INFINITY
                                    };
                                }
                                let c = row * num_clusters + j;
                                rest_row[..dim_v]
                                    .copy_from_slice(&rest[c * dim_v..(c + 1) * dim_v]);
                                let cluster = simd::ClusterBlock {
                                    key_t: &key_t,
                                    bias: &bias,
                                    values: &value_block,
                                    rest: &rest_row,
                                    dv: dim_v,
                                    mass: mass[c],
                                    scale: scale as f32,
                                };
                                simd::attend_members(
                                    queries,
                                    dim,
                                    members,
                                    &cluster,
                                    &mut scratch,
                                    out,
                                );
                            }
                        };
                        if out.is_empty() {
                            return;
                        }
                        let tasks: Vec<_> = out
                            .chunks_mut(len * dim_v)
                            .enumerate()
                            .flat_map(|(row, out)| {
                                out.chunks_mut(run_len * dim_v)
                                    .enumerate()
                                    .map(move |(r, out)| (row, r * run_len, out))
                            })
                            .collect();
                        if tasks.len() == 1
                            || tasks.len() * run_len * k * (dim + dim_v) < PARALLEL_THRESHOLD
                        {
                            tasks.into_iter().for_each(task);
                        } else {
                            tasks.into_par_iter().for_each(task);
                        }
                    })
                })
            })
        })
    });
    write_float::<B, 4>(out, [batch, heads, len, dim_v], &device, dtype)
}

/// How many rows ahead the row gathers and scatters ask for the rows they will read or write:
/// the members of a cluster lie scattered over the sequence.
const PREFETCH_ROWS: usize = 8;

/// Asks the CPU for the row (`width` wide) of `x` of the member [`PREFETCH_ROWS`] after the
/// `m`-th, if there is one.
fn prefetch_ahead(x: &[f32], width: usize, members: &[u32], m: usize) {
    if let Some(&ahead) = members.get(m + PREFETCH_ROWS) {
        let ahead = ahead as usize;
        simd::prefetch(&x[ahead * width..(ahead + 1) * width]);
    }
}

/// Copies the rows `members` (`width` wide) of `x` into the first `width` columns of `rows`,
/// `[members.len(), padded]`, leaving the padding columns as they are.
fn gather_rows(x: &[f32], width: usize, members: &[u32], rows: &mut [f32]) {
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
const MEMBER_CHUNK: usize = 256;

/// One `(batch, head)`'s operands of the host top-k attention's backward.
struct TopHead<'a> {
    sparse: &'a Sparse,
    row: usize,
    /// The `(batch, head)`'s valid keys.
    valid: usize,
    scale: f32,
    /// The `(batch, head)`'s masses, `[C]`.
    mass: &'a [f32],
    queries: &'a [f32],
    grad: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    dim: usize,
    dim_v: usize,
}

/// A task's blocks for [`TopHead::cluster`]: the cluster's top keys and values transposed
/// (`[ep, kp]`, `[dp, kp]`) and its top keys as rows (`[k, ep]`), its members' query and
/// gradient rows (`[n, ep]`, `[n, dp]`), their scores and gradient dot products (`[n, k]`), and
/// the results: the members' queries' gradient (`[n, dim]`), the top keys' and values' gradient
/// blocks (`[k, ep]`, `[k, dp]`) and the rest's gradient (`[dim_v]`). Sized for the largest
/// run of members and zeroed once: the loops overwrite what they read (the gradient blocks are
/// zeroed per cluster and added to over its runs), and padding stays zero.
struct TopScratch {
    key_t: Vec<f32>,
    value_t: Vec<f32>,
    key_block: Vec<f32>,
    bias: Vec<f32>,
    query_rows: Vec<f32>,
    grad_rows: Vec<f32>,
    probs: Vec<f32>,
    grad_scores: Vec<f32>,
    positions: Vec<u32>,
    grad_queries: Vec<f32>,
    grad_keys: Vec<f32>,
    grad_values: Vec<f32>,
    grad_rest: Vec<f32>,
}

impl TopScratch {
    fn new(k: usize, dim: usize, dim_v: usize, most: usize) -> Self {
        let (kp, ep, dp) = (padded(k), padded(dim), padded(dim_v));
        Self {
            key_t: vec![0.0; ep * kp],
            value_t: vec![0.0; dp * kp],
            key_block: vec![0.0; k * ep],
            bias: vec![0.0; k],
            query_rows: vec![0.0; most * ep],
            grad_rows: vec![0.0; most * dp],
            probs: vec![0.0; most * k],
            grad_scores: vec![0.0; most * k],
            positions: (0..most as u32).collect(),
            grad_queries: vec![0.0; most * dim],
            grad_keys: vec![0.0; k * ep],
            grad_values: vec![0.0; k * dp],
            grad_rest: vec![0.0; dim_v],
        }
    }
}

impl TopHead<'_> {
    /// Cluster `j`'s gradients, for its `members`, into `s` (see [`TopScratch`]); returns the
    /// gradient of its mass. The cluster's top keys and values are gathered into small blocks;
    /// then per run of up to [`MEMBER_CHUNK`] members, their query and gradient rows gathered,
    /// their scores and the gradient's dot products with the values, the softmax's Jacobian in
    /// place, then their queries' gradient, passed to `write_queries(run, rows)`, and their
    /// share of the keys', values' and rest's gradients, added to the blocks. The five products
    /// of a run are `gemm` calls on its gathered rows.
    fn cluster(
        &self,
        j: usize,
        members: &[u32],
        s: &mut TopScratch,
        mut write_queries: impl FnMut(&[u32], &[f32]),
    ) -> f32 {
        let (sparse, row, k) = (self.sparse, self.row, self.sparse.k);
        let (dim, dim_v) = (self.dim, self.dim_v);
        let (ep, dp) = (padded(dim), padded(dim_v));
        let top = sparse.top(row, j);
        sparse.gather_transposed(row, j, self.keys, dim, &mut s.key_t);
        sparse.gather_transposed(row, j, self.values, dim_v, &mut s.value_t);
        sparse.gather(row, j, self.keys, dim, &mut s.key_block);
        sparse.prefetch_top(row, j + 1, self.keys, dim);
        sparse.prefetch_top(row, j + 1, self.values, dim_v);
        for (b, &t) in s.bias.iter_mut().zip(top) {
            *b = if (t as usize) < self.valid {
                0.0
            } else {
                f32::NEG_INFINITY
            };
        }
        s.grad_keys.fill(0.0);
        s.grad_values.fill(0.0);
        s.grad_rest.fill(0.0);
        let mut grad_mass = 0.0;
        for run in members.chunks(MEMBER_CHUNK) {
            let n = run.len();
            let local = &s.positions[..n];
            let query_rows = &mut s.query_rows[..n * ep];
            let grad_rows = &mut s.grad_rows[..n * dp];
            gather_rows(self.queries, dim, run, query_rows);
            gather_rows(self.grad, dim_v, run, grad_rows);
            let probs = &mut s.probs[..n * k];
            let grad_scores = &mut s.grad_scores[..n * k];
            let kp = padded(k);
            // SAFETY (the five products): the gathered rows are [n × ep] and [n × dp], the
            // transposed blocks [ep × kp] and [dp × kp], the key block and the keys' and
            // values' gradient blocks [k × ep] and [k × dp], probs and grad_scores [n × k],
            // grad_queries [n × dim]; no destination overlaps an operand.
            unsafe {
                matmul_into(
                    [n, k, dim],
                    (probs.as_mut_ptr(), 1, k as isize),
                    (query_rows.as_ptr(), 1, ep as isize),
                    (s.key_t.as_ptr(), 1, kp as isize),
                );
                matmul_into(
                    [n, k, dim_v],
                    (grad_scores.as_mut_ptr(), 1, k as isize),
                    (grad_rows.as_ptr(), 1, dp as isize),
                    (s.value_t.as_ptr(), 1, kp as isize),
                );
            }
            grad_mass += simd::softmax_backward_members(
                probs,
                grad_scores,
                local,
                &s.bias,
                self.scale,
                self.mass[j],
            );
            let grad_queries = &mut s.grad_queries[..n * dim];
            // Queries: dS · top keys; keys: dSᵀ · q; values: Wᵀ · g; rest: Σ_i g_i.
            unsafe {
                matmul_into(
                    [n, dim, k],
                    (grad_queries.as_mut_ptr(), 1, dim as isize),
                    (grad_scores.as_ptr(), 1, k as isize),
                    (s.key_block.as_ptr(), 1, ep as isize),
                );
                matmul_add(
                    true,
                    [k, ep, n],
                    (s.grad_keys.as_mut_ptr(), 1, ep as isize),
                    (grad_scores.as_ptr(), k as isize, 1),
                    (query_rows.as_ptr(), 1, ep as isize),
                );
                matmul_add(
                    true,
                    [k, dp, n],
                    (s.grad_values.as_mut_ptr(), 1, dp as isize),
                    (probs.as_ptr(), k as isize, 1),
                    (grad_rows.as_ptr(), 1, dp as isize),
                );
            }
            write_queries(run, grad_queries);
            for row in grad_rows.chunks_exact(dp) {
                for (o, &g) in s.grad_rest.iter_mut().zip(row) {
                    *o += g;
                }
            }
        }
        grad_mass
    }
}

/// Adds the rows of `block` (`[top.len(), padded(width)]`, its first `width` columns) to the
/// rows `top` of `out` (rows of `width`).
fn add_block_rows(block: &[f32], top: &[i64], width: usize, out: &mut [f32]) {
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

/// One `(batch, head)`'s gradients of the queries and keys, and of the values, mass and rest.
type GradRows<'a> = (
    (&'a mut [f32], &'a mut [f32]),
    (&'a mut [f32], (&'a mut [f32], &'a mut [f32])),
);

/// Rows of `width` of a buffer that several tasks write at once, each row by one task.
struct DisjointRows<'a> {
    ptr: *mut f32,
    rows: usize,
    width: usize,
    _buffer: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: the rows are only reached through `row`, whose callers promise that no two threads
// reach one row.
unsafe impl Sync for DisjointRows<'_> {}

impl<'a> DisjointRows<'a> {
    fn new(buffer: &'a mut [f32], width: usize) -> Self {
        Self {
            ptr: buffer.as_mut_ptr(),
            rows: buffer.len() / width,
            width,
            _buffer: std::marker::PhantomData,
        }
    }

    /// Row `i`.
    ///
    /// # Safety
    /// No other reference to row `i` may live while the returned one does.
    ///
    /// # Panics
    /// If `i` is not a row of the buffer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        // SAFETY: the row lies in the buffer, borrowed mutably for 'a; the caller promises
        // that nothing else reaches it meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.width), self.width) }
    }
}

/// The gradients of a run of a `(batch, head)`'s clusters, for a head split between tasks
/// (its queries' gradient rows are written in place): its clusters' key and value gradient
/// blocks (`[k, padded(dim)]`, `[k, padded(dim_v)]` each) and mass and rest gradients, put in
/// place afterwards, the blocks added in cluster order.
struct TopPart {
    row: usize,
    clusters: std::ops::Range<usize>,
    scratch: TopScratch,
    keys: Vec<f32>,
    values: Vec<f32>,
    mass: Vec<f32>,
    rest: Vec<f32>,
}

/// Host [`ClusteringBackend::top_attention_backward`](super::ClusteringBackend::top_attention_backward)
/// in `f32` (`f16` and `bf16` widened): per `(batch, head)` on rayon's pool (per run of its
/// clusters when there are fewer `(batch, head)`s than threads and enough work) and per cluster
/// (one pass over its members); the keys' and values' gradients of each cluster are added to their
/// rows in cluster order, so the result does not depend on the split.
pub fn top_attention_backward<B: HostAccess + super::ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: super::ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    grad: FloatTensor<B>,
) -> super::TopAttentionGrads<B> {
    let floats = [&queries, &keys, &values, &clusters.mass, &grad];
    if !floats.iter().all(|x| on_host::<B>(x)) {
        return reference::top_attention_backward::<B>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            grad,
        );
    }
    let (device, dtype) = (B::float_device(&queries), queries.dtype());
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    let clusters_len = dims::<B, 4>(&clusters.mass)[2];
    let g = top_backward_buffers::<B>(queries, keys, values, clusters, key_lengths, scale, grad);
    super::TopAttentionGrads {
        queries: write_float::<B, 4>(g.queries, [batch, heads, len, dim], &device, dtype),
        keys: write_float::<B, 4>(g.keys, [batch, heads, keys_len, dim], &device, dtype),
        values: write_float::<B, 4>(g.values, [batch, heads, keys_len, dim_v], &device, dtype),
        mass: write_float::<B, 4>(g.mass, [batch, heads, clusters_len, 1], &device, dtype),
        rest: write_float::<B, 4>(g.rest, [batch, heads, clusters_len, dim_v], &device, dtype),
    }
}

/// Host
/// [`ClusteringBackend::improved_attention_backward`](super::ClusteringBackend::improved_attention_backward)
/// in `f32` (`f16` and `bf16` widened): the top-k attention's backward
/// ([`top_attention_backward`]'s loops), then the centroid attention's
/// ([`centroid_attention_backward`]'s loops) adding its keys' and values' gradients to the
/// top-k attention's in place, then each valid query's row of the centroids' gradient, times
/// `scale` and its cluster's inverse count, added to its gradient: no gradient tensor of the
/// keys, values or queries is made twice and summed. Falls back to the default body when an
/// input is not `f32`, `f16` or `bf16`, or the forward pass has no log-sum-exps.
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_backward<B: HostAccess + super::ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: super::QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    forward: super::ImprovedForward<B>,
    grad: FloatTensor<B>,
) -> super::AttentionGrads<B> {
    let attention = &forward.centroid_attention;
    let floats = [
        &queries,
        &keys,
        &values,
        &grad,
        &clusters.inverse_counts,
        &forward.centroids,
        &forward.mass,
        &attention.values,
    ];
    let host = floats.iter().all(|x| on_host::<B>(x))
        && attention.top.as_ref().is_some_and(|(_, w)| on_host::<B>(w))
        && attention
            .log_sum_exp
            .as_ref()
            .is_some_and(|x| on_host::<B>(x));
    let empty = [&queries, &keys, &values]
        .iter()
        .any(|x| x.shape().num_elements() == 0);
    if !host || empty {
        return reference::improved_attention_backward::<B>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            forward,
            grad,
        );
    }
    let (device, dtype) = (B::float_device(&queries), queries.dtype());
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    let num_clusters = reference::check_query_clusters([batch, heads, len, dim], &clusters);
    let super::ImprovedForward {
        centroids,
        centroid_attention,
        mass,
    } = forward;
    let (top, top_weights) = centroid_attention.top.clone().expect("checked above");
    let top_shape = dims::<B, 4>(&top_weights);
    let mut g = top_backward_buffers::<B>(
        queries,
        keys.clone(),
        values.clone(),
        super::ClusterTop {
            assignments: clusters.assignments.clone(),
            topk: top,
            mass,
            rest: centroid_attention.values.clone(),
        },
        key_lengths.clone(),
        scale,
        grad,
    );
    // m̂ is the sum of the top-k weights: each weight gets the mass's gradient.
    let k = top_shape[3];
    let grad_top: Vec<f32> = g
        .mass
        .iter()
        .flat_map(|&m| std::iter::repeat_n(m, k))
        .collect();
    let grad_rest = std::mem::take(&mut g.rest);
    let grad_centroids = centroid_backward_into::<B>(
        [centroids, keys, values],
        key_lengths,
        centroid_attention,
        write_float::<B, 4>(
            grad_rest,
            [batch, heads, num_clusters, dim_v],
            &device,
            dtype,
        ),
        Some(write_float::<B, 4>(grad_top, top_shape, &device, dtype)),
        (&mut g.keys, &mut g.values),
    );
    // Each query's share of its cluster's centroid: scale / count of the centroid's gradient.
    let assignments = B::ints_to_vec(clusters.assignments);
    B::with_f32(&clusters.inverse_counts, |inverse_counts| {
        for_each_row(&mut g.queries, batch * heads, len * dim, |bh, dq| {
            let assignments = &assignments[bh * len..(bh + 1) * len];
            let grad_centroids = &grad_centroids[bh * num_clusters * dim..][..num_clusters * dim];
            let inverse_counts = &inverse_counts[bh * num_clusters..(bh + 1) * num_clusters];
            for (row, &a) in dq.chunks_exact_mut(dim).zip(assignments) {
                if a == NO_CLUSTER {
                    continue;
                }
                let a = a as usize;
                let factor = inverse_counts[a] * scale as f32;
                for (o, &x) in row.iter_mut().zip(&grad_centroids[a * dim..(a + 1) * dim]) {
                    *o += factor * x;
                }
            }
        })
    });
    super::AttentionGrads {
        queries: write_float::<B, 4>(g.queries, [batch, heads, len, dim], &device, dtype),
        keys: write_float::<B, 4>(g.keys, [batch, heads, keys_len, dim], &device, dtype),
        values: write_float::<B, 4>(g.values, [batch, heads, keys_len, dim_v], &device, dtype),
    }
}

/// The host top-k attention backward's gradients as `f32` buffers, in row-major order: of the
/// queries `[batch, heads, L, E]`, keys `[batch, heads, S, E]`, values `[batch, heads, S, D]`,
/// mass `[batch, heads, C, 1]` and rest `[batch, heads, C, D]`.
struct TopGradBuffers {
    queries: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    mass: Vec<f32>,
    rest: Vec<f32>,
}

/// The body of [`top_attention_backward`] once its inputs are known to be on the host.
fn top_backward_buffers<B: HostAccess + super::ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: super::ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    grad: FloatTensor<B>,
) -> TopGradBuffers {
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    reference::check_top_attention(
        [batch, heads, len, dim],
        dims::<B, 4>(&keys),
        [batch, heads, keys_len, dim_v],
        clusters.assignments.shape().dims(),
        clusters.topk.shape().dims(),
        dims::<B, 4>(&clusters.mass),
        dims::<B, 4>(&clusters.rest),
    );
    assert!(
        dims::<B, 4>(&grad) == [batch, heads, len, dim_v],
        "grad {:?} must be [batch, heads, L, D] = {:?}",
        dims::<B, 4>(&grad),
        [batch, heads, len, dim_v]
    );
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    let sparse = Sparse::read::<B>(clusters.topk, clusters.assignments);
    sparse.check(keys_len);
    let (k, num_clusters, rows) = (sparse.k, sparse.clusters, sparse.rows());
    let (ep, dp) = (padded(dim), padded(dim_v));
    let mut grad_queries = vec![0f32; rows * len * dim];
    let mut grad_keys = vec![0f32; rows * keys_len * dim];
    let mut grad_values = vec![0f32; rows * keys_len * dim_v];
    let mut grad_mass = vec![0f32; rows * num_clusters];
    let mut grad_rest = vec![0f32; rows * num_clusters * dim_v];
    let members: Vec<Members> = (0..rows)
        .into_par_iter()
        .map(|row| sparse.members(row))
        .collect();
    let most = |row: usize, clusters: std::ops::Range<usize>| {
        clusters
            .map(|j| members[row].of(j).len().min(MEMBER_CHUNK))
            .max()
            .unwrap_or(0)
    };
    B::with_f32(&queries, |queries| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                B::with_f32(&clusters.mass, |mass| {
                    B::with_f32(&grad, |grad| {
                        let head = |row: usize| TopHead {
                            sparse: &sparse,
                            row,
                            valid: lengths[row / heads],
                            scale: scale as f32,
                            mass: &mass[row * num_clusters..(row + 1) * num_clusters],
                            queries: &queries[row * len * dim..(row + 1) * len * dim],
                            grad: &grad[row * len * dim_v..(row + 1) * len * dim_v],
                            keys: &keys[row * keys_len * dim..(row + 1) * keys_len * dim],
                            values: &values[row * keys_len * dim_v..(row + 1) * keys_len * dim_v],
                            dim,
                            dim_v,
                        };
                        // A whole head per task: the gradients go straight to their rows.
                        let work = |(row, ((dq, dk), (dv, (dm, dr)))): (usize, GradRows)| {
                            let head = head(row);
                            let mut s = TopScratch::new(k, dim, dim_v, most(row, 0..num_clusters));
                            for j in 0..num_clusters {
                                let members = members[row].of(j);
                                if members.is_empty() {
                                    continue;
                                }
                                sparse.prefetch_top(row, j + 1, dk, dim);
                                sparse.prefetch_top(row, j + 1, dv, dim_v);
                                dm[j] = head.cluster(j, members, &mut s, |run, rows| {
                                    let rows = rows.chunks_exact(dim);
                                    for (m, (&i, g)) in run.iter().zip(rows).enumerate() {
                                        prefetch_ahead(dq, dim, run, m);
                                        let i = i as usize;
                                        dq[i * dim..(i + 1) * dim].copy_from_slice(g);
                                    }
                                });
                                let top = sparse.top(row, j);
                                add_block_rows(&s.grad_keys, top, dim, dk);
                                add_block_rows(&s.grad_values, top, dim_v, dv);
                                dr[j * dim_v..(j + 1) * dim_v].copy_from_slice(&s.grad_rest);
                            }
                        };
                        let cost = len * k * (3 * dim + 2 * dim_v);
                        let splits = if rows * cost < PARALLEL_THRESHOLD {
                            1
                        } else {
                            head_splits(rows, len, 1024)
                        };
                        if splits == 1 {
                            let parts: Vec<_> = grad_queries
                                .chunks_mut(len * dim)
                                .zip(grad_keys.chunks_mut(keys_len * dim))
                                .zip(
                                    grad_values.chunks_mut(keys_len * dim_v).zip(
                                        grad_mass
                                            .chunks_mut(num_clusters)
                                            .zip(grad_rest.chunks_mut(num_clusters * dim_v)),
                                    ),
                                )
                                .enumerate()
                                .collect();
                            if rows == 1 || rows * cost < PARALLEL_THRESHOLD {
                                parts.into_iter().for_each(work);
                            } else {
                                parts.into_par_iter().for_each(work);
                            }
                            return;
                        }
                        // A run of a head's clusters per task: its queries' gradient rows in
                        // place, the rest into its part.
                        let dq = DisjointRows::new(&mut grad_queries, dim);
                        let part_work = |part: &mut TopPart| {
                            let (row, clusters) = (part.row, part.clusters.clone());
                            let head = head(row);
                            let s = &mut part.scratch;
                            for j in clusters {
                                let members = members[row].of(j);
                                let grad_mass = if members.is_empty() {
                                    s.grad_keys.fill(0.0);
                                    s.grad_values.fill(0.0);
                                    s.grad_rest.fill(0.0);
                                    0.0
                                } else {
                                    head.cluster(j, members, s, |run, rows| {
                                        for (&i, g) in run.iter().zip(rows.chunks_exact(dim)) {
                                            let i = row * len + i as usize;
                                            // SAFETY: query i is a member of cluster j only,
                                            // and no other task has cluster j.
                                            unsafe { dq.row(i) }.copy_from_slice(g);
                                        }
                                    })
                                };
                                part.mass.push(grad_mass);
                                part.keys.extend_from_slice(&s.grad_keys);
                                part.values.extend_from_slice(&s.grad_values);
                                part.rest.extend_from_slice(&s.grad_rest);
                            }
                        };
                        let mut parts: Vec<TopPart> = (0..rows)
                            .flat_map(|row| {
                                cluster_runs(&members[row], num_clusters, splits)
                                    .into_iter()
                                    .map(move |clusters| {
                                        let c = clusters.len();
                                        TopPart {
                                            row,
                                            scratch: TopScratch::new(
                                                k,
                                                dim,
                                                dim_v,
                                                most(row, clusters.clone()),
                                            ),
                                            clusters,
                                            keys: Vec::with_capacity(c * k * ep),
                                            values: Vec::with_capacity(c * k * dp),
                                            mass: Vec::with_capacity(c),
                                            rest: Vec::with_capacity(c * dim_v),
                                        }
                                    })
                            })
                            .collect();
                        parts.par_iter_mut().for_each(part_work);
                        // Each head's key and value blocks added in cluster order (and its
                        // mass and rest gradients put in place), heads in parallel.
                        let outs: Vec<_> = grad_keys
                            .chunks_mut(keys_len * dim)
                            .zip(grad_values.chunks_mut(keys_len * dim_v))
                            .zip(
                                grad_mass
                                    .chunks_mut(num_clusters)
                                    .zip(grad_rest.chunks_mut(num_clusters * dim_v)),
                            )
                            .enumerate()
                            .collect();
                        outs.into_par_iter()
                            .for_each(|(row, ((dk, dv), (dm, dr)))| {
                                for part in parts.iter().filter(|p| p.row == row) {
                                    for (c, j) in part.clusters.clone().enumerate() {
                                        if members[row].of(j).is_empty() {
                                            continue;
                                        }
                                        let top = sparse.top(row, j);
                                        let key_block = &part.keys[c * k * ep..(c + 1) * k * ep];
                                        let value_block =
                                            &part.values[c * k * dp..(c + 1) * k * dp];
                                        add_block_rows(key_block, top, dim, dk);
                                        add_block_rows(value_block, top, dim_v, dv);
                                        dm[j] = part.mass[c];
                                        dr[j * dim_v..(j + 1) * dim_v].copy_from_slice(
                                            &part.rest[c * dim_v..(c + 1) * dim_v],
                                        );
                                    }
                                }
                            });
                    })
                })
            })
        })
    });
    TopGradBuffers {
        queries: grad_queries,
        keys: grad_keys,
        values: grad_values,
        mass: grad_mass,
        rest: grad_rest,
    }
}

/// Up to `splits` runs of consecutive clusters covering `0..clusters`, none empty (but the one
/// run of no clusters), with about as many `members` each.
fn cluster_runs(members: &Members, clusters: usize, splits: usize) -> Vec<std::ops::Range<usize>> {
    let total = members.start[clusters];
    let mut runs = Vec::with_capacity(splits);
    let mut first = 0;
    for p in 1..splits {
        // The first cluster that starts at or past this run's share of the members.
        let end = (first..clusters)
            .find(|&j| members.start[j] * splits >= p * total)
            .unwrap_or(clusters);
        if end > first {
            runs.push(first..end);
            first = end;
        }
    }
    if first < clusters || runs.is_empty() {
        runs.push(first..clusters);
    }
    runs
}

/// Host [`ClusteringBackend::sparse_scatter`](super::ClusteringBackend::sparse_scatter).
pub fn sparse_scatter<B: HostAccess>(
    weights: FloatTensor<B>,
    x: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
    keys_len: usize,
) -> FloatTensor<B> {
    if !on_host::<B>(&weights) || !on_host::<B>(&x) {
        return reference::sparse_scatter::<B>(weights, x, topk, assignments, keys_len);
    }
    let (device, dtype) = (B::float_device(&weights), weights.dtype());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: a fixed stream of test codes.
    fn codes(n: usize, seed: u64, mask: u32) -> Vec<u32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as u32 & mask
            })
            .collect()
    }

    /// The table assignment picks the same centroid as a scan of popcounts with ties to the
    /// lowest index, for cluster counts around the 16-column padding and at the table's limit,
    /// with full 32-bit codes and with codes of 3 bits (many exact ties, repeated centroids).
    #[test]
    fn nearest_table_matches_popcount_scan() {
        for clusters in [1, 2, 15, 16, 17, 100, TABLE_CLUSTERS] {
            for (seed, mask) in [(1, u32::MAX), (2, 0b111), (3, 0xF0F0_0F0F)] {
                let codes = codes(2000, seed + clusters as u64, mask);
                let centroids = self::codes(clusters, seed + 99, mask);
                let expected: Vec<u32> = codes
                    .iter()
                    .map(|&x| {
                        (0..clusters)
                            .min_by_key(|&j| ((x ^ centroids[j]).count_ones(), j))
                            .unwrap() as u32
                    })
                    .collect();
                let mut table = Some(NearestTable::new(clusters));
                let mut out = vec![u32::MAX; codes.len()];
                assign_all(&mut table, &codes, &centroids, &mut out);
                assert_eq!(out, expected, "table, clusters {clusters}, mask {mask:#x}");
                assign_all(&mut None, &codes, &centroids, &mut out);
                assert_eq!(out, expected, "scan, clusters {clusters}, mask {mask:#x}");
            }
        }
    }
}
