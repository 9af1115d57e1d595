//! Default body of [`ClusteredAttentionBackend::hamming_kmeans`].

use burn::backend::tensor::IntTensor;
use burn::tensor::{Int, Tensor, TensorData};

use super::device_ints;
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;
use crate::ops::checks::host_lengths;
use crate::ops::{Lengths, MAX_BITS, NO_CLUSTER, TensorConversion, initial_centroid_positions};

/// Unpacks 32-bit codes `[batch, heads, n]` into their bits `[batch, heads, n, 32]` as 0/1
/// integers, bit `b` in column `b`.
fn unpack_bits(codes: Tensor<3, Int>) -> Tensor<4, Int> {
    let [batch, heads, n] = codes.dims();
    let shifts = Tensor::<1, Int>::arange(0..MAX_BITS as i64, (&codes.device(), codes.dtype()))
        .reshape([1, 1, 1, MAX_BITS])
        .expand([batch, heads, n, MAX_BITS]);
    codes
        .unsqueeze_dim::<4>(3)
        .expand([batch, heads, n, MAX_BITS])
        .bitwise_right_shift(shifts)
        .bitwise_and_scalar(1)
}

/// Default body of [`ClusteredAttentionBackend::hamming_kmeans`].
///
/// Hamming distances come from a matrix product of ±1 bit vectors
/// (`popcount(a xor b) = (32 − s_a · s_b) / 2`), the per-bit majority vote from a product of
/// the one-hot assignment matrix with the 0/1 bit matrix. All of it is integer tensor
/// arithmetic, so the result does not depend on the backend's float type. The codes are taken
/// in the int type of their device's settings, the type of the outputs.
///
/// # Shapes
/// - `codes`: `[batch, heads, L]`
/// - `query_lengths`: `[batch]`
/// - outputs: assignments `[batch, heads, L]`, counts `[batch, heads, clusters]`
///
/// # Panics
/// If `clusters` is 0 or a query length is outside `0..=L`.
pub fn hamming_kmeans<B: TensorConversion>(
    codes: IntTensor<B>,
    query_lengths: Lengths<B>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (IntTensor<B>, IntTensor<B>) {
    assert!(clusters > 0, "clusters must be at least 1, got 0");
    let codes = device_ints(B::int_tensor::<3>(codes));
    let [batch, heads, len] = codes.dims();
    let device = codes.device();
    let lengths = host_lengths(
        "query_lengths",
        query_lengths.into_option().map(B::int_tensor::<1>),
        batch,
        len,
    );

    // valid[b, 0, i] = i < lengths[b]
    let lengths_tensor = Tensor::<1, Int>::from_data(
        TensorData::new(lengths.iter().map(|&n| n as i64).collect(), [batch]),
        &device,
    );
    let valid = Tensor::<1, Int>::arange(0..len as i64, &device)
        .reshape([1, 1, len])
        .expand([batch, heads, len])
        .lower(
            lengths_tensor
                .clone()
                .reshape([batch, 1, 1])
                .expand([batch, heads, len]),
        );

    let positions = initial_centroid_positions(&lengths, heads, clusters, seed);
    let positions = Tensor::<3, Int>::from_data(
        TensorData::new(positions, [batch, heads, clusters]),
        &device,
    );
    let mut centroids = unpack_bits(codes.clone().gather(2, positions)); // [b, h, C, 32]

    // Bits of the valid queries (padded rows zeroed so they never vote) and their ±1 signs.
    let valid_int = valid.clone().int().unsqueeze_dim::<4>(3);
    let code_bits = unpack_bits(codes) * valid_int.clone(); // [b, h, L, 32]
    let code_signs = code_bits.clone().mul_scalar(2).sub_scalar(1);
    let cluster_index = Tensor::<1, Int>::arange(0..clusters as i64, &device)
        .reshape([1, 1, 1, clusters])
        .expand([batch, heads, len, clusters]);

    // Nearest centroid, ties to the lowest index: minimise distance · C + index.
    let assign = |centroids: &Tensor<4, Int>| -> Tensor<3, Int> {
        let centroid_signs = centroids.clone().mul_scalar(2).sub_scalar(1);
        let dots = code_signs.clone().matmul(centroid_signs.swap_dims(2, 3)); // [b, h, L, C]
        let distance = dots.neg().add_scalar(MAX_BITS as i64).div_scalar(2);
        let key = distance
            .mul_scalar(clusters as i64)
            .add(cluster_index.clone())
            .min_dim(3);
        key.remainder_scalar(clusters as i64).squeeze_dim::<3>(3)
    };
    // One-hot membership of the valid queries, [b, h, L, C].
    let members = |assignments: Tensor<3, Int>| -> Tensor<4, Int> {
        assignments
            .unsqueeze_dim::<4>(3)
            .expand([batch, heads, len, clusters])
            .equal(cluster_index.clone())
            .int()
            * valid_int.clone()
    };

    for _ in 0..iterations {
        let members = members(assign(&centroids));
        let counts = members.clone().sum_dim(2).swap_dims(2, 3); // [b, h, C, 1]
        let ones = members.swap_dims(2, 3).matmul(code_bits.clone()); // [b, h, C, 32]
        let twice = ones.mul_scalar(2);
        let counts = counts.expand([batch, heads, clusters, MAX_BITS]);
        let set = twice.clone().greater(counts.clone());
        let clear = twice.lower(counts);
        centroids = centroids.mask_fill(set, 1).mask_fill(clear, 0);
    }

    let assignments = assign(&centroids);
    let counts = members(assignments.clone()).sum_dim(2).squeeze_dim::<3>(2);

    // Sequences with no more valid queries than clusters: query i is cluster i.
    let exact = Tensor::<1, Int>::from_data(
        TensorData::new(
            lengths.iter().map(|&n| i64::from(n <= clusters)).collect(),
            [batch],
        ),
        &device,
    )
    .bool()
    .reshape([batch, 1, 1]);
    let identity = Tensor::<1, Int>::arange(0..len as i64, &device)
        .reshape([1, 1, len])
        .expand([batch, heads, len]);
    let assignments = assignments
        .mask_where(exact.clone().expand([batch, heads, len]), identity)
        .mask_fill(valid.bool_not(), NO_CLUSTER);
    let singletons = Tensor::<1, Int>::arange(0..clusters as i64, &device)
        .reshape([1, 1, clusters])
        .expand([batch, heads, clusters])
        .lower(
            lengths_tensor
                .reshape([batch, 1, 1])
                .expand([batch, heads, clusters]),
        )
        .int();
    let counts = counts.mask_where(exact.expand([batch, heads, clusters]), singletons);

    (B::int_primitive(assignments), B::int_primitive(counts))
}
