//! Default bodies of [`ClusteredAttentionBackend::centroid_attention`] and its backward.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{IndexingUpdateOp, Int, Tensor};

use super::{device_ints, dropout_factors, padded_keys};
use crate::dropout::AttentionDropout;
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackward;
use crate::ops::checks::check_centroid_attention;
use crate::ops::tensor::rest_weights;
use crate::ops::{
    CentroidAttention, CentroidAttentionGrads, ClusteredAttentionBackend, Lengths,
    attention_softmax, topk_indices,
};

/// Default body of [`ClusteredAttentionBackend::centroid_attention`]: the scores as a `[C, S]`
/// matrix product, the padded keys filled with `-inf`,
/// [`ClusteredAttentionBackend::attention_softmax`] and [`ClusteredAttentionBackend::topk_indices`]
/// (all keys in order when `topk = S`).
///
/// # Panics
/// If the shapes disagree or `topk > S`.
#[allow(clippy::type_complexity)]
pub fn centroid_attention<B: ClusteredAttentionBackend>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Lengths<B>,
    topk: usize,
    dropout: Option<AttentionDropout>,
) -> (FloatTensor<B>, Option<(IntTensor<B>, FloatTensor<B>)>) {
    let (centroids, keys, values) = (
        B::float_tensor::<4>(centroids),
        B::float_tensor::<4>(keys),
        B::float_tensor::<4>(values),
    );
    let key_lengths = key_lengths.into_option().map(B::int_tensor::<1>);
    let [batch, heads, clusters, _] = centroids.dims();
    let [_, _, keys_len, _] = keys.dims();
    check_centroid_attention(centroids.dims(), keys.dims(), values.dims(), topk);
    let device = centroids.device();
    let scores = centroid_scores(centroids, keys, key_lengths);
    let weights = attention_softmax(scores.clone());
    let top = (topk > 0).then(|| {
        let top = if topk == keys_len {
            Tensor::<1, Int>::arange(0..topk as i64, &device)
                .reshape([1, 1, 1, topk])
                .expand([batch, heads, clusters, topk])
        } else {
            device_ints(topk_indices(scores, topk))
        };
        let top_weights = weights.clone().gather(3, top.clone());
        (top, top_weights)
    });
    // The top-k weights (the mass) are the undropped ones; the rest is dropped.
    let dropped = match &dropout {
        Some(dropout) => {
            weights.clone()
                * dropout_factors::<B>(dropout, AttentionDropout::CLUSTER_ROWS, &weights)
        }
        None => weights,
    };
    let values = match &top {
        Some((top, _)) => {
            let top_dropped = dropped.clone().gather(3, top.clone());
            rest_weights(dropped, top.clone(), top_dropped)
        }
        None => dropped,
    }
    .matmul(values);
    (
        B::float_primitive(values),
        top.map(|(top, weights)| (B::int_primitive(top), B::float_primitive(weights))),
    )
}

/// `centroids · keysᵀ` with the keys at or past `key_lengths[b]` at `-inf`,
/// `[batch, heads, C, S]`.
fn centroid_scores(
    centroids: Tensor<4>,
    keys: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
) -> Tensor<4> {
    let [batch, heads, clusters, _] = centroids.dims();
    let keys_len = keys.dims()[2];
    let device = centroids.device();
    let scores = centroids.matmul(keys.swap_dims(2, 3));
    let Some(lengths) = key_lengths else {
        return scores;
    };
    let positions = Tensor::<1, Int>::arange(0..keys_len as i64, &device)
        .reshape([1, 1, 1, keys_len])
        .expand([batch, 1, 1, keys_len]);
    let padded = padded_keys(lengths, positions);
    scores.mask_fill(
        padded.expand([batch, heads, clusters, keys_len]),
        f32::NEG_INFINITY,
    )
}

/// Default body of [`ClusteredAttentionBackward::centroid_attention_backward`]: `Aᶜ`
/// recomputed as [`centroid_attention`] computes it, then the softmax's Jacobian and three
/// products.
///
/// Uses `forward`'s top-k indices only.
///
/// # Panics
/// If the shapes disagree, or `forward.top` and `grad_top_weights` are not both given or both
/// `None`.
#[allow(clippy::too_many_arguments)]
pub fn centroid_attention_backward<B: ClusteredAttentionBackend>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Lengths<B>,
    forward: CentroidAttention<B>,
    grad_values: FloatTensor<B>,
    grad_top_weights: Option<FloatTensor<B>>,
    dropout: Option<AttentionDropout>,
) -> CentroidAttentionGrads<B> {
    let (centroids, keys, values) = (
        B::float_tensor::<4>(centroids),
        B::float_tensor::<4>(keys),
        B::float_tensor::<4>(values),
    );
    let grad_values = B::float_tensor::<4>(grad_values);
    let [batch, heads, clusters, _] = centroids.dims();
    let dim_v = values.dims()[3];
    check_centroid_attention(centroids.dims(), keys.dims(), values.dims(), 0);
    assert!(
        grad_values.dims() == [batch, heads, clusters, dim_v],
        "grad_values {:?} must be [batch, heads, C, D] = {:?}",
        grad_values.dims(),
        [batch, heads, clusters, dim_v]
    );
    let key_lengths = key_lengths.into_option().map(B::int_tensor::<1>);
    let scores = centroid_scores(centroids.clone(), keys.clone(), key_lengths);
    let weights = attention_softmax(scores);
    let mut grad_weights = grad_values.clone().matmul(values.swap_dims(2, 3));
    let mut rest = weights.clone();
    // The same factors as the forward pass: the rest's weights and their gradient.
    if let Some(dropout) = &dropout {
        let factors = dropout_factors::<B>(dropout, AttentionDropout::CLUSTER_ROWS, &weights);
        grad_weights = grad_weights * factors.clone();
        rest = rest * factors;
    }
    match (forward.top.map(|(top, _)| top), grad_top_weights) {
        (Some(top), Some(grad_top)) => {
            let (top, grad_top) = (B::int_tensor::<4>(top), B::float_tensor::<4>(grad_top));
            assert!(
                top.dims() == grad_top.dims() && top.dims()[..3] == [batch, heads, clusters],
                "top {:?} and grad_top_weights {:?} must both be [batch, heads, C, k] with \
                 [batch, heads, C] = {:?}",
                top.dims(),
                grad_top.dims(),
                [batch, heads, clusters]
            );
            // A top-k key's weight reaches the output through the top-k weights only: its
            // entry of dA is its weight's gradient, and the rest's weights leave it out (a
            // row's top-k keys are distinct, so each adds to its own entry).
            let in_top = weights
                .zeros_like()
                .scatter(3, top.clone(), grad_top.ones_like(), IndexingUpdateOp::Add)
                .greater_elem(0.5);
            grad_weights = grad_weights.mask_fill(in_top.clone(), 0.0).scatter(
                3,
                top,
                grad_top,
                IndexingUpdateOp::Add,
            );
            rest = rest.mask_fill(in_top, 0.0);
        }
        (None, None) => {}
        _ => panic!("top and grad_top_weights must be both given or both None"),
    }
    let delta = (weights.clone() * grad_weights.clone()).sum_dim(3);
    let grad_scores = weights.clone() * (grad_weights - delta);
    CentroidAttentionGrads {
        centroids: B::float_primitive(grad_scores.clone().matmul(keys)),
        keys: B::float_primitive(grad_scores.swap_dims(2, 3).matmul(centroids)),
        values: B::float_primitive(rest.swap_dims(2, 3).matmul(grad_values)),
    }
}
