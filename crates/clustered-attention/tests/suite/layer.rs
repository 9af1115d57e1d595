//! The multi-head layer: burn-nn record compatibility and swapping the attention kind.

use burn::module::Module;
use burn::nn::DropoutConfig;
use burn::nn::attention::{MhaInput, MultiHeadAttentionConfig};
use burn::store::ModuleRecord;
use burn::tensor::{Bool, Device, Distribution, Tensor, TensorData};
use clustered_attention::{
    AttentionKind, ClusteredAttentionInput, MultiHeadClusteredAttention,
    MultiHeadClusteredAttentionConfig,
};

use crate::common::{Host4, autodiff, dot, flex, host_ints, ndarray, padding_mask, softmax};

fn max_abs(a: Tensor<3>, b: Tensor<3>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

/// `module`'s record (`Module::into_record`) through its burnpack bytes and back: what a file
/// written with `Module::save_file` holds (Burn 0.22 has no `Recorder`s).
fn through_bytes(module: impl Module) -> ModuleRecord {
    let bytes = module
        .into_record()
        .into_bytes()
        .expect("the record serializes");
    ModuleRecord::from_bytes(bytes).expect("the record deserializes")
}

/// Draws the lazily initialized weights now, so that clones share them.
fn materialize(linears: &[&burn::nn::Linear]) {
    for linear in linears {
        linear.weight.val();
        if let Some(bias) = &linear.bias {
            bias.val();
        }
    }
}

/// A burn-nn `MultiHeadAttention` record (serialized to burnpack bytes) loads into the layer
/// (and back), and with the `Full` kind both give the same output to 1e-5, with and without a
/// padding mask.
#[test]
fn burn_nn_record_round_trip() {
    let device = ndarray();
    let (d_model, n_heads, len) = (32, 4, 11);
    let mha = MultiHeadAttentionConfig::new(d_model, n_heads).init(&device);
    // Burn initializes parameters lazily, and the clones of an uninitialized parameter each
    // draw their own values: materialize them before cloning.
    materialize(&[&mha.query, &mha.key, &mha.value, &mha.output]);
    let layer = MultiHeadClusteredAttentionConfig::new(d_model, n_heads, AttentionKind::Full)
        .with_seed(1)
        .init(&device)
        .load_record(through_bytes(mha.clone()));

    let x = Tensor::<3>::random([2, len, d_model], Distribution::Default, &device);
    let diff = max_abs(
        mha.forward(MhaInput::self_attn(x.clone())).context,
        layer.forward(ClusteredAttentionInput::self_attn(x.clone())),
    );
    assert!(diff <= 1e-5, "unmasked: {diff}");

    // Padding: keys past each length are masked in both; compare the valid query rows.
    let mask = padding_mask(&[len, 7], len, &device);
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
    let mha2 = MultiHeadAttentionConfig::new(d_model, n_heads)
        .init(&device)
        .load_record(through_bytes(layer.clone()));
    let diff = max_abs(
        mha2.forward(MhaInput::self_attn(x.clone())).context,
        layer.forward(ClusteredAttentionInput::self_attn(x)),
    );
    assert!(diff <= 1e-5, "round trip: {diff}");
}

/// Swapping the kind keeps the weights: the full kind, improved attention with topk ≥ S and
/// clustered attention with clusters ≥ L reproduce burn-nn's multi-head attention loaded with
/// the layer's weights (keys past each length masked; padded queries give the output bias); a
/// small C changes the output.
#[test]
fn swap_attention_kind_keeps_weights() {
    let device = ndarray();
    let len = 20;
    let layer =
        MultiHeadClusteredAttentionConfig::new(16, 2, AttentionKind::Clustered { clusters: 3 })
            .init(&device);
    materialize(&[&layer.query, &layer.key, &layer.value, &layer.output]);
    let x = Tensor::<3>::random([2, len, 16], Distribution::Default, &device);
    let lengths = Tensor::from_data(TensorData::new(vec![20i64, 13], [2]), &device);
    let forward = |kind| {
        layer
            .clone()
            .with_attention(kind)
            .forward(ClusteredAttentionInput::self_attn(x.clone()).key_lengths(lengths.clone()))
    };
    let mha = MultiHeadAttentionConfig::new(16, 2)
        .init(&device)
        .load_record(through_bytes(layer.clone()));
    let full = mha
        .forward(MhaInput::self_attn(x.clone()).mask_pad(padding_mask(&[20, 13], len, &device)))
        .context;
    // In self-attention the key lengths also mark the padded queries, whose context is zero:
    // their output rows are the output projection's bias (burn-nn computes them as queries).
    let bias = layer.output.bias.as_ref().expect("a bias").val();
    let full = full.slice_assign(
        [1..2, 13..len, 0..16],
        bias.reshape([1, 1, 16]).repeat_dim(1, len - 13),
    );
    for kind in [
        AttentionKind::Full,
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
        "blocks:50",
        "improved-blocks:50:16",
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
        "blocks:0",
        "improved-blocks:4",
        "improved-blocks:0:3",
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
    let device = ndarray();
    let layer = MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init(&device);
    let x = Tensor::<3>::zeros([1, 4, 8], &device);
    let mask = Tensor::<2, Bool>::from_data(
        TensorData::new(vec![false, true, false, true], [1, 4]),
        &device,
    );
    layer.forward(ClusteredAttentionInput::self_attn(x).mask_pad(mask));
}

#[test]
#[should_panic(expected = "give either mask_pad [1, 4] or key_lengths [1], not both")]
fn mask_pad_and_key_lengths_conflict() {
    let device = ndarray();
    let layer = MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init(&device);
    let x = Tensor::<3>::zeros([1, 4, 8], &device);
    let mask = Tensor::<2, Bool>::from_data(
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

/// A layer frozen with `Module::freeze` on an autodiff device applies no dropout, as burn-nn's
/// `Dropout` frozen there applies none: its output is the same weights' without dropout, to
/// 1e-6, for full and improved attention on Flex; unfrozen (before, and after
/// `Module::unfreeze`) the dropout of 0.5 moves it by more than 1e-2, and burn-nn's moves its
/// input.
#[test]
fn frozen_layer_applies_no_dropout() {
    let device = autodiff(&flex());
    let (d_model, n_heads, len) = (32, 4, 40);
    let x = Tensor::<3>::random([2, len, d_model], Distribution::Default, &device);
    let input = || ClusteredAttentionInput::self_attn(x.clone());
    let kinds = [
        AttentionKind::Full,
        AttentionKind::Improved {
            clusters: 8,
            topk: 4,
        },
    ];
    for kind in kinds {
        let layer = MultiHeadClusteredAttentionConfig::new(d_model, n_heads, kind)
            .with_dropout(0.5)
            .with_seed(1)
            .init(&device);
        materialize(&[&layer.query, &layer.key, &layer.value, &layer.output]);
        let without = MultiHeadClusteredAttention {
            dropout: 0.0,
            ..layer.clone()
        }
        .forward(input());
        let dropped = max_abs(layer.clone().forward(input()), without.clone());
        assert!(
            dropped > 1e-2,
            "{kind}: dropout 0.5 moved the output by {dropped}"
        );
        let frozen = layer.freeze();
        assert!(
            !frozen.training.is_enabled(),
            "{kind}: freeze keeps training"
        );
        let diff = max_abs(frozen.clone().forward(input()), without.clone());
        assert!(
            diff <= 1e-6,
            "{kind}: the frozen layer is {diff} off no dropout"
        );
        let dropped = max_abs(frozen.unfreeze().forward(input()), without);
        assert!(
            dropped > 1e-2,
            "{kind}: unfrozen, dropout moved it by {dropped}"
        );
    }
    let dropout = DropoutConfig::new(0.5).init();
    let moved = max_abs(dropout.clone().forward(x.clone()), x.clone());
    assert!(moved > 1e-2, "burn-nn's dropout moved its input by {moved}");
    let kept = max_abs(dropout.freeze().forward(x.clone()), x);
    assert_eq!(
        kept, 0.0,
        "burn-nn's frozen dropout moved its input by {kept}"
    );
}

/// Self-attention given key lengths alone takes them as its query lengths too; a key length
/// past the sequence is named as the argument it was given as.
#[test]
#[should_panic(expected = "key_lengths[0] = 5 is outside 0..=4 (the sequence length)")]
fn self_attention_names_a_bad_key_length() {
    let device = ndarray();
    let layer = MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init(&device);
    let x = Tensor::<3>::zeros([1, 4, 8], &device);
    let lengths = Tensor::from_data(TensorData::new(vec![5i64], [1]), &device);
    layer.forward(ClusteredAttentionInput::self_attn(x).key_lengths(lengths));
}

#[test]
#[should_panic(
    expected = "lsh:4 needs a layer trained with shared queries and keys; this one was created with full"
)]
fn shared_qk_kind_needs_shared_layer() {
    let device = ndarray();
    let layer = MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init(&device);
    let _ = layer.with_attention("lsh:4".parse().unwrap());
}

/// Softmax attention of every query over every key, in `f64` on the host, scores scaled by
/// `1/√E`; with `shared`, each query's own key scores −10⁴ (Reformer's shared-QK rule). On
/// `device`.
fn attention_f64(q: &Host4, k: &Host4, v: &Host4, shared: bool, device: &Device) -> Tensor<4> {
    let [batch, heads, len, dim] = q.dims;
    let scale = 1.0 / (dim as f64).sqrt();
    let mut out = Vec::new();
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..len {
                let scores: Vec<f64> = (0..len)
                    .map(|j| {
                        if shared && i == j {
                            -1e4
                        } else {
                            scale * dot(&q.row(b, h, i), &k.row(b, h, j))
                        }
                    })
                    .collect();
                let weights = softmax(&scores);
                for d in 0..v.dims[3] {
                    out.push((0..len).map(|j| weights[j] * v.at(b, h, j, d)).sum::<f64>() as f32);
                }
            }
        }
    }
    Tensor::from_data(TensorData::new(out, [batch, heads, len, v.dims[3]]), device)
}

/// A shared-QK layer computes its keys with the query projection, normalised, whatever kind
/// it switches to: its full attention and its shared-full equal softmax attention in `f64`
/// on those keys, the latter with each query's own key masked.
#[test]
fn shared_qk_layer_uses_query_projection() {
    let device = ndarray();
    let layer = MultiHeadClusteredAttentionConfig::new(16, 2, AttentionKind::SharedFull)
        .with_dropout(0.0)
        .init(&device);
    materialize(&[&layer.query, &layer.key, &layer.value, &layer.output]);
    assert!(layer.shared_qk);
    let x = Tensor::<3>::random([2, 9, 16], Distribution::Default, &device);
    let heads = |linear: &burn::nn::Linear| {
        linear
            .forward(x.clone())
            .reshape([2, 9, 2, 8])
            .swap_dims(1, 2)
    };
    let queries = heads(&layer.query);
    let norms = queries.clone().square().sum_dim(3).sqrt();
    let keys = queries.clone() / norms;
    let values = heads(&layer.value);
    let merge = |context: Tensor<4>| {
        layer
            .output
            .forward(context.swap_dims(1, 2).reshape([2, 9, 16]))
    };
    let [q, k, v] = [queries, keys, values].map(Host4::from_tensor);
    let expected_shared = merge(attention_f64(&q, &k, &v, true, &device));
    let expected_full = merge(attention_f64(&q, &k, &v, false, &device));
    let shared = layer
        .clone()
        .forward(ClusteredAttentionInput::self_attn(x.clone()));
    let full = layer
        .with_attention(AttentionKind::Full)
        .forward(ClusteredAttentionInput::self_attn(x));
    let diff = max_abs(shared, expected_shared);
    assert!(diff <= 1e-5, "shared-full: {diff}");
    let diff = max_abs(full, expected_full);
    assert!(diff <= 1e-5, "full: {diff}");
}

/// `query_clusters` gives the assignments of `cluster_queries` on the layer's own queries
/// (`x · W_q + b_q`, computed here on the host, split into heads) with the layer's options:
/// Hamming K-means for clustered and improved attention, position blocks for the `blocks`
/// kinds; nothing for full attention.
#[test]
fn query_clusters_are_those_of_the_layers_queries() {
    use clustered_attention::{ClusteringOptions, QueryGrouping, cluster_queries};
    let device = ndarray();
    let (batch, len, d_model, heads) = (2, 30, 8, 2);
    let x = Tensor::<3>::random([batch, len, d_model], Distribution::Default, &device);
    let lengths = || {
        Some(Tensor::from_data(
            TensorData::new(vec![30i64, 21], [2]),
            &device,
        ))
    };
    for (kind, grouping) in [
        (
            AttentionKind::Clustered { clusters: 4 },
            QueryGrouping::HammingKmeans,
        ),
        (
            AttentionKind::Improved {
                clusters: 5,
                topk: 3,
            },
            QueryGrouping::HammingKmeans,
        ),
        (
            AttentionKind::Blocks { clusters: 6 },
            QueryGrouping::PositionBlocks,
        ),
    ] {
        let layer = MultiHeadClusteredAttentionConfig::new(d_model, heads, kind)
            .with_seed(9)
            .init(&device);
        // Queries on the host: [batch, heads, len, d_k].
        let w: Vec<f32> = layer.query.weight.val().into_data().try_into_vec().unwrap();
        let bias: Vec<f32> = layer
            .query
            .bias
            .as_ref()
            .unwrap()
            .val()
            .into_data()
            .try_into_vec()
            .unwrap();
        let xs: Vec<f32> = x.clone().into_data().try_into_vec().unwrap();
        let d_k = d_model / heads;
        let mut q = vec![0f32; batch * heads * len * d_k];
        for b in 0..batch {
            for t in 0..len {
                for o in 0..d_model {
                    let value = bias[o]
                        + (0..d_model)
                            .map(|i| xs[(b * len + t) * d_model + i] * w[i * d_model + o])
                            .sum::<f32>();
                    let (h, e) = (o / d_k, o % d_k);
                    q[((b * heads + h) * len + t) * d_k + e] = value;
                }
            }
        }
        let queries = Tensor::<4>::from_data(TensorData::new(q, [batch, heads, len, d_k]), &device);
        let clusters = match kind {
            AttentionKind::Clustered { clusters }
            | AttentionKind::Improved { clusters, .. }
            | AttentionKind::Blocks { clusters } => clusters,
            _ => unreachable!(),
        };
        let options = ClusteringOptions::new(clusters)
            .with_seed(9)
            .with_grouping(grouping);
        let expected = cluster_queries(queries, lengths(), &options).assignments;
        let ours = layer
            .query_clusters(x.clone(), lengths())
            .unwrap()
            .assignments;
        assert_eq!(host_ints(ours), host_ints(expected), "{kind}");
    }
    let full =
        MultiHeadClusteredAttentionConfig::new(d_model, heads, AttentionKind::Full).init(&device);
    assert!(full.query_clusters(x, lengths()).is_none());
}
