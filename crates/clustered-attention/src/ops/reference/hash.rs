//! Default body of [`ClusteredAttentionBackend::lsh_hash`].

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorData};

#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;
use crate::ops::TensorConversion;
use crate::ops::checks::check_planes;

/// The value of bit `b` in a code held as an `i32` two's complement pattern:
/// `2^b` for `b < 31` and `-2^31` for the sign bit.
fn bit_values(bits: usize) -> Vec<i64> {
    (0..bits)
        .map(|b| if b == 31 { i32::MIN as i64 } else { 1i64 << b })
        .collect()
}

/// Default body of [`ClusteredAttentionBackend::lsh_hash`].
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`
/// - `planes`: `[bits, E + 1]`
/// - output: `[batch, heads, L]`
///
/// # Panics
/// If `bits` is outside `1..=32` or `planes` does not have `E + 1` columns.
pub fn lsh_hash<B: TensorConversion>(
    queries: FloatTensor<B>,
    planes: FloatTensor<B>,
) -> IntTensor<B> {
    let queries = B::float_tensor::<4>(queries);
    let planes = B::float_tensor::<2>(planes);
    let [batch, heads, len, dim] = queries.dims();
    let [bits, _] = planes.dims();
    check_planes(queries.dims(), planes.dims());
    let device = queries.device();
    let rows = batch * heads * len;

    let normals = planes.clone().slice([0..bits, 0..dim]).transpose(); // [E, bits]
    let thresholds = planes.slice([0..bits, dim..dim + 1]).reshape([1, bits]);
    let projections = queries.reshape([rows, dim]).matmul(normals); // [rows, bits]
    let set = projections.greater(thresholds.expand([rows, bits]));
    let values = Tensor::<1, Int>::from_data(TensorData::new(bit_values(bits), [bits]), &device)
        .reshape([1, bits]);
    B::int_primitive(
        set.int()
            .mul(values)
            .sum_dim(1)
            .reshape([batch, heads, len]),
    )
}
