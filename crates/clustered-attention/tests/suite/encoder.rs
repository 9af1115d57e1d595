//! The transformer encoder against burn-nn's `TransformerEncoder`: records both ways, the same
//! outputs and gradients with full attention (padding and attention masks, the quiet softmax)
//! on NdArray, Flex and WGPU, the attention swapped on trained weights, dropout off when
//! frozen, and the options it cannot honour rejected.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::store::ModuleRecord;
use burn::tensor::{Bool, Bytes, Device, Distribution, Gradients, Tensor, TensorData};
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoderConfig, ClusteredTransformerEncoderInput,
};

use crate::common::{autodiff, flex, ndarray, padding_mask};

const D_MODEL: usize = 32;
const D_FF: usize = 64;
const HEADS: usize = 4;
const LAYERS: usize = 2;

fn max_abs(a: Tensor<3>, b: Tensor<3>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

/// Panics, naming `what`, unless every value of `x` is finite.
fn assert_finite<const D: usize>(x: &Tensor<D>, what: &str) {
    let values: Vec<f32> = x.to_data().iter::<f32>().collect();
    let bad = values.iter().filter(|v| !v.is_finite()).count();
    assert!(
        bad == 0,
        "{what}: {bad} of {} values are not finite",
        values.len()
    );
}

/// `[batch, len, 1]`: 1 at the positions `< lengths[b]`, 0 at the padded ones.
fn padding_rows(lengths: &[usize], len: usize, device: &Device) -> Tensor<3> {
    let rows: Vec<f32> = lengths
        .iter()
        .flat_map(|&n| (0..len).map(move |i| if i < n { 1.0 } else { 0.0 }))
        .collect();
    Tensor::from_data(TensorData::new(rows, [lengths.len(), len, 1]), device)
}

/// `module`'s record as burnpack bytes: what `Module::save_file` writes.
fn record_bytes(module: impl Module) -> Bytes {
    module
        .into_record()
        .into_bytes()
        .expect("the record serializes")
}

fn record(bytes: &Bytes) -> ModuleRecord {
    ModuleRecord::from_bytes(bytes.clone()).expect("the record deserializes")
}

/// `[batch, len, len]`, true where key `j > i` (a causal mask).
fn causal_mask(batch: usize, len: usize, device: &Device) -> Tensor<3, Bool> {
    let mask: Vec<bool> = (0..batch * len * len)
        .map(|at| at % len > (at / len) % len)
        .collect();
    Tensor::from_data(TensorData::new(mask, [batch, len, len]), device)
}

/// burn-nn's encoder of `config` with its layer norms' scales and shifts drawn at random (a
/// fresh layer norm is the identity, which would hide one norm taken for the other).
fn burn_nn_encoder(config: &TransformerEncoderConfig, device: &Device) -> TransformerEncoder {
    let mut encoder = config.init(device);
    let d = config.d_model;
    let random = |low: f64, high: f64| {
        Param::from_tensor(Tensor::<1>::random(
            [d],
            Distribution::Uniform(low, high),
            device,
        ))
    };
    for layer in &mut encoder.layers {
        for norm in [&mut layer.norm_1, &mut layer.norm_2] {
            norm.gamma = random(0.5, 1.5);
            norm.beta = Some(random(-0.5, 0.5));
        }
    }
    encoder
}

fn burn_nn_config(norm_first: bool) -> TransformerEncoderConfig {
    TransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS).with_norm_first(norm_first)
}

fn config(attention: AttentionKind, norm_first: bool) -> ClusteredTransformerEncoderConfig {
    ClusteredTransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS, attention)
        .with_norm_first(norm_first)
}

/// `[batch, len, len]`: the causal mask of [`causal_mask`] with every key masked in the rows
/// `(b, i)` of `rows` (rows with nothing to attend to).
fn causal_mask_with_masked_rows(
    batch: usize,
    len: usize,
    rows: &[(usize, usize)],
    device: &Device,
) -> Tensor<3, Bool> {
    let mask: Vec<bool> = (0..batch * len * len)
        .map(|at| {
            let (b, i, j) = (at / (len * len), (at / len) % len, at % len);
            j > i || rows.contains(&(b, i))
        })
        .collect();
    Tensor::from_data(TensorData::new(mask, [batch, len, len]), device)
}

/// The masks of one comparison with burn-nn's encoder.
#[derive(Debug, Clone, Copy)]
enum Masks {
    None,
    Padding,
    Causal,
    /// A causal mask with rows that mask every key.
    FullyMaskedRows,
    /// A padding mask whose second sequence is all padding.
    EmptySequence,
}

/// Every float parameter's gradient in `grads`, by its module path
/// (`layers.0.mha.query.weight`), as host values.
pub(crate) fn parameter_gradients(
    module: &impl Module,
    grads: &Gradients,
) -> BTreeMap<String, Vec<f32>> {
    struct Collect<'a> {
        grads: &'a Gradients,
        path: Vec<String>,
        found: BTreeMap<String, Vec<f32>>,
    }
    impl ModuleVisitor for Collect<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let path = self.path.join(".");
            let grad = param
                .val()
                .grad(self.grads)
                .unwrap_or_else(|| panic!("no gradient at {path}"));
            let values = grad.into_data().iter::<f32>().collect();
            assert!(
                self.found.insert(path.clone(), values).is_none(),
                "two parameters at {path}"
            );
        }
    }
    let mut collect = Collect {
        grads,
        path: Vec::new(),
        found: BTreeMap::new(),
    };
    module.visit(&mut collect);
    collect.found
}

/// A burn-nn `TransformerEncoder` record loads into the encoder, which with full attention
/// computes what burn-nn's computes, outputs and every parameter's gradient to 1e-5 (relative
/// to the largest gradient where that is over 1): post- and pre-norm, softmax and quiet
/// softmax, without a mask, with a padding mask (at the valid positions: the loss weighs the
/// padded ones by 0), with a causal attention mask, with an attention mask whose rows mask
/// every key (burn-nn fills masked scores with its `min_float`, −10⁴, so such a row attends to
/// every key alike), and with a sequence that is all padding (compared at the other's valid
/// positions). Every output and gradient of ours is finite, padded rows included. The
/// encoder's record loads back into burn-nn's. Dropout 0 on both (the comparison runs on an
/// autodiff device).
fn matches_burn_nn(device: &Device) {
    let device = autodiff(device);
    let (batch, len) = (2, 12);
    let lengths = [len, 7];
    let x = Tensor::<3>::random([batch, len, D_MODEL], Distribution::Default, &device);
    let loss_weights = Tensor::<3>::random([batch, len, D_MODEL], Distribution::Default, &device);
    let valid_rows = padding_rows(&lengths, len, &device);
    for norm_first in [false, true] {
        for quiet_softmax in [false, true] {
            let nn_config = burn_nn_config(norm_first)
                .with_quiet_softmax(quiet_softmax)
                .with_dropout(0.0);
            let bytes = record_bytes(burn_nn_encoder(&nn_config, &device));
            let nn = nn_config.init(&device).load_record(record(&bytes));
            let ours = config(AttentionKind::Full, norm_first)
                .with_quiet_softmax(quiet_softmax)
                .with_dropout(0.0)
                .init(&device)
                .load_record(record(&bytes));
            for masks in [
                Masks::None,
                Masks::Padding,
                Masks::Causal,
                Masks::FullyMaskedRows,
                Masks::EmptySequence,
            ] {
                let case =
                    format!("norm_first {norm_first}, quiet_softmax {quiet_softmax}, {masks:?}");
                let nn_input = TransformerEncoderInput::new(x.clone());
                let our_input = ClusteredTransformerEncoderInput::new(x.clone());
                let (nn_input, our_input, rows) = match masks {
                    Masks::None => (nn_input, our_input, valid_rows.ones_like()),
                    Masks::Padding => {
                        let mask = padding_mask(&lengths, len, &device);
                        (
                            nn_input.mask_pad(mask.clone()),
                            our_input.mask_pad(mask),
                            valid_rows.clone(),
                        )
                    }
                    Masks::Causal => {
                        let mask = causal_mask(batch, len, &device);
                        (
                            nn_input.mask_attn(mask.clone()),
                            our_input.mask_attn(mask),
                            valid_rows.ones_like(),
                        )
                    }
                    Masks::FullyMaskedRows => {
                        let rows = [(0, 0), (0, 5), (1, 3), (1, len - 1)];
                        let mask = causal_mask_with_masked_rows(batch, len, &rows, &device);
                        (
                            nn_input.mask_attn(mask.clone()),
                            our_input.mask_attn(mask),
                            valid_rows.ones_like(),
                        )
                    }
                    Masks::EmptySequence => {
                        let mask = padding_mask(&[len, 0], len, &device);
                        (
                            nn_input.mask_pad(mask.clone()),
                            our_input.mask_pad(mask),
                            padding_rows(&[len, 0], len, &device),
                        )
                    }
                };
                let expected = nn.forward(nn_input) * rows.clone();
                let actual = ours.forward(our_input);
                assert_finite(&actual, &format!("{case}: our output"));
                let actual = actual * rows;
                let diff = max_abs(expected.clone(), actual.clone());
                assert!(diff <= 1e-5, "{case}: outputs {diff} apart");

                let nn_grads =
                    parameter_gradients(&nn, &(expected * loss_weights.clone()).sum().backward());
                let our_grads =
                    parameter_gradients(&ours, &(actual * loss_weights.clone()).sum().backward());
                assert_eq!(
                    nn_grads.keys().collect::<Vec<_>>(),
                    our_grads.keys().collect::<Vec<_>>(),
                    "{case}: the parameters differ"
                );
                for (path, expected) in &nn_grads {
                    let actual = &our_grads[path];
                    assert!(
                        actual.iter().all(|g| g.is_finite()),
                        "{case}: the gradient of {path} is not finite"
                    );
                    let largest = expected.iter().fold(1f32, |m, g| m.max(g.abs()));
                    let diff = expected
                        .iter()
                        .zip(actual)
                        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        diff <= 1e-5 * largest,
                        "{case}: the gradients of {path} are {diff} apart (largest {largest})"
                    );
                }
            }

            let back = nn_config
                .init(&device)
                .load_record(record(&record_bytes(ours.clone())));
            let diff = max_abs(
                back.forward(TransformerEncoderInput::new(x.clone())),
                ours.forward(ClusteredTransformerEncoderInput::new(x.clone())),
            );
            assert!(
                diff <= 1e-5,
                "norm_first {norm_first}, quiet_softmax {quiet_softmax}, loaded back: {diff}"
            );
        }
    }
}

#[test]
fn matches_burn_nn_on_ndarray() {
    matches_burn_nn(&ndarray());
}

#[test]
fn matches_burn_nn_on_flex() {
    matches_burn_nn(&flex());
}

#[cfg(feature = "wgpu")]
#[test]
fn matches_burn_nn_on_wgpu() {
    matches_burn_nn(&crate::common::wgpu());
}

/// A batch with a sequence that is all padding, on every kind the encoder trains with: the
/// other sequence's rows are those it gets alone (to 1e-5), the empty sequence's rows are
/// finite and equal (to 1e-5) the encoder computed with burn-nn's modules and a zero
/// attention output before the output projection (so the projection's bias), and every
/// parameter's and the input's gradient is finite. Dropout 0, on an autodiff device.
fn empty_sequence_is_finite(device: &Device) {
    let device = autodiff(device);
    let len = 9;
    let kinds = [
        AttentionKind::Full,
        AttentionKind::Clustered { clusters: 3 },
        AttentionKind::Improved {
            clusters: 3,
            topk: 2,
        },
    ];
    for norm_first in [false, true] {
        for kind in kinds {
            let case = format!("{kind}, norm_first {norm_first}");
            let encoder = config(kind, norm_first).with_dropout(0.0).init(&device);
            let x = Tensor::<3>::random([2, len, D_MODEL], Distribution::Default, &device)
                .require_grad();
            let mask = padding_mask(&[len, 0], len, &device);
            let output =
                encoder.forward(ClusteredTransformerEncoderInput::new(x.clone()).mask_pad(mask));
            assert_finite(&output, &format!("{case}: output"));

            let alone = encoder.forward(ClusteredTransformerEncoderInput::new(
                x.clone().narrow(0, 0, 1).detach(),
            ));
            let diff = max_abs(output.clone().narrow(0, 0, 1), alone);
            assert!(
                diff <= 1e-5,
                "{case}: the full sequence is {diff} off its rows alone"
            );

            // The empty sequence through burn-nn's layer norms and feed-forward networks, each
            // layer's attention sub-layer giving the output projection's bias alone.
            let mut expected = x.clone().narrow(0, 1, 1).detach();
            for layer in &encoder.layers {
                let bias = layer
                    .mha
                    .output
                    .bias
                    .as_ref()
                    .expect("the output projection has a bias")
                    .val()
                    .reshape([1, 1, D_MODEL]);
                let mut y = expected + bias;
                y = if norm_first {
                    y.clone() + layer.pwff.forward(layer.norm_1.forward(y))
                } else {
                    let y = layer.norm_1.forward(y);
                    layer.norm_2.forward(y.clone() + layer.pwff.forward(y))
                };
                expected = y;
            }
            let diff = max_abs(output.clone().narrow(0, 1, 1), expected);
            assert!(
                diff <= 1e-5,
                "{case}: the empty sequence is {diff} off its reference"
            );

            let weights = Tensor::<3>::random([2, len, D_MODEL], Distribution::Default, &device);
            let grads = (output * weights).sum().backward();
            for (path, values) in parameter_gradients(&encoder, &grads) {
                assert!(
                    values.iter().all(|g| g.is_finite()),
                    "{case}: the gradient of {path} is not finite"
                );
            }
            let input_grad = x.grad(&grads).expect("the input has a gradient");
            assert_finite(&input_grad, &format!("{case}: the input's gradient"));
        }
    }
}

#[test]
fn empty_sequence_is_finite_on_ndarray() {
    empty_sequence_is_finite(&ndarray());
}

#[test]
fn empty_sequence_is_finite_on_flex() {
    empty_sequence_is_finite(&flex());
}

#[cfg(feature = "wgpu")]
#[test]
fn empty_sequence_is_finite_on_wgpu() {
    empty_sequence_is_finite(&crate::common::wgpu());
}

/// `with_attention` swaps every layer's attention on the same weights: improved attention with
/// as many clusters as positions and top-k over every key is full attention (to 1e-5); with 3
/// clusters, in either layer, the output moves.
#[test]
fn with_attention_swaps_every_layer() {
    let device = ndarray();
    let len = 16;
    let encoder = config(AttentionKind::Full, false).init(&device);
    let encoder = encoder.clone().load_record(record(&record_bytes(encoder)));
    let x = Tensor::<3>::random([2, len, D_MODEL], Distribution::Default, &device);
    let forward = |kind| {
        encoder
            .clone()
            .with_attention(kind)
            .forward(ClusteredTransformerEncoderInput::new(x.clone()))
    };
    let full = forward(AttentionKind::Full);
    let exact = forward(AttentionKind::Improved {
        clusters: len,
        topk: len,
    });
    let diff = max_abs(full.clone(), exact);
    assert!(diff <= 1e-5, "improved in its exact regime: {diff}");
    let clustered = encoder
        .clone()
        .with_attention(AttentionKind::Clustered { clusters: 3 });
    for layer in &clustered.layers {
        assert_eq!(
            layer.mha.attention,
            AttentionKind::Clustered { clusters: 3 }
        );
    }
    let diff = max_abs(
        full,
        clustered.forward(ClusteredTransformerEncoderInput::new(x)),
    );
    assert!(diff > 1e-3, "3 clusters should change the output: {diff}");
}

/// As burn-nn's encoder, the encoder drops out only while training on an autodiff device:
/// unfrozen there, dropout 0.5 moves its output off the same weights' without dropout by more
/// than 1e-2; frozen (`Module::freeze`) it equals them to 1e-6, and so does burn-nn's frozen
/// encoder loaded with the same record.
#[test]
fn frozen_encoder_applies_no_dropout() {
    let device = autodiff(&flex());
    let len = 10;
    let x = Tensor::<3>::random([2, len, D_MODEL], Distribution::Default, &device);
    let input = || ClusteredTransformerEncoderInput::new(x.clone());
    let kind = AttentionKind::Improved {
        clusters: 4,
        topk: 4,
    };
    let bytes = record_bytes(config(kind, false).init(&device));
    let with_dropout = |dropout: f64| {
        config(kind, false)
            .with_dropout(dropout)
            .init(&device)
            .load_record(record(&bytes))
    };
    let without = with_dropout(0.0).forward(input());
    let training = with_dropout(0.5);
    let dropped = max_abs(training.forward(input()), without.clone());
    assert!(dropped > 1e-2, "dropout 0.5 moved the output by {dropped}");
    let diff = max_abs(training.freeze().forward(input()), without);
    assert!(diff <= 1e-6, "the frozen encoder is {diff} off no dropout");

    let nn = |dropout: f64| {
        burn_nn_config(false)
            .with_dropout(dropout)
            .init(&device)
            .load_record(record(&bytes))
    };
    let nn_input = || TransformerEncoderInput::new(x.clone());
    let diff = max_abs(
        nn(0.5).freeze().forward(nn_input()),
        nn(0.0).forward(nn_input()),
    );
    assert!(
        diff <= 1e-6,
        "burn-nn's frozen encoder is {diff} off no dropout"
    );
}

/// An attention mask with a clustered attention is refused, naming the option.
#[test]
#[should_panic(expected = "mask_attn [2, 8, 8] needs full attention")]
fn mask_attn_needs_full_attention() {
    let device = ndarray();
    let encoder = config(AttentionKind::Clustered { clusters: 2 }, false).init(&device);
    let x = Tensor::<3>::random([2, 8, D_MODEL], Distribution::Default, &device);
    encoder.forward(ClusteredTransformerEncoderInput::new(x).mask_attn(causal_mask(2, 8, &device)));
}

/// The quiet softmax with a clustered attention is refused at `init`, naming the option, and
/// so is the swap to one of an encoder that has it.
#[test]
#[should_panic(expected = "quiet_softmax = true needs full attention: clustered:4")]
fn quiet_softmax_needs_full_attention() {
    config(AttentionKind::Clustered { clusters: 4 }, false)
        .with_quiet_softmax(true)
        .init(&ndarray());
}

/// As [`quiet_softmax_needs_full_attention`], on `with_attention`.
#[test]
#[should_panic(expected = "quiet_softmax = true needs full attention: improved:4:4")]
fn quiet_softmax_stays_on_full_attention() {
    config(AttentionKind::Full, false)
        .with_quiet_softmax(true)
        .init(&ndarray())
        .with_attention(AttentionKind::Improved {
            clusters: 4,
            topk: 4,
        });
}
