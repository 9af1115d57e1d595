//! How the ops of `Fusion<CubeBackend>` (`burn::backend::Cube`) run their kernels: each call
//! with a kernel is registered on the current Fusion stream as one custom operation, whose
//! closure runs the launcher on the inner `CubeBackend`'s tensors when the stream executes
//! (burn-signal's and the `#[backend_extension]` macro's pattern; the macro's own `Fusion`
//! selector needs the trait implemented for `CubeBackend`, which the default bodies cannot
//! be: they go through `Dispatch`'s tensors, and `CubeBackend` alone is none of its kinds).
//!
//! The attentions run whole on the inner backend, so Fusion never sees (and never fuses) the
//! matrix products, masks and softmaxes inside them: on CUDA, Burn's fused matmul and reduce
//! gave wrong centroid weights on those graphs. The custom operation's [`CustomOpIr`] names the
//! op and holds its tensors and the scalars its result depends on, so that two calls that
//! differ are never taken for the same operation.

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::cast;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::custom::{
    CustomOpIr, HandleContainer, Operation, OperationIr, ScalarIr, StreamId, TensorIr,
};
use burn_fusion::{ExecutionError, FusionBackend, FusionRuntime, FusionTensor};

/// The runtime of `Fusion<CubeBackend>`'s streams.
type Runtime = <CubeBackend as FusionBackend>::FusionRuntime;

/// The handles of the tensors a custom operation reads and writes when its stream executes.
type Handles = HandleContainer<<Runtime as FusionRuntime>::FusionHandle>;

/// A tensor of `Fusion<CubeBackend>`, of any kind.
pub(super) type Tensor = FusionTensor<Runtime>;

/// A custom operation: the closure [`defer`] builds.
struct Deferred<F>(F);

impl<F> core::fmt::Debug for Deferred<F> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("clustered_attention::Deferred")
    }
}

impl<F> Operation<Runtime> for Deferred<F>
where
    F: Fn(&mut Handles) -> Result<(), ExecutionError> + Send + Sync,
{
    fn execute(&self, handles: &mut Handles) -> Result<(), ExecutionError> {
        (self.0)(handles)
    }
}

/// Registers the custom operation `id` (`clustered_attention::` and the op's name) on the
/// current stream and returns its outputs, of the given shapes and dtypes. When the stream executes, `run` gets
/// the inner tensors of `inputs` (`None` where an optional input is not given) and returns
/// the outputs in the same order; an int output is cast to the dtype it was registered with.
///
/// # Panics
/// If no input is given. A `run` that returns `None` or another number of outputs fails the
/// stream's execution with an error naming the op.
pub(super) fn defer<const N: usize>(
    id: &'static str,
    inputs: [Option<Tensor>; N],
    outputs: Vec<(Shape, DType)>,
    scalars: Vec<ScalarIr>,
    run: impl Fn([Option<CubeTensor>; N]) -> Option<Vec<CubeTensor>> + Send + Sync + 'static,
) -> Vec<Tensor> {
    let client = (inputs.iter().flatten().next())
        .unwrap_or_else(|| panic!("{id}: a custom operation needs an input tensor"))
        .client
        .clone();
    let outputs: Vec<TensorIr> = (outputs.into_iter())
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs = inputs.map(|tensor| tensor.map(FusionTensor::into_ir));
    let given: Vec<TensorIr> = inputs.iter().flatten().cloned().collect();
    let desc = CustomOpIr::with_scalars(id, &given, &outputs, scalars);
    let op = Deferred(move |handles: &mut Handles| {
        let tensors = inputs.clone().map(|ir| {
            ir.map(|ir| match ir.dtype.is_float() {
                true => handles.get_float_tensor::<CubeBackend>(&ir),
                false => handles.get_int_tensor::<CubeBackend>(&ir),
            })
        });
        let results = run(tensors).filter(|results| results.len() == outputs.len());
        let results = results.ok_or_else(|| {
            ExecutionError::generic(format!("{id} did not give its {} outputs", outputs.len()))
        })?;
        for (ir, tensor) in outputs.iter().zip(results) {
            let tensor = cast(tensor, ir.dtype);
            match ir.dtype.is_float() {
                true => handles.register_float_tensor::<CubeBackend>(&ir.id, tensor),
                false => handles.register_int_tensor::<CubeBackend>(&ir.id, tensor),
            }
        }
        Ok(())
    });
    client.register(StreamId::current(), OperationIr::Custom(desc), op)
}

/// `usize` as a scalar of a custom operation.
pub(super) fn uint(value: usize) -> ScalarIr {
    ScalarIr::UInt(value as u64)
}
