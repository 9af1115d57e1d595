//! The sparse top-k products of improved clustered attention (paper eqs. 10–11) and their
//! transpose; see [`ClusteredAttentionBackend`](crate::ClusteredAttentionBackend) for the
//! definitions.
//!
//! `sparse_dot` and `sparse_weighted_sum` give one unit per output element. The transpose,
//! `sparse_scatter`, is a sum over the queries of each cluster: it first sorts the queries by
//! cluster (a stable counting sort: per-chunk histograms with shared-memory integer atomics,
//! one scan, then each query's rank within its chunk), sums each cluster's products
//! `weights[i, r] · x[i]` per top-k slot `r`, and finally gathers, for every key, the slots
//! that hold it through an inverted top-k table. No float atomics: the result is
//! deterministic. Products and sums accumulate in `f32`.
//!
//! All tensors are contiguous; `bh` below is the flattened `(batch, head)` index.

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, full_device_dtype};
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{cube_count, linear};

/// Flat index of this unit in a grid laid out by [`super::cube_count`] (Z ignored).
#[cube]
fn unit_index() -> usize {
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    cube * CUBE_DIM_X as usize + UNIT_POS_X as usize
}

/// `output[bh, i, r] = queries[bh, i] · keys[bh, topk[bh, a_i, r]]`, zero when `a_i < 0`.
/// Each unit computes `width` consecutive slots `r` (`width` divides `k`), reading each query
/// entry once for all of them.
///
/// - `queries`: `[B, H, L, E]`, `keys`: `[B, H, S, E]`
/// - `topk`: `[B, H, C, k]`, `assignments`: `[B, H, L]`
/// - `output`: `[B, H, L, k]`
#[cube(launch, create_dummy_kernel)]
fn sparse_dot_kernel<F: Float, I: Int>(
    queries: &Tensor<F>,
    keys: &Tensor<F>,
    topk: &Tensor<I>,
    assignments: &Tensor<I>,
    output: &mut Tensor<F>,
    #[comptime] width: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let id = unit_index();
    if id * width >= output.len() {
        terminate!();
    }
    let (len, dim) = (queries.shape(2), queries.shape(3));
    let keys_len = keys.shape(2);
    let (clusters, k) = (topk.shape(2), topk.shape(3));
    let first = (id * width) % k;
    let row = (id * width) / k;
    let bh = row / len;
    let cluster = i32::cast_from(assignments[row]);
    let mut sums = Array::<f32>::new(width);
    #[unroll]
    for w in 0..width {
        sums[w] = 0.0f32;
    }
    if cluster >= 0 {
        let slots = (bh * clusters + u32::cast_from(cluster) as usize) * k + first;
        let mut key_bases = Array::<usize>::new(width);
        #[unroll]
        for w in 0..width {
            key_bases[w] = (bh * keys_len + u32::cast_from(topk[slots + w]) as usize) * dim;
        }
        let query_base = row * dim;
        for e in 0..dim {
            let query = f32::cast_from(queries[query_base + e]);
            #[unroll]
            for w in 0..width {
                sums[w] += query * f32::cast_from(keys[key_bases[w] + e]);
            }
        }
    }
    #[unroll]
    for w in 0..width {
        output[id * width + w] = F::cast_from(sums[w]);
    }
}

/// `output[bh, i] = Σ_r weights[bh, i, r] · values[bh, topk[bh, a_i, r]]`, zero when `a_i < 0`.
/// Each unit computes `width` consecutive features (`width` divides `D`).
///
/// - `weights`: `[B, H, L, k]`, `values`: `[B, H, S, D]`
/// - `topk`: `[B, H, C, k]`, `assignments`: `[B, H, L]`
/// - `output`: `[B, H, L, D]`
#[cube(launch, create_dummy_kernel)]
fn sparse_weighted_sum_kernel<F: Float, I: Int>(
    weights: &Tensor<F>,
    values: &Tensor<F>,
    topk: &Tensor<I>,
    assignments: &Tensor<I>,
    output: &mut Tensor<F>,
    #[comptime] width: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let id = unit_index();
    if id * width >= output.len() {
        terminate!();
    }
    let len = weights.shape(2);
    let (keys_len, dim) = (values.shape(2), values.shape(3));
    let (clusters, k) = (topk.shape(2), topk.shape(3));
    let first = (id * width) % dim;
    let row = (id * width) / dim;
    let bh = row / len;
    let cluster = i32::cast_from(assignments[row]);
    let mut sums = Array::<f32>::new(width);
    #[unroll]
    for w in 0..width {
        sums[w] = 0.0f32;
    }
    if cluster >= 0 {
        let slots = (bh * clusters + u32::cast_from(cluster) as usize) * k;
        for r in 0..k {
            let key = u32::cast_from(topk[slots + r]) as usize;
            let weight = f32::cast_from(weights[row * k + r]);
            let base = (bh * keys_len + key) * dim + first;
            #[unroll]
            for w in 0..width {
                sums[w] += weight * f32::cast_from(values[base + w]);
            }
        }
    }
    #[unroll]
    for w in 0..width {
        output[id * width + w] = F::cast_from(sums[w]);
    }
}

/// Counting sort, step 1: `chunk_counts[bh, chunk, c]` = the queries of chunk `chunk` (of
/// `CUBE_DIM_X` queries) in cluster `c`, counted with shared-memory atomics.
///
/// Grid: X (folded into Y) over chunks, Z over `bh`.
/// - `assignments`: `[bh, L]`; `chunk_counts`: `[bh, chunks, clusters]`
#[cube(launch, create_dummy_kernel)]
fn cluster_histogram_kernel<I: Int>(
    assignments: &Tensor<I>,
    chunk_counts: &mut Tensor<u32>,
    #[comptime] clusters: usize,
    #[define(I)] _dtype: ElemType,
) {
    let len = assignments.shape(1);
    let chunks = chunk_counts.shape(1);
    let bh = CUBE_POS_Z as usize;
    let chunk = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let unit = UNIT_POS_X as usize;
    let threads = CUBE_DIM_X as usize;
    if chunk >= chunks {
        terminate!();
    }
    let counts = Shared::<[Atomic<u32>]>::new_slice(clusters);
    let mut c = unit;
    while c < clusters {
        counts[c].store(0u32);
        c += threads;
    }
    sync_cube();
    let i = chunk * threads + unit;
    if i < len {
        let cluster = i32::cast_from(assignments[bh * len + i]);
        if cluster >= 0 {
            counts[u32::cast_from(cluster) as usize].fetch_add(1u32);
        }
    }
    sync_cube();
    let mut c = unit;
    while c < clusters {
        chunk_counts[(bh * chunks + chunk) * clusters + c] = counts[c].load();
        c += threads;
    }
}

/// Counting sort, step 2, one cube per `bh`: turns `chunk_counts` into the position where each
/// chunk's members of each cluster start (`chunk_counts` is overwritten), and writes the
/// cluster boundaries `starts[bh, c] .. starts[bh, c + 1]` of the sorted order.
///
/// - `chunk_counts`: `[bh, chunks, clusters]`; `starts`: `[bh, clusters + 1]`
#[cube(launch, create_dummy_kernel)]
fn cluster_offsets_kernel(
    chunk_counts: &mut Tensor<u32>,
    starts: &mut Tensor<u32>,
    #[comptime] clusters: usize,
) {
    let chunks = chunk_counts.shape(1);
    let bh = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let threads = CUBE_DIM_X as usize;
    let base = bh * chunks * clusters;
    let mut totals = Shared::<[u32]>::new_slice(clusters + 1);
    // Exclusive scan over the chunks, one cluster per unit.
    let mut c = unit;
    while c < clusters {
        let mut running = 0u32;
        for chunk in 0..chunks {
            let at = base + chunk * clusters + c;
            let count = chunk_counts[at];
            chunk_counts[at] = running;
            running += count;
        }
        totals[c] = running;
        c += threads;
    }
    sync_cube();
    // Exclusive scan over the clusters (few: one unit).
    if unit == 0 {
        let mut running = 0u32;
        for c in 0..clusters {
            let count = totals[c];
            totals[c] = running;
            starts[bh * (clusters + 1) + c] = running;
            running += count;
        }
        totals[clusters] = running;
        starts[bh * (clusters + 1) + clusters] = running;
    }
    sync_cube();
    let mut c = unit;
    while c < clusters {
        for chunk in 0..chunks {
            let at = base + chunk * clusters + c;
            chunk_counts[at] += totals[c];
        }
        c += threads;
    }
}

/// Counting sort, step 3: `order[bh, p]` = the query at position `p` of the order sorted by
/// cluster, then by position (stable). A query's place is its chunk's start for its cluster
/// plus the number of earlier queries of the chunk in the same cluster.
///
/// Grid as [`cluster_histogram_kernel`], with the same cube size.
/// - `assignments`, `order`: `[bh, L]`; `chunk_offsets`: `[bh, chunks, clusters]`
#[cube(launch, create_dummy_kernel)]
fn cluster_order_kernel<I: Int>(
    assignments: &Tensor<I>,
    chunk_offsets: &Tensor<u32>,
    order: &mut Tensor<u32>,
    #[comptime] cube_size: usize,
    #[define(I)] _dtype: ElemType,
) {
    let len = assignments.shape(1);
    let (chunks, clusters) = (chunk_offsets.shape(1), chunk_offsets.shape(2));
    let bh = CUBE_POS_Z as usize;
    let chunk = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let unit = UNIT_POS_X as usize;
    if chunk >= chunks {
        terminate!();
    }
    let mut local = Shared::<[i32]>::new_slice(cube_size);
    let i = chunk * cube_size + unit;
    let mut cluster = i32::new(-1);
    if i < len {
        cluster = i32::cast_from(assignments[bh * len + i]);
    }
    local[unit] = cluster;
    sync_cube();
    if cluster >= 0 {
        let mut rank = 0u32;
        for t in 0..unit {
            if local[t] == cluster {
                rank += 1u32;
            }
        }
        let c = u32::cast_from(cluster) as usize;
        let place = chunk_offsets[(bh * chunks + chunk) * clusters + c] + rank;
        order[bh * len + place as usize] = i as u32;
    }
}

/// `slot_sums[bh, c, r, f] = Σ_{i in cluster c} weights[bh, i, r] · x[bh, i, f]`, summing the
/// cluster's queries in the sorted order.
///
/// - `weights`: `[B, H, L, k]`, `x`: `[B, H, L, F]`
/// - `order`: `[bh, L]`, `starts`: `[bh, clusters + 1]`
/// - `slot_sums`: `[bh, clusters, k, F]`
#[cube(launch, create_dummy_kernel)]
fn cluster_slot_sums_kernel<F: Float>(
    weights: &Tensor<F>,
    x: &Tensor<F>,
    order: &Tensor<u32>,
    starts: &Tensor<u32>,
    slot_sums: &mut Tensor<f32>,
    #[define(F)] _dtype: ElemType,
) {
    let id = unit_index();
    if id >= slot_sums.len() {
        terminate!();
    }
    let (clusters, k, features) = (slot_sums.shape(1), slot_sums.shape(2), slot_sums.shape(3));
    let len = weights.shape(2);
    let f = id % features;
    let r = (id / features) % k;
    let c = (id / (features * k)) % clusters;
    let bh = id / (features * k * clusters);
    let bounds = bh * (clusters + 1) + c;
    let (start, end) = (starts[bounds] as usize, starts[bounds + 1] as usize);
    let mut sum = 0.0f32;
    for p in start..end {
        let row = bh * len + order[bh * len + p] as usize;
        sum += f32::cast_from(weights[row * k + r]) * f32::cast_from(x[row * features + f]);
    }
    slot_sums[id] = sum;
}

/// Inverts the top-k table: `slots[bh, c, topk[bh, c, r]] = r` (the other entries must hold
/// `-1`). The keys of a cluster's top-k are distinct.
///
/// - `topk`: `[B, H, C, k]`; `slots`: `[bh, C, keys_len]`
#[cube(launch, create_dummy_kernel)]
fn invert_topk_kernel<I: Int>(
    topk: &Tensor<I>,
    slots: &mut Tensor<i32>,
    #[define(I)] _dtype: ElemType,
) {
    let id = unit_index();
    if id >= topk.len() {
        terminate!();
    }
    let keys_len = slots.shape(2);
    let k = topk.shape(3);
    let r = id % k;
    let cluster_row = id / k;
    let key = u32::cast_from(topk[id]) as usize;
    slots[cluster_row * keys_len + key] = r as i32;
}

/// `output[bh, l, f] = Σ_{c : slots[bh, c, l] = r ≥ 0} slot_sums[bh, c, r, f]`: one unit per
/// key, clusters in increasing order.
///
/// - `slots`: `[bh, C, keys_len]`; `slot_sums`: `[bh, C, k, F]`
/// - `output`: `[B, H, keys_len, F]`
#[cube(launch, create_dummy_kernel)]
fn gather_slot_sums_kernel<F: Float>(
    slots: &Tensor<i32>,
    slot_sums: &Tensor<f32>,
    output: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let (clusters, keys_len) = (slots.shape(1), slots.shape(2));
    let (k, features) = (slot_sums.shape(2), slot_sums.shape(3));
    let id = unit_index();
    if id >= slots.shape(0) * keys_len {
        terminate!();
    }
    let l = id % keys_len;
    let bh = id / keys_len;
    let out_base = id * features;
    // Summed in f32 (the slot sums are f32), rounded to the output dtype once.
    for f in 0..features {
        let mut sum = 0.0f32;
        for c in 0..clusters {
            let r = slots[(bh * clusters + c) * keys_len + l];
            if r >= 0 {
                sum += slot_sums[((bh * clusters + c) * k + r as usize) * features + f];
            }
        }
        output[out_base + f] = F::cast_from(sum);
    }
}

/// Outputs per unit of the sparse products along a dimension of size `n`: 4 when it divides
/// `n` (each loaded index and weight then serves four products), else 1.
fn width(n: usize) -> usize {
    if n.is_multiple_of(4) { 4 } else { 1 }
}

/// Threads per cube of the element-wise sparse kernels.
const SPARSE_THREADS: usize = 256;

/// Checks the index tensors of a sparse product against the float operands.
///
/// # Panics
/// If `topk` is not `[batch, heads, C, k]`, `assignments` is not `[batch, heads, rows]`, or
/// the two have different dtypes.
fn check_indices(
    topk: &CubeTensor,
    assignments: &CubeTensor,
    batch_heads: [usize; 2],
    rows: usize,
) -> [usize; 2] {
    let [batch, heads, clusters, k] = topk.shape().dims();
    let assignment_dims: [usize; 3] = assignments.shape().dims();
    assert!(
        [batch, heads] == batch_heads && assignment_dims == [batch, heads, rows],
        "topk {:?} and assignments {:?} must be [{}, {}, C, k] and [{}, {}, {rows}]",
        topk.shape().dims::<4>(),
        assignment_dims,
        batch_heads[0],
        batch_heads[1],
        batch_heads[0],
        batch_heads[1],
    );
    assert_eq!(
        topk.dtype, assignments.dtype,
        "topk and assignments must share an int dtype"
    );
    [clusters, k]
}

/// The launch of [`sparse_dot_kernel`] or [`sparse_weighted_sum_kernel`]: the two operands,
/// `topk`, `assignments` and the output, then the outputs per unit and the dtypes.
type SparseLaunch = fn(&Client, CubeCount, CubeDim, [TensorArg; 5], usize, [ElemType; 2]);

/// Launches one of the two sparse products whose output is `[batch, heads, L, last]`, `last`
/// being `k` for `sparse_dot` and `D` for `sparse_weighted_sum`.
fn sparse_product(
    launch: SparseLaunch,
    first: CubeTensor,
    second: CubeTensor,
    topk: CubeTensor,
    assignments: CubeTensor,
    last: usize,
) -> CubeTensor {
    let [batch, heads, len, _] = first.shape().dims();
    check_indices(&topk, &assignments, [batch, heads], len);
    let (float_dtype, int_dtype) = (first.dtype, topk.dtype);
    let client = first.client.clone();
    let output = empty_device_contiguous_dtype(
        client.clone(),
        first.device.clone(),
        Shape::new([batch, heads, len, last]),
        float_dtype,
    );
    let width = width(last);
    let units = batch * heads * len * last / width;
    let [first, second, topk, assignments] =
        [first, second, topk, assignments].map(|x| linear(into_contiguous(x)));
    launch(
        &client,
        cube_count(units.div_ceil(SPARSE_THREADS), 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        [first, second, topk, assignments, linear(output.clone())],
        width,
        [
            dtype_to_storage_type(float_dtype),
            dtype_to_storage_type(int_dtype),
        ],
    );
    output
}

/// Launches [`sparse_dot_kernel`].
pub(super) fn sparse_dot(
    queries: CubeTensor,
    keys: CubeTensor,
    topk: CubeTensor,
    assignments: CubeTensor,
) -> CubeTensor {
    let k = topk.shape()[3];
    let launch: SparseLaunch = |client, count, dim, [q, k, t, a, o], width, dtypes| {
        launch!(sparse_dot_kernel(
            client, count, dim, q, k, t, a, o, width, dtypes
        ))
    };
    sparse_product(launch, queries, keys, topk, assignments, k)
}

/// Launches [`sparse_weighted_sum_kernel`].
pub(super) fn sparse_weighted_sum(
    weights: CubeTensor,
    values: CubeTensor,
    topk: CubeTensor,
    assignments: CubeTensor,
) -> CubeTensor {
    let dim = values.shape()[3];
    let launch: SparseLaunch = |client, count, dim, [w, v, t, a, o], width, dtypes| {
        launch!(sparse_weighted_sum_kernel(
            client, count, dim, w, v, t, a, o, width, dtypes
        ))
    };
    sparse_product(launch, weights, values, topk, assignments, dim)
}

/// Most clusters the counting sort of [`sparse_scatter`] handles in shared memory (16 KiB);
/// beyond, the default body runs (chosen where the op is registered with Fusion).
pub(super) const SORT_CLUSTERS: usize = 4095;

/// The counting sort of the queries by cluster (stable): `order [bh, L]`, the queries sorted
/// by cluster, then by position, and `starts [bh, clusters + 1]`, where each cluster's run of
/// `order` begins (padded queries, at cluster `-1`, are left out). Three launches.
///
/// `assignments` is `[batch, heads, L]`, contiguous; `clusters` at most [`SORT_CLUSTERS`].
pub(super) fn sort_by_cluster(
    assignments: CubeTensor,
    clusters: usize,
) -> (CubeTensor, CubeTensor) {
    let [batch, heads, len] = assignments.shape().dims();
    let bh = batch * heads;
    let (client, device) = (assignments.client.clone(), assignments.device.clone());
    let int_dtype = assignments.dtype;
    let u32_tensor = |dims: Vec<usize>| {
        empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::from(dims),
            DType::U32,
        )
    };
    let assignments = reshape(assignments, Shape::new([bh, len]));
    let chunks = len.div_ceil(SPARSE_THREADS);
    let offsets = u32_tensor(vec![bh, chunks, clusters]);
    let starts = u32_tensor(vec![bh, clusters + 1]);
    let order = u32_tensor(vec![bh, len]);
    launch!(cluster_histogram_kernel(
        &client,
        cube_count(chunks, bh),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(assignments.clone()),
        linear(offsets.clone()),
        clusters,
        dtype_to_storage_type(int_dtype),
    ));
    launch!(cluster_offsets_kernel(
        &client,
        CubeCount::Static(bh as u32, 1, 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(offsets.clone()),
        linear(starts.clone()),
        clusters,
    ));
    launch!(cluster_order_kernel(
        &client,
        cube_count(chunks, bh),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(assignments),
        linear(offsets),
        linear(order.clone()),
        SPARSE_THREADS,
        dtype_to_storage_type(int_dtype),
    ));
    (order, starts)
}

/// Sorts the queries by cluster and sums each cluster's products per top-k slot, then gathers
/// the slots of every key (see the module documentation). Takes at most [`SORT_CLUSTERS`]
/// clusters: beyond, the caller runs the default body.
///
/// # Panics
/// As [`check_indices`], and if `topk` has more than [`SORT_CLUSTERS`] clusters.
pub(super) fn sparse_scatter(
    weights: CubeTensor,
    x: CubeTensor,
    topk: CubeTensor,
    assignments: CubeTensor,
    keys_len: usize,
) -> CubeTensor {
    let [batch, heads, len, _] = weights.shape().dims();
    let [_, _, _, features] = x.shape().dims();
    let [clusters, k] = check_indices(&topk, &assignments, [batch, heads], len);
    assert!(
        clusters <= SORT_CLUSTERS,
        "the counting sort takes at most {SORT_CLUSTERS} clusters, got {clusters}"
    );
    let (float_dtype, int_dtype) = (weights.dtype, topk.dtype);
    let (client, device) = (weights.client.clone(), weights.device.clone());
    let bh = batch * heads;
    let (order, starts) = sort_by_cluster(into_contiguous(assignments), clusters);

    // Per cluster and slot, the sum of its queries' products, kept in f32 until the last sum.
    let slot_sums = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([bh, clusters, k, features]),
        DType::F32,
    );
    let units = bh * clusters * k * features;
    launch!(cluster_slot_sums_kernel(
        &client,
        cube_count(units.div_ceil(SPARSE_THREADS), 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(into_contiguous(weights)),
        linear(into_contiguous(x)),
        linear(order),
        linear(starts),
        linear(slot_sums.clone()),
        dtype_to_storage_type(float_dtype),
    ));

    // For every key, the slots that hold it, then the sum of their slot sums.
    let slots = into_contiguous(full_device_dtype(
        client.clone(),
        Shape::new([bh, clusters, keys_len]),
        device.clone(),
        InputScalar::new(-1i32, dtype_to_storage_type(DType::I32)),
        DType::I32,
    ));
    let topk = into_contiguous(topk);
    launch!(invert_topk_kernel(
        &client,
        cube_count((bh * clusters * k).div_ceil(SPARSE_THREADS), 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(topk),
        linear(slots.clone()),
        dtype_to_storage_type(int_dtype),
    ));
    let output = empty_device_contiguous_dtype(
        client.clone(),
        device,
        Shape::new([batch, heads, keys_len, features]),
        float_dtype,
    );
    launch!(gather_slot_sums_kernel(
        &client,
        cube_count((bh * keys_len).div_ceil(SPARSE_THREADS), 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(slots),
        linear(slot_sums),
        linear(output.clone()),
        dtype_to_storage_type(float_dtype),
    ));
    output
}
