//! The multi-head layer: burn-nn record compatibility and swapping the attention kind.

use burn::module::Module;
use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::{Bool, Distribution, Tensor, TensorData};
use clustered_attention::{AttentionKind, ClusteredAttentionConfig, ClusteredAttentionInput};

use crate::common::NdArrayBackend as B;

fn max_abs(a: Tensor<B, 3>, b: Tensor<B, 3>) -> f32 {
    (a - b).abs().max().into_scalar()
}

/// Draws the lazily initialized weights now, so that clones share them.
fn materialize(linears: &[&burn::nn::Linear<B>]) {
    for linear in linears {
        linear.weight.val();
        if let Some(bias) = &linear.bias {
            bias.val();
        }
    }
}

fn padding_mask(batch_lengths: &[usize], len: usize) -> Tensor<B, 2, Bool> {
    let mask: Vec<bool> = batch_lengths
        .iter()
        .flat_map(|&n| (0..len).map(move |i| i >= n))
        .collect();
    Tensor::from_data(
        TensorData::new(mask, [batch_lengths.len(), len]),
        &Default::default(),
    )
}

/// A burn-nn `MultiHeadAttention` record loads into the layer (and back), and with the `Full`
/// kind both give the same output to 1e-5, with and without a padding mask.
#[test]
fn burn_nn_record_round_trip() {
    let device = Default::default();
    let (d_model, n_heads, len) = (32, 4, 11);
    let mha = MultiHeadAttentionConfig::new(d_model, n_heads).init::<B>(&device);
    // Burn initializes parameters lazily, and the clones of an uninitialized parameter each
    // draw their own values: materialize them before cloning.
    materialize(&[&mha.query, &mha.key, &mha.value, &mha.output]);
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(mha.clone().into_record(), ()).unwrap();
    let layer = ClusteredAttentionConfig::new(d_model, n_heads, AttentionKind::Full)
        .with_seed(1)
        .init::<B>(&device)
        .load_record(recorder.load(bytes, &device).unwrap());

    let x = Tensor::<B, 3>::random([2, len, d_model], Distribution::Default, &device);
    let diff = max_abs(
        mha.forward(MhaInput::self_attn(x.clone())).context,
        layer.forward(ClusteredAttentionInput::self_attn(x.clone())),
    );
    assert!(diff <= 1e-5, "unmasked: {diff}");

    // Padding: keys past each length are masked in both; compare the valid query rows.
    let mask = padding_mask(&[len, 7], len);
    let expected = mha
        .forward(MhaInput::self_attn(x.clone()).mask_pad(mask.clone()))
        .context;
    let actual = layer.forward(ClusteredAttentionInput::self_attn(x.clone()).mask_pad(mask));
    for (b, valid) in [(0, len), (1, 7)] {
        let diff = max_abs(
            expected.clone().slice([b..b + 1, 0..valid]),
            actual.clone().slice([b..b + 1, 0..valid]),
        );
        assert!(diff <= 1e-5, "masked, batch item {b}: {diff}");
    }

    // And back: the layer's record loads into burn-nn's module.
    let bytes = recorder.record(layer.clone().into_record(), ()).unwrap();
    let mha2 = MultiHeadAttentionConfig::new(d_model, n_heads)
        .init::<B>(&device)
        .load_record(recorder.load(bytes, &device).unwrap());
    let diff = max_abs(
        mha2.forward(MhaInput::self_attn(x.clone())).context,
        layer.forward(ClusteredAttentionInput::self_attn(x)),
    );
    assert!(diff <= 1e-5, "round trip: {diff}");
}

/// Swapping the kind keeps the weights: improved attention with topk ≥ S and clustered
/// attention with clusters ≥ L reproduce the full layer; a small C changes the output.
#[test]
fn swap_attention_kind_keeps_weights() {
    let device = Default::default();
    let len = 20;
    let layer = ClusteredAttentionConfig::new(16, 2, AttentionKind::Clustered { clusters: 3 })
        .init::<B>(&device);
    materialize(&[&layer.query, &layer.key, &layer.value, &layer.output]);
    let x = Tensor::<B, 3>::random([2, len, 16], Distribution::Default, &device);
    let lengths = Tensor::from_data(TensorData::new(vec![20i64, 13], [2]), &device);
    let forward = |kind| {
        layer
            .clone()
            .with_attention(kind)
            .forward(ClusteredAttentionInput::self_attn(x.clone()).key_lengths(lengths.clone()))
    };
    let full = forward(AttentionKind::Full);
    for kind in [
        AttentionKind::Improved {
            clusters: 2,
            topk: len,
        },
        AttentionKind::Clustered { clusters: len },
        AttentionKind::Improved {
            clusters: len,
            topk: 1,
        },
    ] {
        let diff = max_abs(full.clone(), forward(kind));
        assert!(diff <= 1e-5, "{kind}: {diff}");
    }
    let diff = max_abs(full, forward(AttentionKind::Clustered { clusters: 3 }));
    assert!(
        diff > 1e-3,
        "three clusters should not reproduce full attention ({diff})"
    );
}

#[test]
fn attention_kind_parses_and_prints() {
    for text in [
        "full",
        "clustered:100",
        "improved:100:32",
        "shared-full",
        "lsh:4",
        "lsh:1:64",
        "oracle:32",
    ] {
        let kind: AttentionKind = text.parse().unwrap();
        assert_eq!(kind.to_string(), text);
    }
    assert_eq!(
        "improved:8:4".parse::<AttentionKind>().unwrap(),
        AttentionKind::Improved {
            clusters: 8,
            topk: 4
        }
    );
    for bad in [
        "",
        "clustered",
        "clustered:0",
        "improved:5",
        "improved:5:0",
        "sparse:3",
        "lsh",
        "lsh:0",
        "lsh:2:0",
        "oracle:0",
        "shared-full:3",
    ] {
        assert!(
            bad.parse::<AttentionKind>().is_err(),
            "{bad:?} should not parse"
        );
    }
}

#[test]
#[should_panic(
    expected = "mask_pad [1, 4] must mask a suffix of each row (padding); row 0 unmasks a position after a masked one"
)]
fn mask_pad_must_be_padding() {
    let device = Default::default();
    let layer = ClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init::<B>(&device);
    let x = Tensor::<B, 3>::zeros([1, 4, 8], &device);
    let mask = Tensor::<B, 2, Bool>::from_data(
        TensorData::new(vec![false, true, false, true], [1, 4]),
        &device,
    );
    layer.forward(ClusteredAttentionInput::self_attn(x).mask_pad(mask));
}

#[test]
#[should_panic(expected = "give either mask_pad [1, 4] or key_lengths [1], not both")]
fn mask_pad_and_key_lengths_conflict() {
    let device = Default::default();
    let layer = ClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init::<B>(&device);
    let x = Tensor::<B, 3>::zeros([1, 4, 8], &device);
    let mask = Tensor::<B, 2, Bool>::from_data(
        TensorData::new(vec![false, false, true, true], [1, 4]),
        &device,
    );
    let lengths = Tensor::from_data(TensorData::new(vec![2i64], [1]), &device);
    layer.forward(
        ClusteredAttentionInput::self_attn(x)
            .mask_pad(mask)
            .key_lengths(lengths),
    );
}

#[test]
#[should_panic(
    expected = "lsh:4 needs a layer trained with shared queries and keys; this one was created with full"
)]
fn shared_qk_kind_needs_shared_layer() {
    let device = Default::default();
    let layer = ClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init::<B>(&device);
    let _ = layer.with_attention("lsh:4".parse().unwrap());
}

/// A shared-QK layer computes its keys with the query projection, normalised, whatever kind
/// it switches to: its full attention equals the functional full attention on those keys, and
/// its shared-full the functional shared-full.
#[test]
fn shared_qk_layer_uses_query_projection() {
    use clustered_attention::{AttentionOptions, full_attention, shared_full_attention};
    let device = Default::default();
    let layer = ClusteredAttentionConfig::new(16, 2, AttentionKind::SharedFull)
        .with_dropout(0.0)
        .init::<B>(&device);
    materialize(&[&layer.query, &layer.key, &layer.value, &layer.output]);
    assert!(layer.shared_qk);
    let x = Tensor::<B, 3>::random([2, 9, 16], Distribution::Default, &device);
    let heads = |linear: &burn::nn::Linear<B>| {
        linear
            .forward(x.clone())
            .reshape([2, 9, 2, 8])
            .swap_dims(1, 2)
    };
    let queries = heads(&layer.query);
    let norms = queries.clone().square().sum_dim(3).sqrt();
    let keys = queries.clone() / norms;
    let values = heads(&layer.value);
    let merge = |context: Tensor<B, 4>| {
        layer
            .output
            .forward(context.swap_dims(1, 2).reshape([2, 9, 16]))
    };
    let options = AttentionOptions::new();
    let expected_shared = merge(shared_full_attention(
        queries.clone(),
        keys.clone(),
        values.clone(),
        None,
        None,
        &options,
    ));
    let expected_full = merge(full_attention(queries, keys, values, None, None, &options));
    let shared = layer
        .clone()
        .forward(ClusteredAttentionInput::self_attn(x.clone()));
    let full = layer
        .with_attention(AttentionKind::Full)
        .forward(ClusteredAttentionInput::self_attn(x));
    assert!(max_abs(shared, expected_shared) <= 1e-5);
    assert!(max_abs(full, expected_full) <= 1e-5);
}
