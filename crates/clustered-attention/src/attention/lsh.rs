use burn::config::Config;
use burn::tensor::{Bool, Device, IndexingUpdateOp, Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};

use super::{
    AttentionInput, AttentionOptions, Checked, HostLengths, attention_options_builders, dropout,
    positions,
};

/// The score a query gets against its own key in shared-QK attention (Reformer, Kitaev et al.
/// 2020, §2): low enough that the key gets no weight when any other key is available, finite
/// so that a query whose other keys are all masked attends to itself.
pub(crate) const SELF_SCORE: f32 = -1.0e4;

/// Options of [`LshAttention`]: its hashing rounds, chunks, buckets and seed.
#[derive(Config, Debug, PartialEq)]
pub struct LshOptions {
    /// Hashing rounds `X` of lsh-X (`≥ 1`); the rounds' outputs are combined with their
    /// log-sum-exp weights.
    #[config(default = 1)]
    pub rounds: usize,
    /// Queries per chunk `m` of the sorted sequence; each chunk attends to itself and to the
    /// chunk before it.
    #[config(default = 32)]
    pub chunk_size: usize,
    /// Buckets of the angular hash (even, `≥ 2`); `None` means Reformer's `2 · ⌈L / m⌉`, an
    /// average bucket of half a chunk, with `L` the padded length of the batch (so the
    /// buckets, and the output, may change with the padding).
    #[config(default = "None")]
    pub buckets: Option<usize>,
    /// Seed of the random rotations (round `r` uses [`Self::round_seed`]). The rotations are
    /// drawn once per seed, so the same seed gives the same buckets call after call (Reformer
    /// draws new rotations at every forward pass).
    #[config(default = 0)]
    pub seed: u64,
}

impl LshOptions {
    /// Checks the options.
    ///
    /// # Panics
    /// If `rounds` or `chunk_size` is 0, or `buckets` is odd or less than 2.
    pub fn check(&self) {
        assert!(self.rounds > 0, "rounds must be at least 1, got 0");
        assert!(self.chunk_size > 0, "chunk_size must be at least 1, got 0");
        if let Some(buckets) = self.buckets {
            assert!(
                buckets >= 2 && buckets.is_multiple_of(2),
                "buckets must be even and at least 2, got {buckets}"
            );
        }
    }

    /// Seed of round `r`'s rotations: `seed + r · 0x9E3779B97F4A7C15` (wrapping), so that
    /// options seeded `s` and `s + 1` (consecutive layers) share no rotation.
    pub fn round_seed(&self, round: usize) -> u64 {
        self.seed
            .wrapping_add((round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The number of buckets used for sequences of length `len`.
    pub fn buckets_for(&self, len: usize) -> usize {
        self.buckets
            .unwrap_or(2 * len.div_ceil(self.chunk_size))
            .max(2)
    }
}

/// Random rotations of one hashing round: `[E, buckets / 2]` standard normal entries drawn on
/// the host from a [`Xoshiro256PlusPlus`] seeded by `seed`, so every backend hashes with the
/// same rotations (near ties of the arg-max may still fall differently).
pub fn lsh_rotations(dim: usize, buckets: usize, seed: u64, device: &Device) -> Tensor<2> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let half = buckets / 2;
    let values: Vec<f32> = (0..dim * half)
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    Tensor::from_data(TensorData::new(values, [dim, half]), device)
}

/// Angular LSH buckets (Reformer §2; Andoni et al. 2015): `argmax([xR ; −xR])`, in
/// `0..buckets`. No gradient.
///
/// # Shapes
/// - `x`: `[batch, heads, L, E]`, `rotations`: `[E, buckets / 2]`
/// - output: `[batch, heads, L]`
pub fn angular_buckets(x: Tensor<4>, rotations: Tensor<2>) -> Tensor<3, Int> {
    let [batch, heads, len, _] = x.dims();
    let rotations = rotations.cast(x.dtype()).unsqueeze::<4>();
    let rotated = x.detach().matmul(rotations);
    Tensor::cat(vec![rotated.clone(), rotated.neg()], 3)
        .argmax(3)
        .reshape([batch, heads, len])
}

/// Stable sort of the positions of every row by bucket: `order[b, h, r]` is the position at
/// rank `r`. Every bucket must lie in `0..=max_bucket`; others are sorted wrongly.
///
/// An LSD radix sort made of Burn tensor ops (comparisons, `cumsum`, `gather`, `scatter`),
/// base 16, so that it runs on the device on every backend: Burn 0.21's `sort`/`argsort` read
/// the tensor back to the host on the CubeCL backends. Each pass is a stable counting sort of
/// one hexadecimal digit; ties keep position order, since the passes start from it.
///
/// # Shapes
/// - `buckets`: `[batch, heads, L]`, output: `[batch, heads, L]`
pub fn sort_by_bucket(buckets: Tensor<3, Int>, max_bucket: usize) -> Tensor<3, Int> {
    const RADIX: usize = 16;
    let [batch, heads, len] = buckets.dims();
    let device = buckets.device();
    let digits_range = Tensor::<1, Int>::arange(0..RADIX as i64, &device).reshape([1, 1, 1, RADIX]);
    let mut order = positions(batch, heads, len, &device);
    let mut keys = buckets;
    let mut place = 1usize;
    while place <= max_bucket {
        let digits = keys
            .clone()
            .div_scalar(place as i64)
            .remainder_scalar(RADIX as i64);
        // inclusive[b, h, i, d]: how many of positions 0..=i have digit d.
        let one_hot = digits
            .clone()
            .unsqueeze_dim::<4>(3)
            .equal(digits_range.clone().expand([batch, heads, len, RADIX]))
            .int();
        let inclusive = one_hot.cumsum(2);
        let totals = inclusive
            .clone()
            .slice([0..batch, 0..heads, len - 1..len, 0..RADIX]);
        let starts = totals.clone().cumsum(3) - totals;
        let destinations = (inclusive + starts.expand([batch, heads, len, RADIX]))
            .gather(3, digits.unsqueeze_dim(3))
            .reshape([batch, heads, len])
            - 1;
        let zeros = Tensor::<3, Int>::zeros([batch, heads, len], &device);
        order = zeros
            .clone()
            .scatter(2, destinations.clone(), order, IndexingUpdateOp::Add);
        place *= RADIX;
        if place <= max_bucket {
            keys = zeros.scatter(2, destinations, keys, IndexingUpdateOp::Add);
        }
    }
    order
}

/// Reformer's LSH attention, lsh-X (Kitaev et al., ICLR 2020, §2), the baseline of the
/// paper's Tables 1 and 2.
///
/// Shared-QK self-attention: position `i` holds query `i` and key `i`, and the keys are
/// normalised to unit length here (Reformer's `k_j = q_j / ‖q_j‖`; pass the queries as keys
/// for exactly that). For each of `rounds` hashing rounds:
/// 1. every position gets the angular-LSH bucket of its query, `argmax([qR ; −qR])` with a
///    seeded random rotation `R` ([`angular_buckets`]);
/// 2. positions are sorted by bucket, stably (ties keep position order;
///    [`sort_by_bucket`], on the device);
/// 3. the sorted sequence is cut into chunks of `chunk_size`; each query attends to the keys
///    of its own chunk and of the chunk before it (the first chunk only to itself). A query's
///    own key scores −10⁴, so it gets weight only when no other key is available; padded keys
///    get none;
/// 4. the output and the log-sum-exp of the scores are put back in position order.
///
/// The rounds' outputs are averaged with the softmax of their log-sum-exps (Reformer's
/// multi-round combination, without removing keys seen in several rounds). Gradients flow to
/// queries, keys and values; the buckets carry none. Costs `O(X · L · m · (E + D))` plus
/// the sort.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{AttentionInput, LshAttention};
///
/// let device = Device::default();
/// let q = Tensor::<4>::random([1, 2, 100, 8], Distribution::Default, &device);
/// let v = Tensor::<4>::random([1, 2, 100, 3], Distribution::Default, &device);
/// // lsh-4, chunks of 16.
/// let attention = LshAttention::new(4).with_chunk_size(16);
/// let out = attention.forward(AttentionInput::new(q.clone(), q, v));
/// assert_eq!(out.dims(), [1, 2, 100, 3]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct LshAttention {
    /// The hashing rounds, chunk size, buckets and seed.
    pub lsh: LshOptions,
    /// The scale and the dropout.
    pub options: AttentionOptions,
}

impl LshAttention {
    /// Reformer's lsh-X with `rounds` hashing rounds (`X ≥ 1`), chunks of 32, `2 · ⌈L / 32⌉`
    /// buckets, seed 0, the scale `1 / sqrt(E)` and no dropout.
    pub fn new(rounds: usize) -> Self {
        Self {
            lsh: LshOptions::new().with_rounds(rounds),
            options: AttentionOptions::new(),
        }
    }

    /// Queries per chunk `m` of the sorted sequence (`≥ 1`, [`LshOptions::chunk_size`]);
    /// default 32.
    pub fn with_chunk_size(mut self, chunk_size: usize) -> Self {
        self.lsh.chunk_size = chunk_size;
        self
    }

    /// Buckets of the angular hash, even and `≥ 2` ([`LshOptions::buckets`]); default
    /// `2 · ⌈L / m⌉`.
    pub fn with_buckets(mut self, buckets: usize) -> Self {
        self.lsh.buckets = Some(buckets);
        self
    }

    /// Seed of the random rotations ([`LshOptions::seed`]); default 0.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.lsh.seed = seed;
        self
    }

    /// All the hashing options at once (the rounds among them).
    pub fn with_lsh(mut self, lsh: LshOptions) -> Self {
        self.lsh = lsh;
        self
    }

    attention_options_builders!();

    /// Reformer's LSH attention of `input`'s queries on its keys and values.
    ///
    /// # Shapes
    /// - `queries`, `keys`: `[batch, heads, L, E]`; `values`: `[batch, heads, L, D]`
    /// - `query_lengths`, `key_lengths`: `[batch]`; a position at or past either length is
    ///   padding: its key gets no attention and sorts last, its output row is zero
    /// - output: `[batch, heads, L, D]`
    ///
    /// # Panics
    /// If the shapes disagree (see [`FullAttention`](super::FullAttention)), `keys` is not as
    /// long as `queries` (self-attention), a length tensor is not `[batch]` or out of range, or
    /// the options are invalid ([`LshOptions::check`]).
    pub fn forward(&self, input: AttentionInput) -> Tensor<4> {
        self.forward_host(input, &HostLengths::default())
    }

    /// [`Self::forward`] given the host copies of the input's lengths where the caller has
    /// them ([`HostLengths`]), which are then not read back.
    pub(crate) fn forward_host(&self, input: AttentionInput, host: &HostLengths) -> Tensor<4> {
        let (lsh, options) = (&self.lsh, &self.options);
        lsh.check();
        check_self_attention("LshAttention", &input.queries, &input.keys);
        let (queries, keys, values, input) = input.checked(options, host);
        let [batch, heads, len, dim] = queries.dims();
        let value_dim = values.dims()[3];
        let device = queries.device();
        let keys = unit_keys(keys);
        let buckets = lsh.buckets_for(len);

        // Padded positions take an extra, last bucket.
        let padded = input.key_padding.as_ref().map(|mask| {
            mask.clone()
                .reshape([batch, 1, len])
                .expand([batch, heads, len])
        });
        let mut outputs = Vec::with_capacity(lsh.rounds);
        let mut lses = Vec::with_capacity(lsh.rounds);
        for round in 0..lsh.rounds {
            let rotations = lsh_rotations(dim, buckets, lsh.round_seed(round), &device);
            let mut hashed = angular_buckets(queries.clone(), rotations);
            if let Some(padded) = &padded {
                hashed = hashed.mask_fill(padded.clone(), buckets as i64);
            }
            let order = sort_by_bucket(hashed, buckets);
            let (output, lse) = chunked_attention(
                &queries,
                &keys,
                &values,
                order,
                lsh.chunk_size,
                &input,
                options.dropout,
            );
            outputs.push(output);
            lses.push(lse);
        }
        let output = if lsh.rounds == 1 {
            outputs.remove(0)
        } else {
            // Weights of the rounds: softmax over their log-sum-exps, [batch, heads, L, X].
            let weights = burn::tensor::activation::softmax(Tensor::cat(lses, 3), 3);
            outputs
                .into_iter()
                .enumerate()
                .map(|(r, out)| {
                    out * weights
                        .clone()
                        .slice([0..batch, 0..heads, 0..len, r..r + 1])
                        .expand([batch, heads, len, value_dim])
                })
                .reduce(|a, b| a + b)
                .expect("at least one round")
        };
        zero_padded_positions(&input, input.zero_padded_queries(output))
    }
}

/// Zeroes the output rows of positions past their key length: in shared-QK self-attention a
/// position whose key is padding is padding. `x`: `[batch, heads, L, D]` with `L = S`.
pub(crate) fn zero_padded_positions(input: &Checked, x: Tensor<4>) -> Tensor<4> {
    match &input.key_padding {
        Some(mask) => {
            let [batch, heads, len, width] = x.dims();
            x.mask_fill(
                mask.clone()
                    .reshape([batch, 1, len, 1])
                    .expand([batch, heads, len, width]),
                0.0,
            )
        }
        None => x,
    }
}

/// # Panics
/// If `keys` and `queries` differ in length.
pub(crate) fn check_self_attention(name: &str, queries: &Tensor<4>, keys: &Tensor<4>) {
    assert!(
        queries.dims()[2] == keys.dims()[2],
        "{name} is shared-QK self-attention: queries {:?} and keys {:?} must have the same length",
        queries.dims(),
        keys.dims()
    );
}

/// Keys scaled to unit L2 norm along the last dimension (Reformer's shared-QK keys).
pub(crate) fn unit_keys(keys: Tensor<4>) -> Tensor<4> {
    // Clamped before the root: a zero key would otherwise give 0 · ∞ in the backward pass.
    let norms = keys.clone().square().sum_dim(3).clamp_min(1e-12).sqrt();
    keys / norms
}

/// Attention of every chunk of the sorted sequence to itself and the chunk before it.
/// Returns the output `[batch, heads, L, D]` and the log-sum-exp of each query's scores
/// `[batch, heads, L, 1]`, both in position order.
fn chunked_attention(
    queries: &Tensor<4>,
    keys: &Tensor<4>,
    values: &Tensor<4>,
    order: Tensor<3, Int>,
    chunk_size: usize,
    input: &Checked,
    dropout_prob: f64,
) -> (Tensor<4>, Tensor<4>) {
    let [batch, heads, len, dim] = queries.dims();
    let value_dim = values.dims()[3];
    let device = queries.device();
    let m = chunk_size.min(len);
    let chunks = len.div_ceil(m);
    let slots = chunks * m;

    // Sorted positions padded to whole chunks; extra slots point at position 0 and are masked.
    let extra = slots - len;
    let (gather_order, slot_valid) = {
        let valid = match &input.key_lengths {
            Some(lengths) => order.clone().lower(
                lengths
                    .clone()
                    .reshape([batch, 1, 1])
                    .expand([batch, heads, len]),
            ),
            None => order.clone().greater_equal_elem(0),
        };
        if extra == 0 {
            (order.clone(), valid)
        } else {
            let pad = Tensor::<3, Int>::zeros([batch, heads, extra], &device);
            let pad_valid = Tensor::<3, Bool>::from_data(
                TensorData::new(vec![false; batch * heads * extra], [batch, heads, extra]),
                &device,
            );
            (
                Tensor::cat(vec![order.clone(), pad], 2),
                Tensor::cat(vec![valid, pad_valid], 2),
            )
        }
    };
    let sorted = |x: &Tensor<4>, width: usize| -> Tensor<5> {
        x.clone()
            .gather(
                2,
                gather_order
                    .clone()
                    .unsqueeze_dim::<4>(3)
                    .expand([batch, heads, slots, width]),
            )
            .reshape([batch, heads, chunks, m, width])
    };
    // Each chunk's context: the previous chunk, then its own, [.., chunks, 2m, ..].
    let with_previous = |x: Tensor<5>| -> Tensor<5> {
        let [b, h, n, rows, width] = x.dims();
        let first = Tensor::<5>::zeros([b, h, 1, rows, width], (&device, x.dtype()));
        let previous = Tensor::cat(
            vec![
                first,
                x.clone().slice([0..b, 0..h, 0..n - 1, 0..rows, 0..width]),
            ],
            2,
        );
        Tensor::cat(vec![previous, x], 3)
    };
    let sorted_queries = sorted(queries, dim);
    let context_keys = with_previous(sorted(keys, dim));
    let context_values = with_previous(sorted(values, value_dim));

    // Which context keys are valid: [batch, heads, chunks, 1, 2m].
    let valid = slot_valid.reshape([batch, heads, chunks, m]);
    let no_previous = Tensor::<4, Bool>::from_data(
        TensorData::new(vec![false; batch * heads * m], [batch, heads, 1, m]),
        &device,
    );
    let previous_valid = Tensor::cat(
        vec![
            no_previous,
            valid
                .clone()
                .slice([0..batch, 0..heads, 0..chunks - 1, 0..m]),
        ],
        2,
    );
    let key_valid =
        Tensor::cat(vec![previous_valid, valid], 3).reshape([batch, heads, chunks, 1, 2 * m]);
    // The own key of query r of a chunk is context key m + r.
    let own: Vec<bool> = (0..m)
        .flat_map(|r| (0..2 * m).map(move |c| c == m + r))
        .collect();
    let own = Tensor::<5, Bool>::from_data(TensorData::new(own, [1, 1, 1, m, 2 * m]), &device)
        .expand([batch, heads, chunks, m, 2 * m]);

    let scores = sorted_queries
        .matmul(context_keys.swap_dims(3, 4))
        .mul_scalar(input.scale)
        .mask_fill(
            key_valid
                .bool_not()
                .expand([batch, heads, chunks, m, 2 * m]),
            f32::NEG_INFINITY,
        )
        .mask_fill(own, SELF_SCORE);
    let max = scores.clone().max_dim(4).detach();
    let lse = (scores.clone() - max.clone()).exp().sum_dim(4).log() + max;
    let weights = dropout((scores - lse.clone()).exp(), dropout_prob);
    let output = weights
        .matmul(context_values)
        .reshape([batch, heads, slots, value_dim]);
    let lse = lse.reshape([batch, heads, slots, 1]);

    // Back to position order: ranks[b, h, i] is the sorted slot of position i.
    let ranks = Tensor::<3, Int>::zeros([batch, heads, len], &device).scatter(
        2,
        order,
        positions(batch, heads, len, &device),
        IndexingUpdateOp::Add,
    );
    let unsort = |x: Tensor<4>, width: usize| {
        x.gather(
            2,
            ranks
                .clone()
                .unsqueeze_dim::<4>(3)
                .expand([batch, heads, len, width]),
        )
    };
    (unsort(output, value_dim), unsort(lse, 1))
}
