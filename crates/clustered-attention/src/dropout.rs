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
//! whatever the threads' order, and far faster to draw. The layer's attention-weight dropout
//! ([`crate::AttentionOptions::dropout`]) uses it.

use std::cell::RefCell;

use burn::nn::DropoutConfig;
use burn::tensor::{Tensor, TensorData};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{Rng, SeedableRng};

thread_local! {
    static GENERATOR: RefCell<Option<Xoshiro256PlusPlus>> = const { RefCell::new(None) };
}

/// Runs `f` with the dropout masks of this thread drawn from a generator seeded with `seed`
/// (see the [module](self)); the generator that was there before, if any, is back afterwards.
/// Only the calling thread's [`dropout`] calls are affected.
pub fn with_dropout_seed<R>(seed: u64, f: impl FnOnce() -> R) -> R {
    let previous = GENERATOR.with(|g| {
        g.borrow_mut()
            .replace(Xoshiro256PlusPlus::seed_from_u64(seed))
    });
    // Put the previous generator back also when `f` panics.
    struct Restore(Option<Xoshiro256PlusPlus>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            GENERATOR.with(|g| *g.borrow_mut() = previous);
        }
    }
    let _restore = Restore(previous);
    f()
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
