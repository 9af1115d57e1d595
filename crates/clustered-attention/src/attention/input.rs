//! The checks of an attention's input, its padding masks and lengths, and the small tensor
//! helpers the attentions share (dropout, positions, top keys, inverse counts).

use burn::tensor::{Bool, DType, Device, FloatDType, Int, Tensor, TensorData};

use super::AttentionOptions;
use crate::ops::checks::{checked_lengths, host_lengths, known_lengths};
use crate::ops::topk_indices;

/// The input of an attention on `[batch, heads, seq, dim]` tensors, as burn-nn's `MhaInput` is
/// the input of its layer: queries, keys and values, and optional sequence lengths for padded
/// batches.
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`,
///   `values`: `[batch, heads, S, D]` (S may differ from L; the shared-QK attentions need
///   `S = L`)
/// - `query_lengths`, `key_lengths`: `[batch]`, Int. Positions at or past a sequence's length
///   are padding: padded keys get no attention, padded queries join no cluster and get a zero
///   output row. Without them every position is valid. A sequence with key length 0 has
///   nothing to attend to: all its output rows are zero (burn-nn's attention, which fills
///   masked scores with a finite minimum, gives such a row the mean of all the values).
///
/// The shapes and lengths are checked by the attention's `forward`, which panics naming the
/// argument and the shapes.
#[derive(Debug, Clone)]
pub struct AttentionInput {
    /// `[batch, heads, L, E]`.
    pub queries: Tensor<4>,
    /// `[batch, heads, S, E]`.
    pub keys: Tensor<4>,
    /// `[batch, heads, S, D]`.
    pub values: Tensor<4>,
    /// `[batch]`: the valid queries of each sequence; `None`: all of them.
    pub query_lengths: Option<Tensor<1, Int>>,
    /// `[batch]`: the valid keys (and values) of each sequence; `None`: all of them. A
    /// sequence without keys (0) gets zero output rows.
    pub key_lengths: Option<Tensor<1, Int>>,
}

impl AttentionInput {
    /// Queries `[batch, heads, L, E]`, keys `[batch, heads, S, E]` and values
    /// `[batch, heads, S, D]`, every position valid.
    pub fn new(queries: Tensor<4>, keys: Tensor<4>, values: Tensor<4>) -> Self {
        Self {
            queries,
            keys,
            values,
            query_lengths: None,
            key_lengths: None,
        }
    }

    /// The valid queries of each sequence, `[batch]` Int, each in `0..=L`.
    pub fn with_query_lengths(mut self, query_lengths: Tensor<1, Int>) -> Self {
        self.query_lengths = Some(query_lengths);
        self
    }

    /// The valid keys and values of each sequence, `[batch]` Int, each in `0..=S` (0: the
    /// sequence's output rows are zero).
    pub fn with_key_lengths(mut self, key_lengths: Tensor<1, Int>) -> Self {
        self.key_lengths = Some(key_lengths);
        self
    }

    /// Checks the input ([`check_input`]), with the host copies of its lengths in `host`
    /// where the caller has them, and splits it into queries, keys, values and what the check
    /// found.
    pub(crate) fn checked(
        self,
        options: &AttentionOptions,
        host: &HostLengths,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>, Checked) {
        let checked = check_input(
            &self.queries,
            &self.keys,
            &self.values,
            self.query_lengths,
            self.key_lengths,
            host,
            options,
        );
        (self.queries, self.keys, self.values, checked)
    }
}

/// The values of an [`AttentionInput`]'s lengths on the host, where its caller has them: an
/// encoder reads its lengths once for all its layers, whose attentions then need not read them
/// back (on a GPU, each read waits for the device). Each must equal the input's tensor of the
/// same name; `None` where the caller does not have it (the tensor is then read).
#[derive(Debug, Clone, Default)]
pub(crate) struct HostLengths {
    /// The values of `query_lengths`.
    pub query: Option<Vec<usize>>,
    /// The values of `key_lengths`.
    pub key: Option<Vec<usize>>,
}

/// The scale and the lengths and padding masks of a checked attention input.
pub(crate) struct Checked {
    pub scale: f64,
    /// `[batch]` query lengths, `None` when every query is valid.
    pub query_lengths: Option<Tensor<1, Int>>,
    /// The values of `query_lengths` on the host, for the clusterings that need them there.
    pub query_host: Option<Vec<usize>>,
    /// `[batch, 1, L, 1]`, true for padded queries; `None` when no query is padded.
    pub query_padding: Option<Tensor<4, Bool>>,
    /// `[batch, 1, 1, S]`, true for padded keys; `None` when no key is padded.
    pub key_padding: Option<Tensor<4, Bool>>,
    /// `[batch, 1, 1, 1]` key lengths, for masks on gathered key indices.
    pub key_lengths: Option<Tensor<4, Int>>,
}

/// Checks the shapes and lengths of an attention input. A length tensor is read back to the
/// host unless `host` has its values.
///
/// # Panics
/// With a message naming the argument and the shapes when the batch or head dimensions
/// disagree, the E of queries and keys differ, the S of keys and values differ, a length
/// tensor is not `[batch]`, or a length is outside `0..=` its sequence's.
pub(crate) fn check_input(
    queries: &Tensor<4>,
    keys: &Tensor<4>,
    values: &Tensor<4>,
    query_lengths: Option<Tensor<1, Int>>,
    key_lengths: Option<Tensor<1, Int>>,
    host: &HostLengths,
    options: &AttentionOptions,
) -> Checked {
    let [batch, heads, queries_len, dim] = queries.dims();
    let [k_batch, k_heads, keys_len, k_dim] = keys.dims();
    let [v_batch, v_heads, v_len, _] = values.dims();
    assert!(
        k_dim == dim,
        "the E of queries {:?} and keys {:?} differ",
        queries.dims(),
        keys.dims()
    );
    assert!(
        v_len == keys_len,
        "the S of keys {:?} and values {:?} differ",
        keys.dims(),
        values.dims()
    );
    assert!(
        k_batch == batch && v_batch == batch && k_heads == heads && v_heads == heads,
        "queries {:?}, keys {:?} and values {:?} must share [batch, heads]",
        queries.dims(),
        keys.dims(),
        values.dims()
    );
    assert!(
        queries_len > 0 && keys_len > 0,
        "queries {:?} and keys {:?} need at least one position",
        queries.dims(),
        keys.dims()
    );
    assert!(
        (0.0..1.0).contains(&options.dropout),
        "dropout must be in [0, 1), got {}",
        options.dropout
    );
    let device = queries.device();

    // The key lengths first: a self-attention layer given key lengths alone takes them as its
    // query lengths too, and a bad one is then named as the argument it was given as.
    let key_lengths = key_lengths.map(|lengths| {
        lengths_on_host("key_lengths", lengths, host.key.as_deref(), batch, keys_len)
    });
    let query_lengths = query_lengths.map(|lengths| {
        let host = host.query.as_deref();
        lengths_on_host("query_lengths", lengths, host, batch, queries_len)
    });
    // A sequence without keys has nothing to attend to: its queries are all taken as padding
    // (zero output rows), and the ops, which need a key per sequence, see its first key as
    // valid; no query reads it, so it gets no gradient.
    let (query_lengths, key_lengths) = match key_lengths {
        Some(mut keys) if keys.contains(&0) => {
            let mut queries = query_lengths.unwrap_or_else(|| vec![queries_len; batch]);
            for (b, n) in keys.iter_mut().enumerate() {
                if *n == 0 {
                    (*n, queries[b]) = (1, 0);
                }
            }
            (Some(queries), Some(keys))
        }
        keys => (query_lengths, keys),
    };
    // Made anew on the queries' device from the values read or given (as the key lengths
    // below), so
    // that lengths made on another device (one without autodiff, say) meet the queries' own.
    let query_lengths = query_lengths.map(|host| {
        let lengths = Tensor::<1, Int>::from_data(
            TensorData::new(host.iter().map(|&n| n as i64).collect(), [batch]),
            &device,
        );
        (lengths, host)
    });

    let query_padding = query_lengths
        .as_ref()
        .filter(|(_, host)| host.iter().any(|&n| n < queries_len))
        .map(|(_, host)| {
            padding_mask(host, queries_len, &device).reshape([batch, 1, queries_len, 1])
        });
    let key_padding = key_lengths
        .as_ref()
        .filter(|host| host.iter().any(|&n| n < keys_len))
        .map(|host| padding_mask(host, keys_len, &device).reshape([batch, 1, 1, keys_len]));
    let key_lengths = key_lengths.map(|host| {
        Tensor::<1, Int>::from_data(
            TensorData::new(host.iter().map(|&n| n as i64).collect(), [batch]),
            &device,
        )
        .reshape([batch, 1, 1, 1])
    });

    let (query_lengths, query_host) = query_lengths.unzip();
    Checked {
        scale: options.scale.unwrap_or(1.0 / (dim as f64).sqrt()),
        query_lengths,
        query_host,
        query_padding,
        key_padding,
        key_lengths,
    }
}

/// The values of the lengths tensor `name` (`[batch]`), checked against the sequence's length
/// `seq_len`: `known` where the caller has them on the host, otherwise read back.
///
/// # Panics
/// If the tensor is not `[batch]`, `known` has not one length per batch item, or a length is
/// outside `0..=seq_len`.
fn lengths_on_host(
    name: &str,
    lengths: Tensor<1, Int>,
    known: Option<&[usize]>,
    batch: usize,
    seq_len: usize,
) -> Vec<usize> {
    match known {
        Some(known) => {
            let dims = |lengths: &Tensor<1, Int>| lengths.dims().to_vec();
            let values = |_| known_lengths(name, known, batch);
            checked_lengths(name, Some(lengths), batch, seq_len, dims, values)
        }
        None => host_lengths(name, Some(lengths), batch, seq_len),
    }
}

/// `[batch, len]`, true at positions `≥ lengths[batch]`.
fn padding_mask(lengths: &[usize], len: usize, device: &Device) -> Tensor<2, Bool> {
    let mask: Vec<bool> = lengths
        .iter()
        .flat_map(|&n| (0..len).map(move |i| i >= n))
        .collect();
    Tensor::from_data(TensorData::new(mask, [lengths.len(), len]), device)
}

impl Checked {
    /// Fills the scores of padded keys with `-inf`. `scores`: `[batch, heads, rows, S]`.
    pub fn mask_keys(&self, scores: Tensor<4>) -> Tensor<4> {
        match &self.key_padding {
            Some(mask) => {
                let shape = scores.dims();
                scores.mask_fill(mask.clone().expand(shape), f32::NEG_INFINITY)
            }
            None => scores,
        }
    }

    /// The `[batch]` key lengths, `None` when no key length was given.
    pub fn batch_key_lengths(&self) -> Option<Tensor<1, Int>> {
        self.key_lengths.clone().map(|lengths| {
            let [batch, ..] = lengths.dims();
            lengths.reshape([batch])
        })
    }

    /// Zeroes the rows of padded queries. `x`: `[batch, heads, L, F]`.
    pub fn zero_padded_queries(&self, x: Tensor<4>) -> Tensor<4> {
        match &self.query_padding {
            Some(mask) => {
                let shape = x.dims();
                x.mask_fill(mask.clone().expand(shape), 0.0)
            }
            None => x,
        }
    }
}

/// `[batch, heads, len]` Int, `positions[b, h, i] = i`.
pub(crate) fn positions(batch: usize, heads: usize, len: usize, device: &Device) -> Tensor<3, Int> {
    Tensor::<1, Int>::arange(0..len as i64, device)
        .reshape([1, 1, len])
        .expand([batch, heads, len])
}

/// Indices of the `k = min(topk, S)` highest scores of every row, `[batch, heads, rows, k]`
/// (no gradient); all keys in order when `k = S`, since Burn's `topk` needs `k < S`.
pub(crate) fn top_keys(scores: Tensor<4>, topk: usize) -> Tensor<4, Int> {
    let [batch, heads, rows, keys_len] = scores.dims();
    let k = topk.min(keys_len);
    if k == keys_len {
        Tensor::<1, Int>::arange(0..k as i64, &scores.device())
            .reshape([1, 1, 1, k])
            .expand([batch, heads, rows, k])
    } else {
        topk_indices(scores.detach(), k)
    }
}

/// `1 / count` of each cluster's members (1 for an empty cluster): `counts` `[batch, heads, C]`
/// → `[batch, heads, C, 1]` in `dtype`. The counts go to `f32` directly (in f16 a count above
/// 65504 would be infinite, in bf16 one above 256 inexact), and only 1 / count is rounded to
/// `dtype`.
pub(crate) fn inverse_counts(counts: Tensor<3, Int>, dtype: DType) -> Tensor<4> {
    let counts = counts.cast(FloatDType::F32).clamp_min(1.0);
    Tensor::<3>::ones(counts.dims(), (&counts.device(), DType::F32))
        .div(counts)
        .cast(dtype)
        .unsqueeze_dim::<4>(3)
}
