//! Host-memory access to the CPU backends' tensors: [`HostAccess`] (NdArray and Flex borrow
//! their `f32` storage), and the reads and writes of the host ops.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::ops::checks::host_key_lengths;

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
pub(super) fn ints_through_data<B: Backend>(x: IntTensor<B>) -> Vec<i64> {
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
pub(super) fn dims<B: Backend, const D: usize>(x: &FloatTensor<B>) -> [usize; D] {
    x.shape().dims()
}

pub(super) fn read_ints<B: HostAccess, const D: usize>(x: IntTensor<B>) -> (Vec<i64>, [usize; D]) {
    let dims = x.shape().dims();
    (B::ints_to_vec(x), dims)
}

/// A float tensor of `dtype` from `f32` values (rounded to nearest for `f16` and `bf16`).
pub(super) fn write_float<B: Backend, const D: usize>(
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

pub(super) fn write_ints<B: Backend, const D: usize>(
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
pub(super) fn key_lengths_on_host<B: Backend>(
    key_lengths: Option<IntTensor<B>>,
    batch: usize,
    keys_len: usize,
) -> Vec<usize> {
    host_key_lengths::<B>(key_lengths.map(Tensor::from_primitive), batch, keys_len)
}

/// Whether the host loops take `x`: `f32`, or a half type they widen to `f32`.
pub(super) fn on_host<B: Backend>(x: &FloatTensor<B>) -> bool {
    matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use burn::backend::ndarray::{FloatNdArrayElement, IntNdArrayElement, NdArray, QuantElement};
    use burn::backend::ndarray::{NdArrayTensor, SharedArray};
    use burn::tensor::TensorMetadata;
    use burn::tensor::ops::{FloatTensor, IntTensor};

    use super::{HostAccess, ints_through_data};

    impl<E, I, Q> HostAccess for NdArray<E, I, Q>
    where
        E: FloatNdArrayElement,
        I: IntNdArrayElement,
        Q: QuantElement,
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
        /// Borrows the array when it is in standard layout (NdArray copies shared arrays
        /// element by element in `into_data`).
        fn with_f32<R>(x: &FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
            match x {
                NdArrayTensor::F32(storage) => {
                    let view = storage.view();
                    match view.as_slice() {
                        Some(values) => f(values),
                        None => f(&view.iter().copied().collect::<Vec<f32>>()),
                    }
                }
                other => panic!("expected an f32 tensor, got {:?}", other.dtype()),
            }
        }

        /// Copies the array in one piece when it is in standard layout (`into_data` walks it
        /// element by element).
        fn ints_to_vec(x: IntTensor<Self>) -> Vec<i64> {
            match &x {
                NdArrayTensor::I64(storage) => {
                    if let Some(values) = storage.view().as_slice() {
                        return values.to_vec();
                    }
                }
                NdArrayTensor::I32(storage) => {
                    if let Some(values) = storage.view().as_slice() {
                        return values.iter().map(|&v| i64::from(v)).collect();
                    }
                }
                _ => {}
            }
            ints_through_data::<Self>(x)
        }
    }
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::Flex;
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{DType, Element, bf16, f16};

    use super::HostAccess;

    impl HostAccess for Flex {
        /// Borrows `f32` storage when it is contiguous; otherwise copies it into row-major
        /// order one dense run at a time, widening `f16` and `bf16`.
        fn with_f32<R>(x: &FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
            match x.dtype() {
                DType::F16 => f(&row_major::<f16>(x, f16::to_f32)),
                DType::BF16 => f(&row_major::<bf16>(x, bf16::to_f32)),
                _ => match x.as_slice::<f32>() {
                    Some(values) => f(values),
                    None => f(&row_major::<f32>(x, |v| v)),
                },
            }
        }
    }

    /// The values of `x` in row-major order, converted by `to_f32`.
    ///
    /// A strided view (such as the heads of `[batch, time, heads, head_dim]` swapped to
    /// `[batch, heads, time, head_dim]`) is copied one run of its dense innermost dimensions
    /// at a time; Flex's own `to_contiguous` visits the elements of a layout that does not
    /// collapse to two dimensions one index computation at a time.
    ///
    /// # Panics
    /// If `x`'s dtype is not `E`.
    fn row_major<E: Element + bytemuck::Pod>(
        x: &FloatTensor<Flex>,
        to_f32: impl Fn(E) -> f32,
    ) -> Vec<f32> {
        let storage = x.storage::<E>();
        let blocks = x.layout().strided_blocks();
        let run = blocks.block_len();
        let mut out = Vec::with_capacity(x.layout().num_elements());
        for start in blocks.block_starts() {
            out.extend(storage[start..start + run].iter().map(|&v| to_f32(v)));
        }
        out
    }

    #[cfg(test)]
    mod tests {
        use burn::backend::Flex;
        use burn::tensor::{DType, Tensor, TensorData, s};

        use super::HostAccess;

        /// `with_f32`'s values against Flex's own `into_data`, for views whose layouts are
        /// not contiguous: swapped and permuted dims, a flip (negative stride), a slice with
        /// an offset, a broadcast (stride 0), and half types; exactly (a copy).
        #[test]
        fn strided_views_read_in_row_major_order() {
            let device = Default::default();
            let values: Vec<f32> = (0..2 * 5 * 3 * 4).map(|v| v as f32 * 0.25 - 7.0).collect();
            let x = Tensor::<Flex, 4>::from_data(TensorData::new(values, [2, 5, 3, 4]), &device);
            let views = [
                x.clone().swap_dims(1, 2),
                x.clone().permute([3, 1, 0, 2]),
                x.clone().flip([1, 3]),
                x.clone().slice(s![.., 1..4, .., 1..3]),
                x.clone().slice(s![.., 2..3, .., ..]).expand([2, 4, 3, 4]),
                x.clone().swap_dims(1, 2).cast(DType::F16),
                x.clone().permute([0, 2, 3, 1]).cast(DType::BF16),
            ];
            for (i, view) in views.into_iter().enumerate() {
                let expected: Vec<f32> = view.to_data().convert::<f32>().to_vec().unwrap();
                let ours = Flex::with_f32(&view.into_primitive().tensor(), <[f32]>::to_vec);
                assert_eq!(ours, expected, "view {i}");
            }
            // One by hand: [2, 3] transposed.
            let t = Tensor::<Flex, 2>::from_data([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], &device);
            let ours = Flex::with_f32(&t.transpose().into_primitive().tensor(), <[f32]>::to_vec);
            assert_eq!(ours, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        }
    }
}
