//! [`Fusion`] (`burn::backend::Wgpu`, `Cuda`): the clustering ops are registered as custom
//! operations that run the inner backend's kernels when the fusion stream executes, as
//! burn-vision does for its ops. The other ops keep their default bodies, which fuse.

use core::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use crate::ClusteringBackend;
use crate::ops::reference::check_planes;

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

#[derive(Clone, Debug)]
struct LshHash<B> {
    desc: CustomOpIr,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ClusteringBackend> Operation<B::FusionRuntime> for LshHash<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let ([queries, planes], [codes]) = self.desc.as_fixed();
        let output = B::lsh_hash(
            handles.get_float_tensor::<B>(queries),
            handles.get_float_tensor::<B>(planes),
        );
        handles.register_int_tensor::<B>(&codes.id, output);
    }
}

#[derive(Clone, Debug)]
struct HammingKmeans<B> {
    desc: CustomOpIr,
    clusters: usize,
    iterations: usize,
    seed: u64,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ClusteringBackend> Operation<B::FusionRuntime> for HammingKmeans<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let codes = handles.get_int_tensor::<B>(&self.desc.inputs[0]);
        let lengths = self
            .desc
            .inputs
            .get(1)
            .map(|lengths| handles.get_int_tensor::<B>(lengths));
        let (assignments, counts) =
            B::hamming_kmeans(codes, lengths, self.clusters, self.iterations, self.seed);
        let [assignments_ir, counts_ir] = [&self.desc.outputs[0], &self.desc.outputs[1]];
        handles.register_int_tensor::<B>(&assignments_ir.id, assignments);
        handles.register_int_tensor::<B>(&counts_ir.id, counts);
    }
}

impl<B: FusionBackend + ClusteringBackend> ClusteringBackend for Fusion<B> {
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        let [batch, heads, len, dim] = queries.shape().dims();
        let [bits, columns] = planes.shape().dims();
        check_planes([batch, heads, len, dim], [bits, columns]);
        let client = queries.client.clone();
        let streams = OperationStreams::with_inputs([&queries, &planes]);
        let codes = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, len]),
            <B::IntElem as burn::tensor::Element>::dtype(),
        );
        let desc = CustomOpIr::new("lsh_hash", &[queries.into_ir(), planes.into_ir()], &[codes]);
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                LshHash::<B> {
                    desc,
                    _backend: PhantomData,
                },
            )
            .output()
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Option<IntTensor<Self>>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        assert!(clusters > 0, "clusters must be at least 1, got 0");
        let [batch, heads, len] = codes.shape().dims();
        let (client, dtype) = (codes.client.clone(), codes.dtype);
        let streams = match &query_lengths {
            Some(lengths) => OperationStreams::with_inputs([&codes, lengths]),
            None => OperationStreams::with_inputs([&codes]),
        };
        let mut inputs = vec![codes.into_ir()];
        inputs.extend(query_lengths.map(|lengths| lengths.into_ir()));
        let outputs = [
            TensorIr::uninit(
                client.create_empty_handle(),
                Shape::new([batch, heads, len]),
                dtype,
            ),
            TensorIr::uninit(
                client.create_empty_handle(),
                Shape::new([batch, heads, clusters]),
                dtype,
            ),
        ];
        let desc = CustomOpIr::new("hamming_kmeans", &inputs, &outputs);
        let [assignments, counts] = client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                HammingKmeans::<B> {
                    desc,
                    clusters,
                    iterations,
                    seed,
                    _backend: PhantomData,
                },
            )
            .try_into()
            .expect("two outputs");
        (assignments, counts)
    }
}
