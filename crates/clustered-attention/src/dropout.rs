//! Dropout whose masks can come from a generator of the calling thread.
//!
//! [`dropout`] is `burn::nn::Dropout`'s: active only on an autodiff device
//! ([`Device::is_autodiff`](burn::tensor::Device::is_autodiff)), each element zeroed with
//! probability `p` and the others scaled by `1 / (1 − p)` (Srivastava et al., *Dropout*, JMLR
//! 2014). The function has no training flag of its own; the layer
//! ([`crate::MultiHeadClusteredAttention::training`]) carries one as burn-nn 0.22's `Dropout`
//! does, so a layer frozen with `Module::freeze` applies none. By default its masks come from the
//! backend's random generator, as burn-nn's do. Inside [`with_dropout_seed`] they come instead
//! from a generator of the calling thread, seeded by the caller (xoshiro256++, drawn on the
//! host and uploaded as one tensor). Data-parallel training wants this: the backend's
//! generator is one per process on the CPU backends (Flex draws under a lock, element by
//! element), so with several workers the masks depend on which worker draws first, and the
//! workers wait for each other; a seed per batch makes each worker's masks its own, the same
//! whatever the threads' order, and far faster to draw. Full attention and the baselines drop
//! their attention weights with it ([`crate::AttentionOptions::dropout`]).
//!
//! Clustered and improved attention drop theirs inside their fused ops instead, with
//! [`AttentionDropout`]: a counter-based mask (Philox4x32-10, [`philox4x32_10`]) whose seed
//! comes from the same thread generator inside [`with_dropout_seed`].

use std::cell::RefCell;

use burn::nn::DropoutConfig;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{Rng, SeedableRng};

/// Where the [`AttentionDropout`] seeds come from in a scope of this crate (see
/// [`next_seed`]).
enum SeedScope {
    /// [`with_one_seed_draw`]: the backend's draw, once; then `Generator` seeded with it.
    OneDraw,
    /// [`with_seeds`] (or a one-draw scope after its draw): this generator.
    Generator(Xoshiro256PlusPlus),
}

thread_local! {
    static GENERATOR: RefCell<Option<Xoshiro256PlusPlus>> = const { RefCell::new(None) };
    static SEED_SCOPE: RefCell<Option<SeedScope>> = const { RefCell::new(None) };
}

/// Runs `f` with `cell` (a thread-local) set to `value`; what was there before is back
/// afterwards, also when `f` panics.
fn with_replaced<T: 'static, R>(
    cell: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: 'static>(
        &'static std::thread::LocalKey<RefCell<Option<T>>>,
        Option<T>,
    );
    impl<T: 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            let previous = self.1.take();
            self.0.with(|cell| *cell.borrow_mut() = previous);
        }
    }
    let previous = cell.with(|cell| cell.borrow_mut().replace(value));
    let _restore = Restore(cell, previous);
    f()
}

/// Runs `f` with the [`AttentionDropout`] seeds it needs from the backend's generator drawn
/// once: the first seed is the backend's draw (a read back from the device, on a GPU a wait),
/// the later ones come from a xoshiro256++ generator seeded with it, so that a forward pass of
/// several layers reads one seed back, not one per layer. Inside [`with_dropout_seed`] the
/// seeds come from the thread's generator as elsewhere. The scope that was there before, if
/// any, is back afterwards.
pub(crate) fn with_one_seed_draw<R>(f: impl FnOnce() -> R) -> R {
    with_replaced(&SEED_SCOPE, SeedScope::OneDraw, f)
}

/// Runs `f` with the [`AttentionDropout`] seeds it needs drawn from xoshiro256++ seeded with
/// `seed`, before any other source (the thread's generator of [`with_dropout_seed`] included):
/// the seeds of a layer's dropouts as a function of one seed, the same in a recomputed forward
/// pass. The scope that was there before, if any, is back afterwards.
pub(crate) fn with_seeds<R>(seed: u64, f: impl FnOnce() -> R) -> R {
    with_replaced(
        &SEED_SCOPE,
        SeedScope::Generator(Xoshiro256PlusPlus::seed_from_u64(seed)),
        f,
    )
}

/// Runs `f` with the dropout masks of this thread drawn from a generator seeded with `seed`
/// (see the [module](self)); the generator that was there before, if any, is back afterwards.
/// Only the calling thread's [`dropout`] calls are affected.
pub fn with_dropout_seed<R>(seed: u64, f: impl FnOnce() -> R) -> R {
    with_replaced(&GENERATOR, Xoshiro256PlusPlus::seed_from_u64(seed), f)
}

/// Dropout with probability `prob` on `x` (any shape), active only when `x` is on an autodiff
/// device (training), as `burn::nn::Dropout::forward`: each element is zeroed with
/// probability `prob`, the others scaled by `1 / (1 − prob)`. Inside [`with_dropout_seed`] the
/// mask comes from the thread's generator, else from the backend's.
///
/// # Panics
/// When `prob` is not in `[0, 1)`.
pub fn dropout<const D: usize>(x: Tensor<D>, prob: f64) -> Tensor<D> {
    assert!(
        (0.0..1.0).contains(&prob),
        "dropout probability must be in [0, 1), got {prob}"
    );
    if prob == 0.0 || !x.device().is_autodiff() {
        return x;
    }
    let shape = x.shape();
    let n = shape.num_elements();
    let mask = GENERATOR.with(|g| g.borrow_mut().as_mut().map(|rng| keep_mask(rng, n, prob)));
    match mask {
        Some(mask) => {
            let mask =
                Tensor::<D>::from_data(TensorData::new(mask, shape), &x.device()).cast(x.dtype());
            x * mask
        }
        None => DropoutConfig::new(prob).init().forward(x),
    }
}

/// `n` draws: 0 with probability `prob` (a 32-bit uniform below `prob · 2³²`), else
/// `1 / (1 − prob)`.
fn keep_mask(rng: &mut Xoshiro256PlusPlus, n: usize, prob: f64) -> Vec<f32> {
    let threshold = (prob * 4_294_967_296.0).round().min(u32::MAX as f64) as u32;
    let scale = (1.0 / (1.0 - prob)) as f32;
    let mut mask = Vec::with_capacity(n);
    while mask.len() < n {
        let bits = rng.next_u64();
        for word in [bits as u32, (bits >> 32) as u32] {
            if mask.len() < n {
                mask.push(if word < threshold { 0.0 } else { scale });
            }
        }
    }
    mask
}

/// The counter-based attention-weight dropout of clustered and improved clustered attention:
/// whether the weight of key `key` in row `row` of `(batch, head)` is kept is a function of the
/// seed and those coordinates alone, so the fused ops draw their masks where they compute the
/// weights (the host loops, the CubeCL kernels) and draw them again in the backward pass
/// instead of storing them, as FlashAttention does (Dao et al., *FlashAttention*, NeurIPS 2022,
/// §3.1); every backend draws the same mask for the same seed.
///
/// The function is Philox4x32-10 (Salmon, Moraes, Dror, Shaw, *Parallel random numbers: as
/// easy as 1, 2, 3*, SC 2011; [`philox4x32_10`]) keyed by the seed, on the counter
/// `[key / 8, row, batch · heads + head, stream]`: its four 32-bit words give eight 16-bit
/// draws, key `8n + 2w + h` taking half `h` (0 the low, 1 the high) of word `w`, as
/// FlashAttention takes 8-bit ones. A weight is dropped when its draw is below
/// `round(prob · 2¹⁶)` and otherwise scaled by `1 / (1 − prob)` (`prob` rounded to a multiple of
/// 2⁻¹⁶ for the drawing: within 8 · 10⁻⁶ of it).
///
/// The streams ([`AttentionDropout::CLUSTER_ROWS`], [`AttentionDropout::QUERY_TOP`]) keep the
/// two sets of weights of improved clustered attention apart: the clusters' weights `Aᶜ` (rows
/// are clusters, keys the key indices), and each query's weights on its cluster's top-k keys
/// (rows are queries, keys the ranks `0..k` in the cluster's top-k, best first: eight per
/// Philox counter). A rank names the same key on every backend where the top-k lists agree,
/// as they must for the outputs to: by score, descending; among equal scores the host loops
/// and the CubeCL kernels take the lower key first, the default body's sort may not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionDropout {
    /// The probability of dropping a weight, in `(0, 1)`.
    pub prob: f64,
    /// The Philox key.
    pub seed: u64,
}

impl AttentionDropout {
    /// The stream of the clusters' weights `Aᶜ` (paper eqs. 4 and 10, second case).
    pub const CLUSTER_ROWS: u32 = 0;
    /// The stream of each query's weights on its cluster's top-k keys (paper eq. 10, first
    /// case), keyed by their ranks in the top-k.
    pub const QUERY_TOP: u32 = 1;
    /// The stream of the encoder's dropout on activations
    /// ([`activation_dropout`](crate::ops::activation_dropout)): after each sub-layer and
    /// inside the feed-forward network, each call with its own seed; rows are the tensor's
    /// positions (`batch · L`), keys its features.
    pub const ACTIVATIONS: u32 = 2;

    /// Dropout with probability `prob` and the Philox key `seed`.
    ///
    /// # Panics
    /// When `prob` is not in `(0, 1)`.
    pub fn new(prob: f64, seed: u64) -> Self {
        assert!(
            prob > 0.0 && prob < 1.0,
            "attention dropout probability must be in (0, 1), got {prob}"
        );
        Self { prob, seed }
    }

    /// The dropout the attentions apply in a forward pass on `device`: `None` when `prob` is 0
    /// or `device` is not an autodiff device (as [`dropout`]); else a fresh seed, from the
    /// thread's generator inside [`with_dropout_seed`], else from the backend's generator (a
    /// 64-bit draw read back from the device: on a GPU, one wait for the device per call, which
    /// [`with_dropout_seed`] avoids, and which an encoder's forward makes once for all its
    /// layers).
    ///
    /// # Panics
    /// When `prob` is not in `[0, 1)`.
    pub fn for_forward(prob: f64, device: &burn::tensor::Device) -> Option<Self> {
        assert!(
            (0.0..1.0).contains(&prob),
            "dropout probability must be in [0, 1), got {prob}"
        );
        if prob == 0.0 || !device.is_autodiff() {
            return None;
        }
        Some(Self::new(prob, next_seed(device)))
    }

    /// A weight is dropped when its 16-bit draw is below this: `round(prob · 2¹⁶)`, at most
    /// `2¹⁶ − 1`.
    pub fn threshold(&self) -> u32 {
        (self.prob * 65_536.0).round().min(65_535.0) as u32
    }

    /// The factor of a kept weight, `1 / (1 − prob)`.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.prob)) as f32
    }

    /// The Philox key: the seed's low and high words.
    pub fn key(&self) -> [u32; 2] {
        [self.seed as u32, (self.seed >> 32) as u32]
    }

    /// The 16-bit draw of the weight at `(stream, bh, row, key)`, `bh = batch · heads + head`.
    pub fn draw(&self, stream: u32, bh: u32, row: u32, key: u32) -> u32 {
        let word =
            philox4x32_10([key >> 3, row, bh, stream], self.key())[((key >> 1) & 3) as usize];
        (word >> (16 * (key & 1))) & 0xFFFF
    }

    /// The factor of the weight at `(stream, bh, row, key)`: 0 (dropped) or `1 / (1 − prob)`.
    pub fn factor(&self, stream: u32, bh: u32, row: u32, key: u32) -> f32 {
        if self.draw(stream, bh, row, key) < self.threshold() {
            0.0
        } else {
            self.scale()
        }
    }

    /// Multiplies `weights[i]` by the factor of key `first + i` of `(stream, bh, row)`, one
    /// Philox call per eight keys.
    pub fn apply_row(&self, stream: u32, bh: u32, row: u32, first: u32, weights: &mut [f32]) {
        let (threshold, scale, key) = (self.threshold(), self.scale(), self.key());
        let mut i = 0;
        while i < weights.len() {
            let k = first + i as u32;
            let words = philox4x32_10([k >> 3, row, bh, stream], key);
            let draws = words.iter().flat_map(|&w| [w & 0xFFFF, w >> 16]);
            for draw in draws.skip((k & 7) as usize) {
                if i == weights.len() {
                    break;
                }
                weights[i] *= if draw < threshold { 0.0 } else { scale };
                i += 1;
            }
        }
    }

    /// The factors of every weight of `[batch, heads, rows, keys]` on `stream`, row-major: the
    /// mask the default bodies multiply the weights by.
    pub fn factors(&self, stream: u32, [batch, heads, rows, keys]: [usize; 4]) -> Vec<f32> {
        let mut factors = vec![1f32; batch * heads * rows * keys];
        for (i, row) in factors.chunks_exact_mut(keys.max(1)).enumerate() {
            let (bh, r) = (i / rows, i % rows);
            self.apply_row(stream, bh as u32, r as u32, 0, row);
        }
        factors
    }
}

/// A fresh 64-bit seed for the dropout on `device`: from the generator of [`with_seeds`],
/// else from the thread's generator inside [`with_dropout_seed`], else from the scope of
/// [`with_one_seed_draw`] (its first seed drawn from the backend), else from the backend's
/// generator (four 16-bit draws read back).
pub(crate) fn next_seed(device: &burn::tensor::Device) -> u64 {
    let backend_draw = || {
        // Four 16-bit draws: every int type of every backend holds them.
        let draws = Tensor::<1, burn::tensor::Int>::random(
            [4],
            burn::tensor::Distribution::Uniform(0.0, 65_536.0),
            device,
        )
        .into_data();
        draws
            .iter::<i64>()
            .fold(0u64, |seed, x| (seed << 16) | (x as u64 & 0xFFFF))
    };
    let scoped = || {
        SEED_SCOPE.with(|scope| match scope.borrow_mut().as_mut()? {
            SeedScope::Generator(rng) => Some(rng.next_u64()),
            SeedScope::OneDraw => None,
        })
    };
    let thread = || GENERATOR.with(|g| g.borrow_mut().as_mut().map(|rng| rng.next_u64()));
    let one_draw = || {
        SEED_SCOPE.with(|scope| {
            let mut scope = scope.borrow_mut();
            let scope = scope.as_mut()?;
            let seed = backend_draw();
            *scope = SeedScope::Generator(Xoshiro256PlusPlus::seed_from_u64(seed));
            Some(seed)
        })
    };
    scoped()
        .or_else(thread)
        .or_else(one_draw)
        .unwrap_or_else(backend_draw)
}

/// Philox4x32-10 (Salmon et al., SC 2011; Random123's `philox4x32`, 10 rounds): the four 32-bit
/// words of the block `counter` under `key`. Random123's known-answer vectors hold (the tests).
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [
            (p1 >> 32) as u32 ^ c[1] ^ k[0],
            p1 as u32,
            (p0 >> 32) as u32 ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

#[cfg(all(test, feature = "flex", feature = "autodiff"))]
mod tests {
    use super::*;

    /// Inside [`with_one_seed_draw`] the first attention dropout seed is drawn from the backend
    /// and the later ones come from xoshiro256++ seeded with it (a reference generator here);
    /// inside [`with_dropout_seed`] too, the thread's generator gives them all.
    #[test]
    fn one_seed_draw_seeds_the_later_seeds() {
        let device = burn::tensor::Device::flex().autodiff();
        let seeds = |n: usize| -> Vec<u64> {
            (0..n)
                .map(|_| (AttentionDropout::for_forward(0.1, &device).expect("dropout")).seed)
                .collect()
        };
        let drawn = with_one_seed_draw(|| seeds(4));
        let mut reference = Xoshiro256PlusPlus::seed_from_u64(drawn[0]);
        let later: Vec<u64> = (0..3).map(|_| reference.next_u64()).collect();
        assert_eq!(
            drawn[1..],
            later[..],
            "the seeds after the first {}",
            drawn[0]
        );

        let inside = with_dropout_seed(9, || with_one_seed_draw(|| seeds(2)));
        let mut thread = Xoshiro256PlusPlus::seed_from_u64(9);
        assert_eq!(inside, [thread.next_u64(), thread.next_u64()]);
    }
}
