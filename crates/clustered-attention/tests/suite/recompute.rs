//! The encoder's dropout on activations (counter-based, drawn again in the backward pass) and
//! its layers recomputed in the backward pass, against the encoder that keeps everything.

use burn::module::Module;
use burn::tensor::{Device, Distribution, Tensor};
use clustered_attention::dropout::AttentionDropout;
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoderConfig, ClusteredTransformerEncoderInput, ops,
    with_dropout_seed,
};

use crate::common::{autodiff, flex, ndarray, padding_mask};
use crate::encoder::parameter_gradients;

/// Host values of a tensor.
fn host<const D: usize>(x: Tensor<D>) -> Vec<f32> {
    x.into_data().iter::<f32>().collect()
}

/// The largest difference of `a` and `b`, relative to the largest magnitude of `a` where that
/// is over 1.
fn relative_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let largest = a.iter().fold(1f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / largest
}

/// The activation dropout's mask, forward and backward, against the scalar Philox of
/// [`AttentionDropout::factor`] on `[column / 8, row, 0, stream]`: the forward's factors
/// (`y / x`, `x` in `[0.5, 1.5)`) are the reference's to 1e-6, the input's gradient of
/// `sum(y ⊙ w)` is `w` times the same factors to 1e-6 (a backward that drew another counter
/// or seed would give other factors), and the kept fraction is within 4 standard errors of
/// `1 − p`.
fn activation_dropout_is_drawn_again(device: &Device) {
    let device = autodiff(device);
    let (batch, len, features) = (4, 256, 72);
    let dropout = AttentionDropout::new(0.1, 0x1234_5678_9ABC);
    let stream = AttentionDropout::ACTIVATIONS;
    let x = (Tensor::<3>::random([batch, len, features], Distribution::Default, &device) + 0.5)
        .require_grad();
    let w = Tensor::<3>::random([batch, len, features], Distribution::Default, &device);
    let y = ops::activation_dropout(x.clone(), dropout, stream);
    let grads = (y.clone() * w.clone()).sum().backward();
    let dx = host(x.grad(&grads).expect("the input's gradient"));
    let (x, y, w) = (host(x), host(y), host(w));
    let mut kept = 0usize;
    for (i, ((&x, &y), (&w, &dx))) in x.iter().zip(&y).zip(w.iter().zip(&dx)).enumerate() {
        let (row, column) = ((i / features) as u32, (i % features) as u32);
        let factor = dropout.factor(stream, 0, row, column);
        kept += usize::from(factor != 0.0);
        assert!(
            (y / x - factor).abs() <= 1e-6 * factor.max(1.0),
            "forward at row {row}, column {column}: factor {} where Philox gives {factor}",
            y / x
        );
        assert!(
            (dx - w * factor).abs() <= 1e-6 * factor.max(1.0),
            "backward at row {row}, column {column}: {dx} where the forward's mask gives {}",
            w * factor
        );
    }
    let n = x.len() as f64;
    let p = dropout.prob;
    let error = (p * (1.0 - p) / n).sqrt();
    let fraction = kept as f64 / n;
    assert!(
        (fraction - (1.0 - p)).abs() <= 4.0 * error,
        "kept {fraction} of {n}, expected {} ± {}",
        1.0 - p,
        4.0 * error
    );
}

#[test]
fn activation_dropout_is_drawn_again_on_ndarray() {
    activation_dropout_is_drawn_again(&ndarray());
}

#[test]
fn activation_dropout_is_drawn_again_on_flex() {
    activation_dropout_is_drawn_again(&flex());
}

#[cfg(feature = "wgpu")]
#[test]
fn activation_dropout_is_drawn_again_on_wgpu() {
    activation_dropout_is_drawn_again(&crate::common::wgpu());
}

/// An encoder with every layer recomputed in the backward pass computes what the same encoder
/// (the same record) keeping its activations computes: the outputs, the input's gradient and
/// every parameter's gradient to 1e-5 (relative to the largest where that is over 1), with a
/// padding mask, post- and pre-norm, dropout 0 and 0.1 (under one `with_dropout_seed`, so both
/// draw the same seeds; with 0.1 the output differs from dropout 0's, so the masks were
/// applied), improved clustered attention.
fn recomputed_layers_match(device: &Device) {
    let device = autodiff(device);
    let (batch, len, d_model) = (2, 24, 32);
    let lengths = [len, 17];
    let kind = AttentionKind::Improved {
        clusters: 4,
        topk: 6,
    };
    let x = Tensor::<3>::random([batch, len, d_model], Distribution::Default, &device);
    let loss_weights = Tensor::<3>::random([batch, len, d_model], Distribution::Default, &device);
    let mask = padding_mask(&lengths, len, &device);
    for norm_first in [false, true] {
        let mut without_dropout = None;
        for dropout in [0.0, 0.1] {
            let config = ClusteredTransformerEncoderConfig::new(d_model, 64, 4, 3, kind)
                .with_norm_first(norm_first)
                .with_dropout(dropout);
            let kept = config.init(&device);
            let recomputed = config
                .clone()
                .with_recompute_layers(3)
                .init(&device)
                .load_record(kept.clone().into_record());
            let case = format!("norm_first {norm_first}, dropout {dropout}");
            let run = |encoder: &clustered_attention::ClusteredTransformerEncoder| {
                let x = x.clone().require_grad();
                let input = ClusteredTransformerEncoderInput::new(x.clone()).mask_pad(mask.clone());
                let y = with_dropout_seed(11, || encoder.forward(input));
                let grads = (y.clone() * loss_weights.clone()).sum().backward();
                let dx = host(x.grad(&grads).expect("the input's gradient"));
                (host(y), dx, parameter_gradients(encoder, &grads))
            };
            let (y, dx, params) = run(&kept);
            let (y_re, dx_re, params_re) = run(&recomputed);
            let diff = relative_diff(&y, &y_re);
            assert!(diff <= 1e-5, "{case}: outputs {diff} apart");
            let diff = relative_diff(&dx, &dx_re);
            assert!(diff <= 1e-5, "{case}: the input's gradients {diff} apart");
            assert_eq!(params.len(), params_re.len(), "{case}: parameters");
            for (path, grad) in &params {
                let diff = relative_diff(grad, &params_re[path]);
                assert!(
                    diff <= 1e-5,
                    "{case}: the gradients of {path} are {diff} apart"
                );
            }
            match &without_dropout {
                None => without_dropout = Some(y),
                Some(plain) => {
                    let moved = relative_diff(plain, &y);
                    assert!(moved > 1e-2, "{case}: dropout moved the output by {moved}");
                }
            }
        }
    }
}

#[test]
fn recomputed_layers_match_on_ndarray() {
    recomputed_layers_match(&ndarray());
}

#[test]
fn recomputed_layers_match_on_flex() {
    recomputed_layers_match(&flex());
}

#[cfg(feature = "wgpu")]
#[test]
fn recomputed_layers_match_on_wgpu() {
    recomputed_layers_match(&crate::common::wgpu());
}

/// Recomputing more layers than there are is refused, naming both counts.
#[test]
#[should_panic(expected = "recompute_layers = 3 exceeds n_layers = 2")]
fn recompute_layers_beyond_the_layers_are_refused() {
    ClusteredTransformerEncoderConfig::new(8, 16, 2, 2, AttentionKind::Full)
        .with_recompute_layers(3)
        .init(&flex());
}

/// Recomputation with burn-nn's stored dropout masks (which a second forward pass cannot draw
/// again) is refused.
#[test]
#[should_panic(expected = "recompute_layers = 1 needs the counter-based dropout")]
fn recompute_with_stored_dropout_masks_is_refused() {
    ClusteredTransformerEncoderConfig::new(8, 16, 2, 2, AttentionKind::Full)
        .with_recompute_layers(1)
        .with_stored_dropout_masks(true)
        .init(&flex());
}
