//! Bad input panics with a message naming the argument and the shapes.

use burn::tensor::{Distribution, Tensor};
use clustered_attention::{
    AttentionInput, AttentionKind, AttentionOptions, ClusteredAttention, FullAttention,
    ImprovedClusteredAttention, LshAttention, LshOptions, MultiHeadClusteredAttentionConfig,
    lsh_planes,
};

use crate::common::{lengths, ndarray};

fn random(dims: [usize; 4]) -> Tensor<4> {
    Tensor::random(dims, Distribution::Default, &ndarray())
}

#[test]
#[should_panic(expected = "bits must be in 1..=32 (codes are u32 words), got 0")]
fn bits_zero() {
    ClusteredAttention::new(2)
        .with_bits(0)
        .forward(AttentionInput::new(
            random([1, 1, 8, 4]),
            random([1, 1, 8, 4]),
            random([1, 1, 8, 4]),
        ));
}

#[test]
#[should_panic(expected = "bits must be in 1..=32 (codes are u32 words), got 33")]
fn bits_33() {
    lsh_planes(33, 4, true, 0, &ndarray());
}

#[test]
#[should_panic(expected = "bits must be in 1..=32 (codes are u32 words), got 33")]
fn layer_bits_33() {
    MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Clustered { clusters: 2 })
        .with_bits(33)
        .init(&ndarray());
}

#[test]
#[should_panic(expected = "clusters must be at least 1, got 0")]
fn clusters_zero() {
    ClusteredAttention::new(0).forward(AttentionInput::new(
        random([1, 1, 8, 4]),
        random([1, 1, 8, 4]),
        random([1, 1, 8, 4]),
    ));
}

#[test]
#[should_panic(expected = "topk must be at least 1, got 0")]
fn topk_zero() {
    ImprovedClusteredAttention::new(2, 0).forward(AttentionInput::new(
        random([1, 1, 8, 4]),
        random([1, 1, 8, 4]),
        random([1, 1, 8, 4]),
    ));
}

#[test]
#[should_panic(expected = "the E of queries [2, 3, 8, 4] and keys [2, 3, 6, 5] differ")]
fn query_key_dims_differ() {
    FullAttention::new().forward(AttentionInput::new(
        random([2, 3, 8, 4]),
        random([2, 3, 6, 5]),
        random([2, 3, 6, 4]),
    ));
}

#[test]
#[should_panic(expected = "the S of keys [2, 3, 6, 4] and values [2, 3, 7, 4] differ")]
fn key_value_lengths_differ() {
    ImprovedClusteredAttention::new(2, 2).forward(AttentionInput::new(
        random([2, 3, 8, 4]),
        random([2, 3, 6, 4]),
        random([2, 3, 7, 4]),
    ));
}

/// Clustered attention of 8 queries over 6 keys with these key lengths (batch 2).
fn clustered_with_key_lengths(key_lengths: &[usize]) {
    ClusteredAttention::new(2).forward(
        AttentionInput::new(
            random([2, 1, 8, 4]),
            random([2, 1, 6, 4]),
            random([2, 1, 6, 4]),
        )
        .with_key_lengths(lengths(key_lengths, &ndarray())),
    );
}

#[test]
#[should_panic(expected = "key_lengths[1] = 7 is outside 0..=6 (the sequence length)")]
fn key_length_too_long() {
    clustered_with_key_lengths(&[6, 7]);
}

#[test]
#[should_panic(expected = "query_lengths[0] = 9 is outside 0..=8 (the sequence length)")]
fn query_length_too_long() {
    let device = ndarray();
    FullAttention::new().forward(
        AttentionInput::new(
            random([2, 1, 8, 4]),
            random([2, 1, 6, 4]),
            random([2, 1, 6, 4]),
        )
        .with_query_lengths(lengths(&[9, 1], &device)),
    );
}

#[test]
#[should_panic(expected = "query_lengths must have shape [batch] = [2], got [3]")]
fn lengths_wrong_shape() {
    let device = ndarray();
    FullAttention::new().forward(
        AttentionInput::new(
            random([2, 1, 8, 4]),
            random([2, 1, 6, 4]),
            random([2, 1, 6, 4]),
        )
        .with_query_lengths(lengths(&[1, 2, 3], &device)),
    );
}

#[test]
#[should_panic(expected = "d_model (30) must be divisible by n_heads (4)")]
fn d_model_not_divisible() {
    MultiHeadClusteredAttentionConfig::new(30, 4, AttentionKind::Full).init(&ndarray());
}

/// `MultiHeadClusteredAttentionConfig::validate` accepts what `init` builds, and for each setting that
/// `init` panics on returns that panic's message.
#[test]
fn validate_reports_what_init_panics_on() {
    let good = MultiHeadClusteredAttentionConfig::new(
        8,
        2,
        AttentionKind::Improved {
            clusters: 3,
            topk: 2,
        },
    );
    assert_eq!(good.validate(), Ok(()));
    good.init(&ndarray());
    let bad = [
        (
            MultiHeadClusteredAttentionConfig::new(30, 4, AttentionKind::Full),
            "d_model (30) must be divisible by n_heads (4)",
        ),
        (
            MultiHeadClusteredAttentionConfig::new(8, 0, AttentionKind::Full),
            "d_model (8) must be divisible by n_heads (0)",
        ),
        (
            MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Clustered { clusters: 0 }),
            "clusters must be at least 1, got 0",
        ),
        (
            MultiHeadClusteredAttentionConfig::new(
                8,
                2,
                AttentionKind::Improved {
                    clusters: 2,
                    topk: 0,
                },
            ),
            "topk must be at least 1, got 0",
        ),
        (
            MultiHeadClusteredAttentionConfig::new(
                8,
                2,
                AttentionKind::Lsh {
                    rounds: 1,
                    chunk_size: 0,
                },
            ),
            "chunk_size must be at least 1, got 0",
        ),
        (
            MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Full).with_bits(33),
            "bits must be in 1..=32 (codes are u32 words), got 33",
        ),
        (
            MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Full).with_dropout(1.0),
            "dropout must be in [0, 1), got 1",
        ),
        (
            MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Clustered { clusters: 2 })
                .with_quiet_softmax(true),
            "quiet_softmax = true needs full attention: clustered:2 computes the softmax in its \
             own ops (every kind but full does); set quiet_softmax to false or use full",
        ),
    ];
    for (config, message) in bad {
        assert_eq!(config.validate(), Err(message.to_string()), "{config:?}");
        let init = || config.init(&ndarray());
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(init))
            .expect_err("init must panic where validate fails");
        let text = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied());
        assert_eq!(text, Some(message), "{config:?}");
    }
}

#[test]
#[should_panic(expected = "query must have shape [batch, seq, d_model = 8], got [1, 5, 6]")]
fn layer_input_width() {
    use clustered_attention::ClusteredAttentionInput;
    let device = ndarray();
    let layer = MultiHeadClusteredAttentionConfig::new(8, 2, AttentionKind::Full).init(&device);
    let x = Tensor::<3>::zeros([1, 5, 6], &device);
    layer.forward(ClusteredAttentionInput::self_attn(x));
}

/// A sequence without keys (key length 0) in a self-attention layer of every kind, on NdArray
/// and Flex: its rows are finite and equal the output projection's bias (the attention's rows
/// are zero, as a padded query's), to 1e-6, and the other sequence's rows are those it gets
/// alone, to 1e-5.
#[test]
fn key_length_zero_gives_zero_attention_rows() {
    use burn::tensor::Int;
    use clustered_attention::ClusteredAttentionInput;
    let kinds = [
        AttentionKind::Full,
        AttentionKind::Clustered { clusters: 3 },
        AttentionKind::Improved {
            clusters: 3,
            topk: 2,
        },
        AttentionKind::Blocks { clusters: 3 },
        AttentionKind::ImprovedBlocks {
            clusters: 3,
            topk: 2,
        },
        AttentionKind::SharedFull,
        AttentionKind::Lsh {
            rounds: 2,
            chunk_size: 4,
        },
        AttentionKind::OracleTop { topk: 3 },
    ];
    for device in [ndarray(), crate::common::flex()] {
        for kind in kinds {
            let layer = MultiHeadClusteredAttentionConfig::new(8, 2, kind).init(&device);
            let x = Tensor::<3>::random([2, 8, 8], Distribution::Default, &device);
            let key_lengths = Tensor::<1, Int>::from_ints([8, 0], &device);
            let output = layer
                .forward(ClusteredAttentionInput::self_attn(x.clone()).key_lengths(key_lengths));
            let host: Vec<f32> = output.to_data().iter::<f32>().collect();
            assert!(host.iter().all(|v| v.is_finite()), "{kind}: {host:?}");
            let bias = layer.output.bias.as_ref().unwrap().val().reshape([1, 1, 8]);
            let diff = (output.clone().narrow(0, 1, 1) - bias)
                .abs()
                .max()
                .into_scalar::<f32>();
            assert!(
                diff <= 1e-6,
                "{kind}: the empty sequence's rows are {diff} off the bias"
            );
            let alone = layer.forward(ClusteredAttentionInput::self_attn(x.narrow(0, 0, 1)));
            let diff = (output.narrow(0, 0, 1) - alone)
                .abs()
                .max()
                .into_scalar::<f32>();
            assert!(
                diff <= 1e-5,
                "{kind}: the other sequence is {diff} off its rows alone"
            );
        }
    }
}

#[test]
#[should_panic(expected = "buckets must be even and at least 2, got 3")]
fn odd_buckets() {
    let q = random([1, 1, 8, 4]);
    LshAttention {
        lsh: LshOptions::new().with_buckets(Some(3)),
        options: AttentionOptions::new(),
    }
    .forward(AttentionInput::new(q.clone(), q, random([1, 1, 8, 4])));
}
