//! Recomputation of a layer in the backward pass ("activation checkpointing", Chen, Xu, Zhang,
//! Guestrin, *Training Deep Nets with Sublinear Memory Cost*, 2016): the layer's forward pass
//! runs once without keeping anything for the backward pass, and again in the backward pass,
//! where its gradients are needed.
//!
//! Burn 0.22 has no module-level recomputation (its autodiff recomputes single memory-bound ops
//! at most), so the crate makes the layer one autodiff node,
//! [`ClusteredAttentionBackend::recompute`](crate::ops::ClusteredAttentionBackend::recompute),
//! whose parents are the layer's input and its parameters flattened into one vector
//! ([`flatten_parameters`], a `cat` of Burn's, which routes the vector's gradient back to each
//! parameter): `loss.backward()` and `GradientsParams::from_grads` then see the parameters'
//! gradients as with any module. The node keeps the input and that vector; its backward pass
//! builds the layer again from the vector on fresh autodiff leaves, runs its forward pass,
//! and takes the gradients of `sum(output ⊙ incoming gradient)` with a nested
//! `backward()` (which Burn 0.22's autodiff allows: a backward pass holds the lock of its own
//! graph only).

use std::fmt;
use std::sync::Arc;

use burn::backend::tensor::FloatTensor;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;

use crate::ops::TensorConversion;

/// The forward pass of a recomputed layer: `(input [batch, L, d_model], parameters [n]) →
/// output [batch, L, d_model]`, the layer built from the flattened `parameters`
/// ([`unflatten_parameters`]).
///
/// Under autodiff it runs twice, in the forward pass and in the backward pass, and must give
/// the same output both times: its randomness must come from what it captures (the crate's
/// encoder runs its layer inside a scope seeded once per layer, `dropout::with_seeds` for the
/// counter-based masks' seeds and [`with_dropout_seed`](crate::with_dropout_seed) for the
/// masks full attention draws on the host), and its clusters are recorded in the first run and
/// replayed in the second.
#[derive(Clone)]
pub struct RecomputedForward(Arc<dyn Fn(Tensor<3>, Tensor<1>) -> Tensor<3> + Send + Sync>);

impl fmt::Debug for RecomputedForward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RecomputedForward")
    }
}

impl RecomputedForward {
    /// The forward pass `forward(input, parameters)`.
    pub fn new(
        forward: impl Fn(Tensor<3>, Tensor<1>) -> Tensor<3> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(forward))
    }

    /// `forward` on the primitives of backend `B`, as they are (no autodiff: one run).
    pub(crate) fn call<B: TensorConversion>(
        &self,
        input: FloatTensor<B>,
        parameters: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let output = (self.0)(
            B::float_tensor::<3>(input),
            B::float_tensor::<1>(parameters),
        );
        B::float_primitive(output)
    }

    /// The output's value, from the primitives of backend `B` (the backend an `Autodiff`
    /// wraps): the forward pass on their tensors with autodiff on (so that training-only parts
    /// such as dropout run) but nothing tracked, returned without autodiff.
    #[cfg(feature = "autodiff")]
    pub(crate) fn value<B: TensorConversion>(
        &self,
        input: FloatTensor<B>,
        parameters: FloatTensor<B>,
    ) -> FloatTensor<B> {
        let input = B::float_tensor::<3>(input).inner().autodiff();
        let parameters = B::float_tensor::<1>(parameters).inner().autodiff();
        B::float_primitive((self.0)(input, parameters).inner())
    }

    /// The gradients of the input and of the parameters (those `wanted`) given the output's
    /// gradient `grad`: the forward pass again on fresh leaves, then one backward pass from
    /// `sum(output ⊙ grad)`.
    #[cfg(feature = "autodiff")]
    pub(crate) fn gradients<B: TensorConversion>(
        &self,
        input: FloatTensor<B>,
        parameters: FloatTensor<B>,
        grad: FloatTensor<B>,
        wanted: [bool; 2],
    ) -> [Option<FloatTensor<B>>; 2] {
        if wanted == [false, false] {
            return [None, None];
        }
        let input = B::float_tensor::<3>(input)
            .inner()
            .autodiff()
            .set_require_grad(wanted[0]);
        let parameters = B::float_tensor::<1>(parameters)
            .inner()
            .autodiff()
            .set_require_grad(wanted[1]);
        let grad = B::float_tensor::<3>(grad).inner().autodiff();
        let output = (self.0)(input.clone(), parameters.clone());
        let grads = (output * grad).sum().backward();
        [
            wanted[0]
                .then(|| input.grad(&grads))
                .flatten()
                .map(|g| B::float_primitive(g.inner())),
            wanted[1]
                .then(|| parameters.grad(&grads))
                .flatten()
                .map(|g| B::float_primitive(g.inner())),
        ]
    }
}

/// Every float parameter of `module`, flattened and concatenated in the module's visiting
/// order: `[n]`, `n` the number of parameters' elements. On an autodiff device the vector's
/// gradient flows back to each parameter (Burn's `reshape` and `cat`).
///
/// # Panics
/// If the module has no float parameter.
pub fn flatten_parameters<M: Module>(module: &M) -> Tensor<1> {
    struct Collect(Vec<Tensor<1>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().flatten(0, D - 1));
        }
    }
    let mut collect = Collect(Vec::new());
    module.visit(&mut collect);
    assert!(
        !collect.0.is_empty(),
        "flatten_parameters: the module has no float parameter"
    );
    Tensor::cat(collect.0, 0)
}

/// `module` with its float parameters taken from `parameters` in the order of
/// [`flatten_parameters`] (each the next slice of its number of elements, in its shape).
///
/// # Panics
/// If `parameters` is not `[n]` with `n` the number of `module`'s parameters' elements.
pub fn unflatten_parameters<M: Module>(module: M, parameters: Tensor<1>) -> M {
    struct Split {
        parameters: Tensor<1>,
        at: usize,
    }
    impl ModuleMapper for Split {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let [total] = self.parameters.dims();
            let at = self.at;
            param.map(|value| {
                let shape = value.shape();
                let n = shape.num_elements();
                assert!(
                    at + n <= total,
                    "unflatten_parameters: parameters of shape [{total}] end before the \
                     parameter of shape {shape:?} at {at}"
                );
                self.at = at + n;
                self.parameters.clone().narrow(0, at, n).reshape(shape)
            })
        }
    }
    let [total] = parameters.dims();
    let mut split = Split { parameters, at: 0 };
    let module = module.map(&mut split);
    assert_eq!(
        split.at, total,
        "unflatten_parameters: parameters of shape [{total}] for a module of {} elements",
        split.at
    );
    module
}
