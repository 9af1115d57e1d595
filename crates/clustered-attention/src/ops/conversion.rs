//! [`TensorConversion`]: the backends whose primitives the default bodies turn into Burn
//! [`Tensor`]s and back.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch};
use burn::tensor::{Int, Tensor};

/// A backend whose primitives convert to and from Burn's [`Tensor`] (the default bodies of
/// [`ClusteredAttentionBackend`](super::ClusteredAttentionBackend) run on [`Tensor`]).
///
/// Implemented for [`Dispatch`] (its primitives are the tensors' own), and, each with the crate
/// feature that compiles it, for `NdArray` (`ndarray`), `Flex` (`flex`), `Cube` (`cube`) and
/// `Autodiff` of each of them (`autodiff`). A tensor made from a primitive lives on the backend's
/// device (an autodiff device for `Autodiff`), so the tensor-level ops of [`crate::ops`] called
/// on it run on that backend again.
pub trait TensorConversion: Backend {
    /// The float primitive `x` as a rank-`D` [`Tensor`].
    fn float_tensor<const D: usize>(x: FloatTensor<Self>) -> Tensor<D>;
    /// The int primitive `x` as a rank-`D` [`Tensor`].
    fn int_tensor<const D: usize>(x: IntTensor<Self>) -> Tensor<D, Int>;
    /// The primitive of the float tensor `x`.
    ///
    /// # Panics
    /// If `x` does not live on this backend (an autodiff tensor for a backend without autodiff,
    /// or the reverse, included).
    fn float_primitive<const D: usize>(x: Tensor<D>) -> FloatTensor<Self>;
    /// The primitive of the int tensor `x`.
    ///
    /// # Panics
    /// If `x` does not live on this backend.
    fn int_primitive<const D: usize>(x: Tensor<D, Int>) -> IntTensor<Self>;
}

impl TensorConversion for Dispatch {
    fn float_tensor<const D: usize>(x: FloatTensor<Self>) -> Tensor<D> {
        Tensor::from_dispatch(x)
    }

    fn int_tensor<const D: usize>(x: IntTensor<Self>) -> Tensor<D, Int> {
        Tensor::from_dispatch(x)
    }

    fn float_primitive<const D: usize>(x: Tensor<D>) -> FloatTensor<Self> {
        x.into_dispatch()
    }

    fn int_primitive<const D: usize>(x: Tensor<D, Int>) -> IntTensor<Self> {
        x.into_dispatch()
    }
}

/// The conversion bodies of a concrete backend `$backend` (`Tensor::from_primitive` /
/// `Tensor::try_into_primitive`).
macro_rules! conversion_bodies {
    ($backend:ty) => {
        fn float_tensor<const D: usize>(x: FloatTensor<Self>) -> Tensor<D> {
            Tensor::from_primitive::<$backend>(x)
        }

        fn int_tensor<const D: usize>(x: IntTensor<Self>) -> Tensor<D, Int> {
            Tensor::from_primitive::<$backend>(x)
        }

        fn float_primitive<const D: usize>(x: Tensor<D>) -> FloatTensor<Self> {
            x.try_into_primitive::<$backend>().unwrap_or_else(|error| {
                panic!(
                    "a float tensor of {}: {error:?}",
                    core::any::type_name::<$backend>()
                )
            })
        }

        fn int_primitive<const D: usize>(x: Tensor<D, Int>) -> IntTensor<Self> {
            x.try_into_primitive::<$backend>().unwrap_or_else(|error| {
                panic!(
                    "an int tensor of {}: {error:?}",
                    core::any::type_name::<$backend>()
                )
            })
        }
    };
}

/// [`TensorConversion`] for `burn::backend::$backend` under the crate feature `$feature`.
macro_rules! tensor_conversion {
    ($feature:literal, $backend:ident) => {
        #[cfg(feature = $feature)]
        #[allow(deprecated)] // `NdArray`
        impl TensorConversion for burn::backend::$backend {
            conversion_bodies!(burn::backend::$backend);
        }
    };
}

tensor_conversion!("ndarray", NdArray);
tensor_conversion!("flex", Flex);
tensor_conversion!("cube", Cube);

/// `Autodiff` of every backend whose dispatch conversion Burn implements (the CPU backends and
/// `Cube`, with either checkpointing strategy). Generic over the inner backend, so that the
/// bound an impl over `Autodiff<B, C>` states is Burn's conversion, not this trait (a bound
/// naming a subtrait of `Backend` on `Autodiff<B, C>` would hide its primitive types from the
/// impl's body).
#[cfg(feature = "autodiff")]
impl<B, C> TensorConversion for burn::backend::Autodiff<B, C>
where
    B: Backend,
    C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy,
    burn::backend::DispatchTensor:
        burn::backend::DispatchKindConversion<burn::backend::Autodiff<B, C>>,
{
    conversion_bodies!(burn::backend::Autodiff<B, C>);
}
