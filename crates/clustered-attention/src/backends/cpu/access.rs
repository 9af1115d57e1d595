//! Host-memory access to the CPU backends' tensors: [`HostAccess`] (NdArray and Flex borrow
//! their `f32` storage), and the reads and writes of the host ops.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, TensorMetadata, get_or_init_device_settings};
use burn::tensor::{DType, TensorData, read_sync};

use crate::ops::checks::checked_lengths;

/// Host-memory access to a CPU backend's tensors.
///
/// The default methods go through the backend's `float_into_data` / `int_into_data` (a copy
/// when the tensor is shared); NdArray and Flex override [`HostAccess::with_f32`] to borrow
/// their `f32` storage without copying, and [`HostAccess::ints_to_vec`] to copy their int
/// storage in one piece.
pub trait HostAccess: Backend {
    /// Calls `f` with the values of `x` in row-major order, as `f32` (`f16` and `bf16` values
    /// are widened exactly).
    ///
    /// # Panics
    /// If `x` is not an `f32`, `f16` or `bf16` tensor.
    fn with_f32<R>(x: &FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
        let data = read_sync(Self::float_into_data(x.clone())).expect("the tensor's values");
        match data.dtype() {
            DType::F32 => f(data.as_slice::<f32>().expect("an f32 tensor")),
            DType::F16 | DType::BF16 => f(&data
                .convert::<f32>()
                .try_into_vec::<f32>()
                .expect("f32 data")),
            other => panic!("expected an f32, f16 or bf16 tensor, got {other:?}"),
        }
    }

    /// The values of the int tensor `x` in row-major order, as `i64`.
    fn ints_to_vec(x: IntTensor<Self>) -> Vec<i64> {
        ints_through_data::<Self>(x)
    }
}

/// The values of the int tensor `x` in row-major order, as `i64`, through the backend's
/// `int_into_data`: the default [`HostAccess::ints_to_vec`].
pub(super) fn ints_through_data<B: Backend>(x: IntTensor<B>) -> Vec<i64> {
    let data = read_sync(B::int_into_data(x)).expect("the tensor's values");
    match data.dtype() {
        DType::I64 => data.try_into_vec::<i64>().expect("i64 data"),
        DType::I32 => data
            .try_into_vec::<i32>()
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
    B::float_from_data(TensorData::new(values, dims).convert_dtype(dtype), device)
}

/// An int tensor of the device's int dtype (its settings' `int_dtype`: `i64` on NdArray, `i32`
/// on Flex unless the device is configured otherwise) from `i64` values.
pub(super) fn write_ints<B: Backend, const D: usize>(
    values: Vec<i64>,
    dims: [usize; D],
    device: &B::Device,
) -> IntTensor<B> {
    let dtype = DType::from(get_or_init_device_settings::<B>(device).int_dtype);
    B::int_from_data(TensorData::new(values, dims).convert_dtype(dtype), device)
}

/// Reads the lengths tensor `name` (`[batch]`) to the host and checks it against its
/// sequence's length `seq_len`.
///
/// Returns one length per batch item (all `seq_len` when `None`).
///
/// # Panics
/// If the tensor is not `[batch]` or holds a length outside `0..=seq_len`.
pub(super) fn lengths_on_host<B: HostAccess>(
    name: &str,
    lengths: Option<IntTensor<B>>,
    batch: usize,
    seq_len: usize,
) -> Vec<usize> {
    let dims = |lengths: &IntTensor<B>| lengths.shape().to_vec();
    checked_lengths(name, lengths, batch, seq_len, dims, B::ints_to_vec)
}

/// Reads `key_lengths` (`[batch]`) to the host, as [`lengths_on_host`] does, and checks that
/// every sequence has a key: all `keys_len` when `None`.
///
/// # Panics
/// If the tensor is not `[batch]` or a length is outside `1..=keys_len`.
pub(super) fn key_lengths_on_host<B: HostAccess>(
    key_lengths: Option<IntTensor<B>>,
    batch: usize,
    keys_len: usize,
) -> Vec<usize> {
    let lengths = lengths_on_host::<B>("key_lengths", key_lengths, batch, keys_len);
    if let Some(b) = lengths.iter().position(|&n| n == 0) {
        panic!("key_lengths[{b}] = 0: every sequence needs at least one key");
    }
    lengths
}

/// Whether the host loops take `x`: `f32`, or a half type they widen to `f32`.
pub(super) fn on_host<B: Backend>(x: &FloatTensor<B>) -> bool {
    matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

// `burn-ndarray` is deprecated in Burn 0.22 (for Flex); its backend is still supported here.
#[cfg(feature = "ndarray")]
#[allow(deprecated)]
mod ndarray {
    use burn::backend::NdArray;
    use burn::backend::TensorMetadata;
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn_ndarray::NdArrayTensor;

    use super::{HostAccess, ints_through_data};

    impl HostAccess for NdArray {
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
    use burn::backend::tensor::{FloatTensor, IntTensor};
    use burn::tensor::{DType, Element, bf16, f16};

    use super::{HostAccess, ints_through_data};

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

        /// Copies contiguous `i32` or `i64` storage in one piece (`into_data` copies a shared
        /// buffer first); other layouts and dtypes go through `into_data`.
        fn ints_to_vec(x: IntTensor<Self>) -> Vec<i64> {
            match x.dtype() {
                DType::I32 => {
                    if let Some(values) = x.as_slice::<i32>() {
                        return values.iter().map(|&v| i64::from(v)).collect();
                    }
                }
                DType::I64 => {
                    if let Some(values) = x.as_slice::<i64>() {
                        return values.to_vec();
                    }
                }
                _ => {}
            }
            ints_through_data::<Self>(x)
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
        use burn::tensor::{DType, Device, Tensor, TensorData, s};

        use super::HostAccess;

        /// `with_f32`'s values against Flex's own `into_data`, for views whose layouts are
        /// not contiguous: swapped and permuted dims, a flip (negative stride), a slice with
        /// an offset, a broadcast (stride 0), and half types; exactly (a copy).
        #[test]
        fn strided_views_read_in_row_major_order() {
            let device = Device::flex();
            let primitive = |x: Tensor<4>| x.try_into_primitive::<Flex>().expect("a Flex tensor");
            let values: Vec<f32> = (0..2 * 5 * 3 * 4).map(|v| v as f32 * 0.25 - 7.0).collect();
            let x = Tensor::<4>::from_data(TensorData::new(values, [2, 5, 3, 4]), &device);
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
                let expected: Vec<f32> = view.to_data().convert::<f32>().try_to_vec().unwrap();
                let ours = Flex::with_f32(&primitive(view), <[f32]>::to_vec);
                assert_eq!(ours, expected, "view {i}");
            }
            // One by hand: [2, 3] transposed.
            let t = Tensor::<2>::from_data([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], &device);
            let t = t
                .transpose()
                .try_into_primitive::<Flex>()
                .expect("a Flex tensor");
            let ours = Flex::with_f32(&t, <[f32]>::to_vec);
            assert_eq!(ours, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        }
    }
}
