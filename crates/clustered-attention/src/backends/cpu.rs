//! CPU backends: the default bodies made of Burn tensor ops.

#[cfg(feature = "ndarray")]
mod ndarray {
    use crate::ClusteringBackend;
    use burn::backend::ndarray::{FloatNdArrayElement, IntNdArrayElement, NdArray, QuantElement};
    use burn::backend::ndarray::{NdArrayTensor, SharedArray};

    impl<E, I, Q> ClusteringBackend for NdArray<E, I, Q>
    where
        E: FloatNdArrayElement,
        I: IntNdArrayElement,
        Q: QuantElement,
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
    }
}

#[cfg(feature = "flex")]
mod flex {
    use crate::ClusteringBackend;
    use burn::backend::Flex;

    impl ClusteringBackend for Flex {}
}
