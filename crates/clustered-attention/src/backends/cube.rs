//! [`CubeBackend`] (WGPU, Vulkan, CUDA without fusion): hashing, K-means, the top-k and the
//! sparse products as CubeCL kernels ([`crate::kernels`]). Nothing is read back to the host
//! but the query lengths, when given (the initial centroids are drawn on the host).
//!
//! The kernels index every buffer linearly, so each one they read or write is contiguous:
//! inputs go through `into_contiguous`, and outputs and scratch buffers are allocated with
//! `empty_device_contiguous_dtype`. Burn's default allocation (`empty_device_dtype`) may pad
//! each row: on CUDA, cubecl-runtime's `PitchedMemoryLayoutPolicy` rounds a row's bytes up to
//! a multiple of a power of two between 16 and 512, and a linear write then lands partly in the
//! padding and partly in the wrong rows.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Shape, Tensor, TensorData, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::ClusteringBackend;
use crate::kernels::cube_count;
use crate::kernels::hash::lsh_hash_kernel;
use crate::kernels::kmeans::{
    SHARED_CENTROIDS, SHARED_VOTES, VOTES, kmeans_assign_kernel, kmeans_update_kernel,
    kmeans_votes_kernel,
};
use crate::kernels::sparse::{
    cluster_histogram_kernel, cluster_offsets_kernel, cluster_order_kernel,
    cluster_slot_sums_kernel, gather_slot_sums_kernel, invert_topk_kernel, sparse_dot_kernel,
    sparse_weighted_sum_kernel,
};
use crate::kernels::topk::topk_kernel;
use crate::ops::reference::{check_planes, check_topk};
use crate::ops::{host_lengths, initial_centroid_positions};

impl<R, F, I, BT> ClusteringBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        lsh_hash::<R>(queries, planes, I::dtype())
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Option<IntTensor<Self>>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        hamming_kmeans::<R, F, I, BT>(codes, query_lengths, clusters, iterations, seed)
    }

    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        if k > TOPK_SHARED {
            // One sorted list of k would not fit in the merge's shared memory: the default
            // body, which sorts on the host.
            return crate::ops::reference::topk_indices::<Self>(scores, k);
        }
        topk_indices::<R>(scores, k, I::dtype())
    }

    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        sparse_dot::<R>(queries, keys, topk, assignments)
    }

    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        sparse_weighted_sum::<R>(weights, values, topk, assignments)
    }

    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        sparse_scatter::<R, F, I, BT>(weights, x, topk, assignments, keys_len)
    }
}

/// Launches [`lsh_hash_kernel`]: `queries [batch, heads, L, E]`, `planes [bits, E + 1]` →
/// codes `[batch, heads, L]` of dtype `int_dtype`.
fn lsh_hash<R: CubeRuntime>(
    queries: CubeTensor<R>,
    planes: CubeTensor<R>,
    int_dtype: DType,
) -> CubeTensor<R> {
    let [batch, heads, len, dim] = queries.shape().dims();
    let [bits, columns] = planes.shape().dims();
    check_planes([batch, heads, len, dim], [bits, columns]);
    assert_eq!(
        queries.dtype, planes.dtype,
        "queries and planes must share a dtype"
    );
    let (queries, planes) = (into_contiguous(queries), into_contiguous(planes));
    let client = queries.client.clone();
    let rows = batch * heads * len;
    let codes = empty_device_contiguous_dtype(
        client.clone(),
        queries.device.clone(),
        Shape::new([batch, heads, len]),
        int_dtype,
    );
    // Queries per cube: a power of two, at most 64, with the tile within 16 KiB of f32.
    let fit = (4096 / (dim + 1)).clamp(1, 64);
    let tile = 1usize << fit.ilog2();
    let float_dtype = queries.dtype;
    lsh_hash_kernel::launch::<R>(
        &client,
        cube_count(rows.div_ceil(tile), 1),
        CubeDim::new_1d(tile as u32),
        linear(queries),
        linear(planes),
        linear(codes.clone()),
        dim,
        tile,
        [float_dtype.into(), int_dtype.into()],
    );
    codes
}

/// `tensor` as the argument of a kernel, which indexes it linearly.
///
/// # Panics
/// If `tensor` is not contiguous (row-major, no padding): a pitched buffer, as CUDA allocates by
/// default, would be read and written at the wrong places.
fn linear<R: CubeRuntime>(tensor: CubeTensor<R>) -> TensorArg<R> {
    assert!(
        tensor.is_contiguous(),
        "a kernel argument must be contiguous, got shape {:?} with strides {:?}",
        tensor.meta.shape(),
        tensor.meta.strides(),
    );
    tensor.into_tensor_arg()
}

/// Threads per cube of the K-means kernels.
const CUBE_THREADS: usize = 256;

/// The whole Lloyd loop on the device: the host only draws the initial centroid positions
/// (and reads the query lengths, to do so), then enqueues `iterations` assignment and update
/// launches and a final assignment and count.
fn hamming_kmeans<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    codes: CubeTensor<R>,
    query_lengths: Option<CubeTensor<R>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (CubeTensor<R>, CubeTensor<R>) {
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    assert!(clusters > 0, "clusters must be at least 1, got 0");
    let [batch, heads, len] = codes.shape().dims();
    let (client, device, dtype) = (codes.client.clone(), codes.device.clone(), codes.dtype);
    let lengths = host_lengths::<B<R, F, I, BT>>(
        "query_lengths",
        query_lengths.map(Tensor::from_primitive),
        batch,
        len,
    );
    let rows = batch * heads;
    let initial = initial_centroid_positions(&lengths, heads, clusters, seed);
    let row_lengths: Vec<i64> = (0..rows).map(|r| lengths[r / heads] as i64).collect();

    let options = (&device, dtype);
    let codes = Tensor::<B<R, F, I, BT>, 3, Int>::from_primitive(into_contiguous(codes))
        .reshape([rows, len]);
    let positions = Tensor::<B<R, F, I, BT>, 2, Int>::from_data(
        TensorData::new(initial, [rows, clusters]),
        options,
    );
    let centroids = into_contiguous(codes.clone().gather(1, positions).into_primitive());
    let codes = into_contiguous(codes.into_primitive());
    let row_lengths = into_contiguous(
        Tensor::<B<R, F, I, BT>, 1, Int>::from_data(TensorData::new(row_lengths, [rows]), options)
            .into_primitive(),
    );
    let assignments = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([rows, len]),
        dtype,
    );
    let counts = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([rows, clusters]),
        dtype,
    );

    // Burn's `zeros` may pitch its rows (CUDA does); the kernels index `votes` linearly.
    let votes = into_contiguous(
        Tensor::<B<R, F, I, BT>, 2, Int>::zeros([rows, clusters * VOTES], options).into_primitive(),
    );

    let shared = clusters <= SHARED_CENTROIDS;
    let assign = || {
        kmeans_assign_kernel::launch::<R>(
            &client,
            cube_count(len.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS as u32),
            linear(codes.clone()),
            linear(centroids.clone()),
            linear(row_lengths.clone()),
            linear(assignments.clone()),
            clusters,
            shared,
            dtype.into(),
        )
    };
    let update = |update: bool| {
        kmeans_votes_kernel::launch::<R>(
            &client,
            cube_count(len.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS as u32),
            linear(codes.clone()),
            linear(assignments.clone()),
            linear(votes.clone()),
            clusters,
            clusters <= SHARED_VOTES,
            update,
            dtype.into(),
        );
        kmeans_update_kernel::launch::<R>(
            &client,
            cube_count(clusters.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS.min(clusters.next_power_of_two()) as u32),
            linear(votes.clone()),
            linear(row_lengths.clone()),
            linear(centroids.clone()),
            linear(counts.clone()),
            update,
            dtype.into(),
        )
    };
    for _ in 0..iterations {
        assign();
        update(true);
    }
    assign();
    update(false);

    let reshape = |x: CubeTensor<R>, last: usize| {
        Tensor::<B<R, F, I, BT>, 2, Int>::from_primitive(x)
            .reshape([batch, heads, last])
            .into_primitive()
    };
    (reshape(assignments, len), reshape(counts, clusters))
}

/// Most units per row of the top-k kernel.
const TOPK_UNITS: usize = 64;

/// Scores and indices the top-k kernel's merge may keep in shared memory (8 KiB).
const TOPK_SHARED: usize = 1024;

/// Outputs per unit of the sparse products along a dimension of size `n`: 4 when it divides
/// `n` (each loaded index and weight then serves four products), else 1.
fn width(n: usize) -> usize {
    if n.is_multiple_of(4) { 4 } else { 1 }
}

/// Launches [`topk_kernel`]: `scores [batch, heads, C, S]` → indices `[batch, heads, C, k]`
/// of dtype `int_dtype`, descending by score, ties to the lower index.
fn topk_indices<R: CubeRuntime>(
    scores: CubeTensor<R>,
    k: usize,
    int_dtype: DType,
) -> CubeTensor<R> {
    let [batch, heads, rows, len] = scores.shape().dims();
    check_topk(k, len);
    let scores = into_contiguous(scores);
    let client = scores.client.clone();
    let all_rows = batch * heads * rows;
    // Written as `[all_rows, k]` and reshaped after, so that the tensor returned is the one the
    // kernel wrote, whatever `reshape` does.
    let indices = empty_device_contiguous_dtype(
        client.clone(),
        scores.device.clone(),
        Shape::new([all_rows, k]),
        int_dtype,
    );
    // A power of two: one list of k per unit in shared memory, and no more units than scores.
    let units = (TOPK_SHARED / k)
        .min(TOPK_UNITS)
        .min(len.next_power_of_two());
    let units = 1usize << units.max(1).ilog2();
    let float_dtype = scores.dtype;
    topk_kernel::launch::<R>(
        &client,
        cube_count(all_rows, 1),
        CubeDim::new_1d(units as u32),
        linear(reshape(scores, Shape::new([all_rows, len]))),
        linear(indices.clone()),
        k,
        units,
        [float_dtype.into(), int_dtype.into()],
    );
    reshape(indices, Shape::new([batch, heads, rows, k]))
}

/// Threads per cube of the element-wise sparse kernels.
const SPARSE_THREADS: usize = 256;

/// Checks the index tensors of a sparse product against the float operands.
///
/// # Panics
/// If `topk` is not `[batch, heads, C, k]`, `assignments` is not `[batch, heads, rows]`, or
/// the two have different dtypes.
fn check_indices<R: CubeRuntime>(
    topk: &CubeTensor<R>,
    assignments: &CubeTensor<R>,
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
type SparseLaunch<R> =
    fn(&ComputeClient<R>, CubeCount, CubeDim, [TensorArg<R>; 5], usize, [StorageType; 2]);

/// Launches one of the two sparse products whose output is `[batch, heads, L, last]`, `last`
/// being `k` for `sparse_dot` and `D` for `sparse_weighted_sum`.
fn sparse_product<R: CubeRuntime>(
    launch: SparseLaunch<R>,
    first: CubeTensor<R>,
    second: CubeTensor<R>,
    topk: CubeTensor<R>,
    assignments: CubeTensor<R>,
    last: usize,
) -> CubeTensor<R> {
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
        [float_dtype.into(), int_dtype.into()],
    );
    output
}

/// Launches [`sparse_dot_kernel`].
fn sparse_dot<R: CubeRuntime>(
    queries: CubeTensor<R>,
    keys: CubeTensor<R>,
    topk: CubeTensor<R>,
    assignments: CubeTensor<R>,
) -> CubeTensor<R> {
    let k = topk.shape()[3];
    let launch: SparseLaunch<R> = |client, count, dim, [q, k, t, a, o], width, dtypes| {
        sparse_dot_kernel::launch::<R>(client, count, dim, q, k, t, a, o, width, dtypes)
    };
    sparse_product(launch, queries, keys, topk, assignments, k)
}

/// Launches [`sparse_weighted_sum_kernel`].
fn sparse_weighted_sum<R: CubeRuntime>(
    weights: CubeTensor<R>,
    values: CubeTensor<R>,
    topk: CubeTensor<R>,
    assignments: CubeTensor<R>,
) -> CubeTensor<R> {
    let dim = values.shape()[3];
    let launch: SparseLaunch<R> = |client, count, dim, [w, v, t, a, o], width, dtypes| {
        sparse_weighted_sum_kernel::launch::<R>(client, count, dim, w, v, t, a, o, width, dtypes)
    };
    sparse_product(launch, weights, values, topk, assignments, dim)
}

/// Most clusters the counting sort of [`sparse_scatter`] handles in shared memory (16 KiB);
/// beyond, the default body runs.
const SORT_CLUSTERS: usize = 4095;

/// Sorts the queries by cluster and sums each cluster's products per top-k slot, then gathers
/// the slots of every key (see [`crate::kernels::sparse`]).
fn sparse_scatter<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    weights: CubeTensor<R>,
    x: CubeTensor<R>,
    topk: CubeTensor<R>,
    assignments: CubeTensor<R>,
    keys_len: usize,
) -> CubeTensor<R> {
    type B<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let [batch, heads, len, _] = weights.shape().dims();
    let [_, _, _, features] = x.shape().dims();
    let [clusters, k] = check_indices(&topk, &assignments, [batch, heads], len);
    if clusters > SORT_CLUSTERS {
        return crate::ops::reference::sparse_scatter::<B<R, F, I, BT>>(
            weights,
            x,
            topk,
            assignments,
            keys_len,
        );
    }
    let (float_dtype, int_dtype) = (weights.dtype, topk.dtype);
    let (client, device) = (weights.client.clone(), weights.device.clone());
    let bh = batch * heads;
    let u32_tensor = |dims: Vec<usize>| {
        empty_device_contiguous_dtype(
            client.clone(),
            device.clone(),
            Shape::from(dims),
            DType::U32,
        )
    };

    // Counting sort of the queries by cluster.
    let assignments = reshape(into_contiguous(assignments), Shape::new([bh, len]));
    let chunks = len.div_ceil(SPARSE_THREADS);
    let offsets = u32_tensor(vec![bh, chunks, clusters]);
    let starts = u32_tensor(vec![bh, clusters + 1]);
    let order = u32_tensor(vec![bh, len]);
    cluster_histogram_kernel::launch::<R>(
        &client,
        cube_count(chunks, bh),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(assignments.clone()),
        linear(offsets.clone()),
        clusters,
        int_dtype.into(),
    );
    cluster_offsets_kernel::launch::<R>(
        &client,
        CubeCount::Static(bh as u32, 1, 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(offsets.clone()),
        linear(starts.clone()),
        clusters,
    );
    cluster_order_kernel::launch::<R>(
        &client,
        cube_count(chunks, bh),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(assignments),
        linear(offsets),
        linear(order.clone()),
        SPARSE_THREADS,
        int_dtype.into(),
    );

    // Per cluster and slot, the sum of its queries' products, kept in f32 until the last sum.
    let slot_sums = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::new([bh, clusters, k, features]),
        DType::F32,
    );
    let units = bh * clusters * k * features;
    cluster_slot_sums_kernel::launch::<R>(
        &client,
        cube_count(units.div_ceil(SPARSE_THREADS), 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(into_contiguous(weights)),
        linear(into_contiguous(x)),
        linear(order),
        linear(starts),
        linear(slot_sums.clone()),
        float_dtype.into(),
    );

    // For every key, the slots that hold it, then the sum of their slot sums.
    let slots = into_contiguous(
        Tensor::<B<R, F, I, BT>, 3, Int>::full([bh, clusters, keys_len], -1, (&device, DType::I32))
            .into_primitive(),
    );
    let topk = into_contiguous(topk);
    invert_topk_kernel::launch::<R>(
        &client,
        cube_count((bh * clusters * k).div_ceil(SPARSE_THREADS), 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(topk),
        linear(slots.clone()),
        int_dtype.into(),
    );
    let output = empty_device_contiguous_dtype(
        client.clone(),
        device,
        Shape::new([batch, heads, keys_len, features]),
        float_dtype,
    );
    gather_slot_sums_kernel::launch::<R>(
        &client,
        cube_count((bh * keys_len).div_ceil(SPARSE_THREADS), 1),
        CubeDim::new_1d(SPARSE_THREADS as u32),
        linear(slots),
        linear(slot_sums),
        linear(output.clone()),
        float_dtype.into(),
    );
    output
}
