//! [`CubeBackend`] (WGPU, Vulkan, CUDA without fusion): hashing and K-means as CubeCL kernels
//! ([`crate::kernels`]); the top-k and the sparse products keep their default bodies (Burn
//! tensor ops, which run as CubeCL kernels too).

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Shape, Tensor, TensorData, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::ClusteringBackend;
use crate::kernels::cube_count;
use crate::kernels::hash::lsh_hash_kernel;
use crate::kernels::kmeans::{SHARED_CENTROIDS, kmeans_assign_kernel, kmeans_update_kernel};
use crate::ops::reference::check_planes;
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
    let codes = empty_device_dtype(
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
        queries.into_tensor_arg(),
        planes.into_tensor_arg(),
        codes.clone().into_tensor_arg(),
        dim,
        tile,
        [float_dtype.into(), int_dtype.into()],
    );
    codes
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
    let row_lengths =
        Tensor::<B<R, F, I, BT>, 1, Int>::from_data(TensorData::new(row_lengths, [rows]), options)
            .into_primitive();
    let assignments = empty_device_dtype(
        client.clone(),
        device.clone(),
        Shape::new([rows, len]),
        dtype,
    );
    let counts = empty_device_dtype(
        client.clone(),
        device.clone(),
        Shape::new([rows, clusters]),
        dtype,
    );

    let shared = clusters <= SHARED_CENTROIDS;
    let assign = || {
        kmeans_assign_kernel::launch::<R>(
            &client,
            cube_count(len.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS as u32),
            codes.clone().into_tensor_arg(),
            centroids.clone().into_tensor_arg(),
            row_lengths.clone().into_tensor_arg(),
            assignments.clone().into_tensor_arg(),
            clusters,
            shared,
            dtype.into(),
        )
    };
    let update = |update: bool| {
        kmeans_update_kernel::launch::<R>(
            &client,
            cube_count(clusters.div_ceil(CUBE_THREADS), rows),
            CubeDim::new_1d(CUBE_THREADS.min(clusters.next_power_of_two()) as u32),
            codes.clone().into_tensor_arg(),
            assignments.clone().into_tensor_arg(),
            row_lengths.clone().into_tensor_arg(),
            centroids.clone().into_tensor_arg(),
            counts.clone().into_tensor_arg(),
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
