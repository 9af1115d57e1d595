//! The CTC loss (Graves et al., 2006, "Connectionist temporal classification", §4.1–4.2) by
//! the forward–backward (alpha–beta) recursions on the host, with its gradient in closed form.
//!
//! Why not burn-nn's `CTCLoss` everywhere: Burn 0.22, as 0.21, builds it from one tensor op per
//! time step, which autodiff then differentiates op by op; the backward of each step's slice
//! writes a zeroed gradient the size of all the log-probabilities, so a step costs memory
//! traffic quadratic in the utterance's length. At the 800–2500 encoder steps of the paper's
//! speech experiment that is a fifth of the forward pass and most of the backward. Here the
//! recursions run once per utterance in `O(T·U)` (T steps, U labels), and the gradient with
//! respect to the log-probabilities, `∂(−log p)/∂ log y_t(c) = −Σ_{s: l'_s = c} γ_t(s)` with
//! `γ_t(s)` the posterior of extended label `s` at step `t` (Graves et al., eq. 16), is
//! computed with the loss. It enters the autodiff graph through one linear term, so the
//! backward pass costs one product over `[batch, steps, outputs]`.
//!
//! burn-nn's loss stays the reference of the tests and a choice of `asr train` (`--ctc-loss
//! burn`, [`CtcLossImpl`]; the main job, `scripts/train.sh`, trains with it), whose default is
//! this one.

use core::fmt;
use core::str::FromStr;

use burn::tensor::{Int, Tensor, TensorData};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Which implementation of the CTC loss trains a model. Both compute the same loss; they
/// differ in cost.
///
/// Parses from and prints as `burn` or `alpha-beta`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum CtcLossImpl {
    /// burn-nn's `CTCLoss`: device tensor ops, differentiated op by op.
    Burn,
    /// [`ctc_loss`]: the recursions on the host, the gradient in closed form (the default: the
    /// same loss and gradient as burn-nn's to 1e-4, far cheaper on long utterances).
    #[default]
    AlphaBeta,
}

impl fmt::Display for CtcLossImpl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Burn => "burn",
            Self::AlphaBeta => "alpha-beta",
        })
    }
}

impl FromStr for CtcLossImpl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "burn" => Ok(Self::Burn),
            "alpha-beta" => Ok(Self::AlphaBeta),
            _ => Err(format!(
                "invalid CTC loss {s:?}: expected burn or alpha-beta"
            )),
        }
    }
}

/// The negative log-likelihood `−log p(targets | log_probs)` of one utterance and its
/// gradient with respect to `log_probs`.
#[derive(Debug, Clone, PartialEq)]
pub struct CtcGradient {
    /// `−log p`; `+∞` when no alignment fits (fewer steps than labels plus repeated
    /// neighbours; with no step, any label at all).
    pub loss: f64,
    /// `∂ loss / ∂ log_probs`, `[steps, n_outputs]` row-major; all zero when `loss` is `+∞`.
    pub gradient: Vec<f32>,
}

/// Whether `steps` encoder steps can emit `targets` under CTC: at least one step per label
/// and one blank between each pair of equal neighbours.
pub fn ctc_reachable(steps: usize, targets: &[usize]) -> bool {
    let repeats = targets.windows(2).filter(|w| w[0] == w[1]).count();
    steps >= targets.len() + repeats
}

/// The CTC loss of one utterance and its gradient, by the alpha–beta recursions.
///
/// `log_probs` holds `steps` rows of `n_outputs` log-probabilities (row-major); `targets` the
/// labels, none of them `blank`. The recursions run on probabilities rescaled at every step
/// (Rabiner's scaling) in `f64`, over the band of extended labels that can still reach the end.
/// A value of theirs that underflows (an alpha or beta entry that comes out zero or subnormal
/// after its product with an emission or its division by the step's mass, though positive in
/// exact arithmetic) is raised to `f64::MIN_POSITIVE`, and the raises' effect on the result is
/// bounded through each step's posterior normaliser. The utterance is computed in the log
/// domain instead when one of its emissions (the probability of a target label or the blank at
/// a step) is not a normal `f64` (a log-probability below about −708), a step's scaled mass or
/// posterior normaliser leaves the normal range, or that bound exceeds `f64::EPSILON` relative
/// (a lost alignment could then outweigh the kept ones). Either way the loss is exact to
/// rounding (the scaled path's bound and its argument are in the comment of `scaled`).
///
/// # Panics
/// If `log_probs` is not `steps × n_outputs`, `blank` or a label is not below `n_outputs`, or a
/// label equals `blank`.
pub fn ctc_alpha_beta(
    log_probs: &[f32],
    steps: usize,
    n_outputs: usize,
    targets: &[usize],
    blank: usize,
) -> CtcGradient {
    assert_eq!(
        log_probs.len(),
        steps * n_outputs,
        "log_probs has {} values for {steps} steps × {n_outputs} outputs",
        log_probs.len()
    );
    assert!(
        blank < n_outputs,
        "blank {blank} must be below n_outputs {n_outputs}"
    );
    if let Some(bad) = targets.iter().find(|&&c| c >= n_outputs || c == blank) {
        panic!(
            "target label {bad} must be below n_outputs {n_outputs} and differ from blank {blank}"
        );
    }
    let mut gradient = vec![0f32; steps * n_outputs];
    if steps == 0 || !ctc_reachable(steps, targets) {
        // No step: the empty labelling is certain, any other impossible.
        let loss = if targets.is_empty() {
            0.0
        } else {
            f64::INFINITY
        };
        return CtcGradient { loss, gradient };
    }
    let lattice = Lattice::new(targets, blank, steps);
    let loss = match scaled(log_probs, n_outputs, &lattice, &mut gradient) {
        Some(loss) => loss,
        None => {
            gradient.fill(0.0);
            log_domain(log_probs, n_outputs, &lattice, &mut gradient)
        }
    };
    CtcGradient { loss, gradient }
}

/// The extended label sequence `l'` (blanks around and between the labels) and its band.
struct Lattice {
    /// `l'_s`, `S = 2U + 1` entries.
    labels: Vec<usize>,
    /// Whether a path may jump from `s − 2` to `s` (a label differing from the one before).
    skip: Vec<bool>,
    steps: usize,
}

impl Lattice {
    fn new(targets: &[usize], blank: usize, steps: usize) -> Self {
        let states = 2 * targets.len() + 1;
        let labels: Vec<usize> = (0..states)
            .map(|s| if s % 2 == 0 { blank } else { targets[s / 2] })
            .collect();
        let skip = (0..states)
            .map(|s| s % 2 == 1 && s >= 3 && labels[s] != labels[s - 2])
            .collect();
        Self {
            labels,
            skip,
            steps,
        }
    }

    fn states(&self) -> usize {
        self.labels.len()
    }

    /// The extended labels that are reachable from the start at step `t` and can still
    /// reach the end, `lo..hi`.
    fn band(&self, t: usize) -> (usize, usize) {
        let s = self.states();
        let lo = s.saturating_sub(2 * (self.steps - t));
        let hi = s.min(2 * t + 2);
        (lo, hi)
    }
}

/// The recursions on probabilities rescaled at every step: the loss, the gradient added
/// into `gradient`; `None` when an emission of the lattice is not a normal `f64` (zero,
/// subnormal or infinite), a step's mass or posterior normaliser (below) is not, or values
/// raised out of underflow could move the result by more than `f64::EPSILON` relative.
///
/// Underflow: a product of positive floats can round to zero or to a subnormal while its
/// step's mass stays normal, and the alignments through it may outweigh the others by the
/// end. So an alpha or beta value that is positive in exact arithmetic (every emission is)
/// and comes out below `m = f64::MIN_POSITIVE`, after its product with an emission or its
/// division by its step's mass, is raised to `m` and counted; sums of non-negative values do
/// not underflow. Every value kept is then zero exactly when it is in exact arithmetic, or a
/// normal float with the usual relative rounding error, and a raise adds at most `m`, in its
/// step's scaled units, to the exact value.
///
/// Bound: the recursions are linear and adjoint, `⟨α_t, β_t⟩ = p` at every step `t` (true
/// scale, `β_t` excluding step `t`'s emission). A raise at step `t` adds to `p`, and to each
/// `⟨α_τ, β_τ⟩`, at most `m` times the other direction's scaled value there (at most 1, the
/// scaled values summing to 1), over the step's mass `c_t` for a raise before the division,
/// times the step's scales `C_t D_t`; and `C_t D_t · total_t = ⟨α̃_t, β̃_t⟩ ≤ p(1 + E)`, where
/// `total_t = Σ_s α̂_t(s) β̂_t(s)` is the step's posterior normaliser, `α̃, β̃` the computed
/// values in true scale and `E` the raises' whole effect relative to `p`. With `n_t` raises
/// at step `t`, `E ≤ F = Σ_t 2 n_t m / (min(c_t, 1) · total_t)` (the 2 covers rounding and
/// the factor `1 + E`), and the recursion declines unless `F ≤ f64::EPSILON`. Then the
/// computed `p` is within `[p, p(1 + E)]` beyond rounding (the loss off by at most `E`
/// nats), and each step's posteriors (the gradient), the normalised products of values that
/// dominate the exact ones entrywise with excess mass at most `E p`, by at most `2E` in sum.
/// The products `α̂_t(s) β̂_t(s)` are final values and are not raised: an underflow there
/// moves `total_t` by at most `m` per state and a posterior by at most `m / total_t`.
fn scaled(
    log_probs: &[f32],
    n_outputs: usize,
    lattice: &Lattice,
    gradient: &mut [f32],
) -> Option<f64> {
    let (steps, states) = (lattice.steps, lattice.states());
    let probs: Vec<f64> = log_probs.iter().map(|&v| f64::from(v).exp()).collect();
    // An emission that `exp` rounds to zero or a subnormal (a log-probability below about
    // −708) lacks the relative precision the bound below assumes; an infinite one would
    // overflow the masses.
    let normal = |t: usize| {
        let row = &probs[t * n_outputs..(t + 1) * n_outputs];
        lattice.labels.iter().all(|&l| row[l].is_normal())
    };
    if !(0..steps).all(normal) {
        return None;
    }
    let emit = |t: usize, s: usize| probs[t * n_outputs + lattice.labels[s]];
    // beta'_t(s): the probability of finishing from state s at step t, excluding step t's
    // emission, scaled per step; stored for every step. `raised[t]` counts the raises of the
    // beta recursion at step t (of beta'_t(s)·y_t(l'_s), and of beta'_t(s) by its division).
    let mut beta = vec![0f64; steps * states];
    let mut raised = vec![0usize; steps];
    {
        let last = &mut beta[(steps - 1) * states..];
        last[states - 1] = 1.0;
        if states >= 2 {
            last[states - 2] = 1.0;
        }
    }
    let mut next = vec![0f64; states + 2];
    for t in (0..steps - 1).rev() {
        let (lo, hi) = lattice.band(t);
        let (lo1, hi1) = lattice.band(t + 1);
        // next[s] = beta'_{t+1}(s)·y_{t+1}(l'_s), zero outside step t + 1's band and past the
        // last state (two guard entries).
        next.fill(0.0);
        for s in lo1..hi1 {
            let b = beta[(t + 1) * states + s];
            next[s] = raise_underflow(b, b * emit(t + 1, s), &mut raised[t + 1]);
        }
        let row = &mut beta[t * states..(t + 1) * states];
        let mut mass = 0.0;
        for s in lo..hi {
            let mut v = next[s] + next[s + 1];
            if s + 2 < states && lattice.skip[s + 2] {
                v += next[s + 2];
            }
            row[s] = v;
            mass += v;
        }
        if !(mass >= f64::MIN_POSITIVE && mass.is_finite()) {
            return None;
        }
        for v in &mut row[lo..hi] {
            let b = *v;
            *v = raise_underflow(b, b / mass, &mut raised[t]);
        }
    }
    // alpha_t(s), scaled per step; its scales give log p. The posteriors gamma_t(s) are
    // alpha_t(s)·beta'_t(s) normalised over s at every step.
    let mut alpha = vec![0f64; states];
    let mut previous = vec![0f64; states];
    let mut log_p = 0.0;
    // F of the bound above, summed over the steps so far.
    let mut spent = 0.0;
    for t in 0..steps {
        let (lo, hi) = lattice.band(t);
        let mut raises = raised[t];
        let mut mass = 0.0;
        for s in lo..hi {
            let v = if t == 0 {
                if s <= 1 { 1.0 } else { 0.0 }
            } else {
                let mut v = previous[s];
                if s >= 1 {
                    v += previous[s - 1];
                }
                if lattice.skip[s] {
                    v += previous[s - 2];
                }
                v
            };
            let a = raise_underflow(v, v * emit(t, s), &mut raises);
            alpha[s] = a;
            mass += a;
        }
        if !(mass >= f64::MIN_POSITIVE && mass.is_finite()) {
            return None;
        }
        log_p += mass.ln();
        let beta_row = &beta[t * states..(t + 1) * states];
        let mut total = 0.0;
        for s in lo..hi {
            let a = alpha[s];
            alpha[s] = raise_underflow(a, a / mass, &mut raises);
            total += alpha[s] * beta_row[s];
        }
        if !(total >= f64::MIN_POSITIVE && total.is_finite()) {
            return None;
        }
        if raises > 0 {
            // 2m / min(c_t, 1) is at most 2 and total_t is normal: no NaN (an overflow to +∞
            // declines).
            spent += raises as f64 * (2.0 * f64::MIN_POSITIVE / mass.min(1.0)) / total;
            if spent > f64::EPSILON {
                return None;
            }
        }
        let row = &mut gradient[t * n_outputs..(t + 1) * n_outputs];
        for s in lo..hi {
            row[lattice.labels[s]] -= (alpha[s] * beta_row[s] / total) as f32;
        }
        // Out-of-band states are zero at the next step.
        previous.fill(0.0);
        previous[lo..hi].copy_from_slice(&alpha[lo..hi]);
        alpha[lo..hi].fill(0.0);
    }
    Some(-log_p)
}

/// `result`, the rounded product or quotient of `value` (zero or a normal float) and a
/// positive normal float, raised to `f64::MIN_POSITIVE` and counted in `raises` when it
/// underflowed (came out zero or subnormal from a positive `value`).
#[inline]
fn raise_underflow(value: f64, result: f64, raises: &mut usize) -> f64 {
    if result < f64::MIN_POSITIVE && value != 0.0 {
        *raises += 1;
        f64::MIN_POSITIVE
    } else {
        result
    }
}

/// `log(e^a + e^b)`, with `−∞` as the zero.
fn log_add(a: f64, b: f64) -> f64 {
    if a == f64::NEG_INFINITY {
        return b;
    }
    if b == f64::NEG_INFINITY {
        return a;
    }
    let (hi, lo) = if a > b { (a, b) } else { (b, a) };
    hi + (lo - hi).exp().ln_1p()
}

/// The recursions in the log domain (slower; for the utterances [`scaled`] declines): the
/// loss, the gradient added into `gradient`.
fn log_domain(log_probs: &[f32], n_outputs: usize, lattice: &Lattice, gradient: &mut [f32]) -> f64 {
    let (steps, states) = (lattice.steps, lattice.states());
    let emit = |t: usize, s: usize| f64::from(log_probs[t * n_outputs + lattice.labels[s]]);
    let zero = f64::NEG_INFINITY;
    let mut alpha = vec![zero; steps * states];
    for t in 0..steps {
        for s in 0..states {
            let v = if t == 0 {
                if s <= 1 { 0.0 } else { zero }
            } else {
                let prev = &alpha[(t - 1) * states..t * states];
                let mut v = prev[s];
                if s >= 1 {
                    v = log_add(v, prev[s - 1]);
                }
                if lattice.skip[s] {
                    v = log_add(v, prev[s - 2]);
                }
                v
            };
            alpha[t * states + s] = if v == zero { zero } else { v + emit(t, s) };
        }
    }
    let last = &alpha[(steps - 1) * states..];
    let log_p = if states >= 2 {
        log_add(last[states - 1], last[states - 2])
    } else {
        last[0]
    };
    if log_p == zero {
        return f64::INFINITY;
    }
    // beta'_t(s), excluding step t's emission.
    let mut beta = vec![zero; states];
    beta[states - 1] = 0.0;
    if states >= 2 {
        beta[states - 2] = 0.0;
    }
    let mut next = vec![zero; states];
    for t in (0..steps).rev() {
        let row = &mut gradient[t * n_outputs..(t + 1) * n_outputs];
        for s in 0..states {
            let a = alpha[t * states + s];
            if a != zero && beta[s] != zero {
                row[lattice.labels[s]] -= (a + beta[s] - log_p).exp() as f32;
            }
        }
        if t == 0 {
            break;
        }
        for s in 0..states {
            next[s] = if beta[s] == zero {
                zero
            } else {
                beta[s] + emit(t, s)
            };
        }
        for s in 0..states {
            let mut v = next[s];
            if s + 1 < states {
                v = log_add(v, next[s + 1]);
            }
            if s + 2 < states && lattice.skip[s + 2] {
                v = log_add(v, next[s + 2]);
            }
            beta[s] = v;
        }
    }
    -log_p
}

/// The CTC loss of each utterance of a batch, `−log p(targets | log_probs)`, by
/// [`ctc_alpha_beta`]; differentiable with respect to `log_probs` on autodiff devices.
///
/// The recursions run on the host (the log-probabilities are read back once), one utterance
/// per rayon task. On an autodiff device the result is `ℓ + Σ log_probs ⊙ G − (Σ log_probs ⊙
/// G)` with the last term detached, `ℓ` the losses and `G` their gradient computed with them:
/// its value is `ℓ` to the last bit (while the sum is finite, which it is unless it overflows
/// the float type) and its gradient `G`, and autodiff records one product and one sum.
///
/// The same loss as burn-nn's `CTCLoss` (blank `blank`, no reduction), whose inputs are
/// time-major; an utterance no alignment fits gets `+∞` and a zero gradient (burn-nn:
/// `zero_infinity` off).
///
/// # Shapes
/// - `log_probs`: `[batch, steps, n_outputs]` (log-softmax outputs)
/// - `targets`: `[batch, max_target_len]`, each row's first `target_lengths[b]` entries the
///   labels (the rest ignored)
/// - `input_lengths`, `target_lengths`: `batch` entries
/// - output: `[batch]`
///
/// # Panics
/// If the lengths disagree with the batch, an input length exceeds `steps`, a target length
/// exceeds `max_target_len`, or a label is `blank` or not below `n_outputs`.
pub fn ctc_loss(
    log_probs: Tensor<3>,
    targets: Tensor<2, Int>,
    input_lengths: &[usize],
    target_lengths: &[usize],
    blank: usize,
) -> Tensor<1> {
    let [batch, steps, n_outputs] = log_probs.dims();
    let [target_batch, width] = targets.dims();
    assert!(
        input_lengths.len() == batch && target_lengths.len() == batch && target_batch == batch,
        "ctc_loss: log_probs {:?}, targets {:?}, {} input lengths and {} target lengths disagree on the batch",
        log_probs.dims(),
        targets.dims(),
        input_lengths.len(),
        target_lengths.len()
    );
    if let Some(b) = (0..batch).find(|&b| input_lengths[b] > steps || target_lengths[b] > width) {
        panic!(
            "ctc_loss: utterance {b} has input length {} and target length {}, beyond log_probs {:?} or targets {:?}",
            input_lengths[b],
            target_lengths[b],
            log_probs.dims(),
            targets.dims()
        );
    }
    let device = log_probs.device();
    let values: Vec<f32> = log_probs
        .clone()
        .detach()
        .into_data()
        .try_into_vec_as::<f32>()
        .expect("f32 log-probabilities");
    let labels: Vec<i64> = targets
        .into_data()
        .try_into_vec_as::<i64>()
        .expect("i64 targets");
    let per_utterance: Vec<CtcGradient> = (0..batch)
        .into_par_iter()
        .map(|b| {
            let t = input_lengths[b];
            let row = &values[b * steps * n_outputs..(b * steps + t) * n_outputs];
            let targets: Vec<usize> = labels[b * width..b * width + target_lengths[b]]
                .iter()
                .map(|&c| usize::try_from(c).unwrap_or(usize::MAX))
                .collect();
            ctc_alpha_beta(row, t, n_outputs, &targets, blank)
        })
        .collect();
    let losses: Vec<f32> = per_utterance.iter().map(|g| g.loss as f32).collect();
    let losses =
        Tensor::<1>::from_data(TensorData::new(losses, [batch]), &device).cast(log_probs.dtype());
    if !device.is_autodiff() {
        return losses;
    }
    let mut gradient = vec![0f32; batch * steps * n_outputs];
    for (b, g) in per_utterance.iter().enumerate() {
        let start = b * steps * n_outputs;
        gradient[start..start + g.gradient.len()].copy_from_slice(&g.gradient);
    }
    let gradient = Tensor::<3>::from_data(
        TensorData::new(gradient, [batch, steps, n_outputs]),
        &device,
    )
    .cast(log_probs.dtype());
    // A −∞ log-probability has a zero gradient; zeroed here, its product stays 0, not NaN.
    let infinite = log_probs.clone().is_inf();
    let linear = (log_probs.mask_fill(infinite, 0.0) * gradient)
        .sum_dim(2)
        .sum_dim(1)
        .reshape([batch]);
    // (x − x) is exactly 0 for finite x, so the value is the losses' to the last bit.
    losses + (linear.clone() - linear.detach())
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use burn::nn::loss::CTCLossConfig;
    use burn::tensor::activation::log_softmax;
    use burn::tensor::{Device, Distribution};
    use rand::rngs::Xoshiro256PlusPlus;
    use rand::{RngExt, SeedableRng};

    /// NdArray's device (deprecated in Burn 0.22, still the tests' reference).
    #[allow(deprecated)]
    fn cpu() -> Device {
        Device::ndarray()
    }

    fn close(ours: f64, reference: f64, tolerance: f64) -> bool {
        (ours.is_infinite() && ours == reference)
            || (ours - reference).abs() <= tolerance * reference.abs().max(1.0)
    }

    /// Losses and gradients of one batch by [`ctc_loss`] and by burn-nn's `CTCLoss`, both
    /// differentiated by autodiff: `[batch]` losses, `[batch, steps, n_outputs]` gradients of
    /// their sum.
    #[allow(clippy::type_complexity)]
    fn both(
        logits: Tensor<3>,
        targets: &[Vec<usize>],
        input_lengths: &[usize],
    ) -> ((Vec<f32>, Vec<f32>), (Vec<f32>, Vec<f32>)) {
        let device = cpu().autodiff();
        let batch = targets.len();
        let width = targets.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut padded = vec![0i64; batch * width];
        for (b, t) in targets.iter().enumerate() {
            for (i, &c) in t.iter().enumerate() {
                padded[b * width + i] = c as i64;
            }
        }
        let target_lengths: Vec<usize> = targets.iter().map(Vec::len).collect();
        let run = |ours: bool| {
            let logits = logits.clone().autodiff().require_grad();
            let log_probs = log_softmax(logits.clone(), 2);
            let labels = Tensor::<2, Int>::from_data(
                TensorData::new(padded.clone(), [batch, width]),
                &device,
            );
            let loss = if ours {
                ctc_loss(log_probs, labels, input_lengths, &target_lengths, 0)
            } else {
                let lengths = |v: &[usize]| {
                    Tensor::<1, Int>::from_data(
                        TensorData::new(v.iter().map(|&x| x as i64).collect::<Vec<_>>(), [batch]),
                        &device,
                    )
                };
                CTCLossConfig::new().init().forward(
                    log_probs.swap_dims(0, 1),
                    labels,
                    lengths(input_lengths),
                    lengths(&target_lengths),
                )
            };
            let values = loss.clone().into_data().try_to_vec::<f32>().unwrap();
            // Gradients of the finite losses only: an infinite one would make every sum NaN.
            let finite: Vec<f32> = values
                .iter()
                .map(|v| if v.is_finite() { 1.0 } else { 0.0 })
                .collect();
            let mask = Tensor::<1>::from_data(TensorData::new(finite, [batch]), &device);
            let loss = loss.mask_fill(mask.clone().equal_elem(0.0), 0.0) * mask;
            let grads = loss.sum().backward();
            let gradient = logits
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            (values, gradient)
        };
        (run(true), run(false))
    }

    fn assert_agree(label: &str, ours: &(Vec<f32>, Vec<f32>), burn: &(Vec<f32>, Vec<f32>)) {
        assert_agree_within(label, ours, burn, 1e-4);
    }

    /// [`assert_agree`] with the gradient to `tolerance` (absolute).
    fn assert_agree_within(
        label: &str,
        ours: &(Vec<f32>, Vec<f32>),
        burn: &(Vec<f32>, Vec<f32>),
        tolerance: f32,
    ) {
        for (b, (o, r)) in ours.0.iter().zip(&burn.0).enumerate() {
            assert!(
                close(*o as f64, *r as f64, 1e-4),
                "{label}: loss of utterance {b}: ours {o}, burn-nn {r}"
            );
        }
        let worst = ours
            .1
            .iter()
            .zip(&burn.1)
            .map(|(o, r)| (o - r).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < tolerance,
            "{label}: largest gradient difference {worst}"
        );
    }

    /// Loss and gradient (through log-softmax, with respect to the logits) equal burn-nn's
    /// `CTCLoss`, to 1e-4 (relative for the loss, absolute for the gradient), on a padded
    /// batch: varied input lengths, labels with repeated neighbours, an utterance with no
    /// labels (blanks only), one whose steps are exactly enough for its labels and repeats,
    /// and one no alignment fits (+∞, zero gradient in both).
    #[test]
    fn ctc_loss_matches_burn_nn() {
        let logits = Tensor::<3>::random([6, 30, 7], Distribution::Normal(0.0, 2.0), &cpu());
        let targets = vec![
            vec![1, 2, 3, 4, 5, 6],
            vec![3, 3, 3, 2, 2],
            vec![],
            vec![1, 1, 2, 2],
            vec![4, 4],
            vec![5, 1, 5, 1, 6, 2, 3, 3],
        ];
        let input_lengths = [30, 17, 9, 6, 2, 30];
        let (ours, burn) = both(logits, &targets, &input_lengths);
        assert!(ours.0[4].is_infinite() && burn.0[4].is_infinite());
        assert!(
            ours.0
                .iter()
                .enumerate()
                .all(|(b, l)| b == 4 || l.is_finite())
        );
        assert_agree("random batch", &ours, &burn);
    }

    /// Log-probabilities far below what `exp` can represent (logits scaled so that most are
    /// below −1000) send [`ctc_alpha_beta`] to its log-domain path; it still equals burn-nn's
    /// loss, to 1e-4, and its gradient, to 1e-3: burn-nn's recursion runs in `f32`, whose
    /// spacing is 4.9e-4 at the log-probabilities' 4,096, so where two alignments are nearly
    /// tied it moves their posteriors (the gradient) by about that much times p(1 − p) (up to
    /// 1.6e-4 seen in 4,000 draws).
    #[test]
    fn ctc_loss_of_extreme_log_probabilities_matches_burn_nn() {
        let logits = Tensor::<3>::random([2, 20, 5], Distribution::Normal(0.0, 600.0), &cpu());
        let targets = vec![vec![1, 2, 3], vec![4, 4, 1, 2]];
        let (ours, burn) = both(logits, &targets, &[20, 14]);
        assert_agree_within("extreme log-probabilities", &ours, &burn, 1e-3);
    }

    /// An utterance whose target and blank emissions fall below `f64`'s normal range at some
    /// steps, while the alignments through them outweigh the others by the end (a draw of
    /// logits from N(0, 600) for which the scaled recursion, rounding those emissions to zero
    /// without its steps' mass underflowing, gave 1774.15): the loss and gradient equal
    /// burn-nn's, to 1e-4 (and the loss an `f64` log-domain sum computed apart, 1653.033).
    #[test]
    fn ctc_loss_keeps_alignments_through_underflowing_emissions() {
        #[rustfmt::skip]
        let logits = vec![
            -52.056293, -174.33786, 435.25772, 152.60146, 368.6608,
            153.4425, 118.10187, 87.99814, 838.95654, 542.0439,
            -199.50027, 935.0059, 129.63385, -388.00043, 539.05804,
            -312.36252, -72.15359, -485.0168, -221.56664, 1125.5328,
            1.4578894, 310.5319, -198.06975, -454.0847, 541.65607,
            904.597, -1850.2845, 502.9822, -629.87134, 40.061565,
            6.4332795, 411.4201, -481.89774, -174.4591, 881.9302,
            -415.1088, 959.5519, 899.9616, -597.7959, 1409.0226,
            150.08855, -634.2805, -625.1578, -218.5657, -1268.8676,
            144.76822, -47.518284, 846.02936, 414.64886, 5.6481504,
            596.79895, 283.39282, -48.713486, -262.51486, -123.84402,
            336.48145, -68.10601, -732.8451, 332.90753, 111.34542,
            -493.33627, 119.530685, 515.6766, 110.797104, -109.517715,
            -350.5718, -93.94361, 1039.5695, 882.1975, -752.5654,
        ];
        let logits = Tensor::<3>::from_data(TensorData::new(logits, [1, 14, 5]), &cpu());
        let (ours, burn) = both(logits, &[vec![4, 4, 1, 2]], &[14]);
        assert_agree("underflowing emissions", &ours, &burn);
    }

    /// The loss of a short utterance equals `−log Σ` over every alignment (every sequence of
    /// outputs that collapses to the labels once repeats are merged and blanks removed) of
    /// the product of its probabilities, enumerated by brute force, to 1e-9; both paths
    /// ([`scaled`] and [`log_domain`]) give it, with the same gradient to 1e-6.
    #[test]
    fn ctc_loss_is_the_sum_over_alignments() {
        let (steps, n_outputs): (usize, usize) = (6, 4);
        let logits =
            Tensor::<2>::random([steps, n_outputs], Distribution::Normal(0.0, 1.5), &cpu());
        let log_probs: Vec<f32> = log_softmax(logits, 1).into_data().try_to_vec().unwrap();
        for targets in [
            vec![1, 2],
            vec![2, 2],
            vec![3],
            vec![],
            vec![1, 3, 1],
            vec![2, 2, 2],
        ] {
            let mut total = 0f64;
            for code in 0..n_outputs.pow(steps as u32) {
                let path: Vec<usize> = (0..steps)
                    .map(|t| code / n_outputs.pow(t as u32) % n_outputs)
                    .collect();
                let mut collapsed: Vec<usize> = Vec::new();
                for (t, &c) in path.iter().enumerate() {
                    if c != 0 && (t == 0 || path[t - 1] != c) {
                        collapsed.push(c);
                    }
                }
                if collapsed == targets {
                    total += path
                        .iter()
                        .enumerate()
                        .map(|(t, &c)| f64::from(log_probs[t * n_outputs + c]))
                        .sum::<f64>()
                        .exp();
                }
            }
            let result = ctc_alpha_beta(&log_probs, steps, n_outputs, &targets, 0);
            assert!(
                (result.loss + total.ln()).abs() < 1e-9,
                "{targets:?}: loss {}, by enumeration {}",
                result.loss,
                -total.ln()
            );
            let lattice = Lattice::new(&targets, 0, steps);
            let mut gradient = vec![0f32; steps * n_outputs];
            let loss = log_domain(&log_probs, n_outputs, &lattice, &mut gradient);
            assert!(
                (loss - result.loss).abs() < 1e-9,
                "{targets:?}: log domain {loss}"
            );
            let worst = gradient
                .iter()
                .zip(&result.gradient)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-6, "{targets:?}: gradients differ by {worst}");
        }
    }

    /// On an autodiff device and off it, the losses [`ctc_loss`] returns are those of
    /// [`ctc_alpha_beta`], rounded to `f32`, bit for bit (the linear term adds exactly 0);
    /// with no step, an empty labelling costs 0 and any other +∞.
    #[test]
    fn ctc_loss_value_is_the_recursions_loss_bit_for_bit() {
        let device = cpu();
        let logits = Tensor::<3>::random([3, 12, 5], Distribution::Normal(0.0, 2.0), &device);
        let log_probs = log_softmax(logits, 2);
        let host: Vec<f32> = log_probs.clone().into_data().try_to_vec().unwrap();
        let targets = [vec![1, 2, 2], vec![4], vec![3, 1, 3, 1]];
        let lengths = [12, 7, 10];
        let expected: Vec<f32> = (0..3)
            .map(|b| {
                let row = &host[b * 12 * 5..(b * 12 + lengths[b]) * 5];
                ctc_alpha_beta(row, lengths[b], 5, &targets[b], 0).loss as f32
            })
            .collect();
        let labels = Tensor::<2, Int>::from_data(
            TensorData::new(vec![1i64, 2, 2, 0, 4, 0, 0, 0, 3, 1, 3, 1], [3, 4]),
            &device,
        );
        let plain = ctc_loss(log_probs.clone(), labels.clone(), &lengths, &[3, 1, 4], 0);
        assert_eq!(plain.into_data().try_to_vec::<f32>().unwrap(), expected);
        let tracked = ctc_loss(
            log_probs.autodiff().require_grad(),
            labels.autodiff(),
            &lengths,
            &[3, 1, 4],
            0,
        );
        assert_eq!(tracked.into_data().try_to_vec::<f32>().unwrap(), expected);
        assert_eq!(ctc_alpha_beta(&[], 0, 5, &[], 0).loss, 0.0);
        assert_eq!(ctc_alpha_beta(&[], 0, 5, &[2], 0).loss, f64::INFINITY);
    }

    /// A draw from N(0, σ), by Box–Muller.
    fn normal(rng: &mut Xoshiro256PlusPlus, sigma: f64) -> f64 {
        // 1 − U[0, 1) is in (0, 1]: its logarithm is finite.
        let u = 1.0 - rng.random::<f64>();
        let v = rng.random::<f64>();
        sigma * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    /// The log-softmax of each row of `logits` (`[steps, n_outputs]`, row-major), in `f64`,
    /// rounded to `f32`.
    fn log_softmax_rows(logits: &[f64], n_outputs: usize) -> Vec<f32> {
        logits
            .chunks(n_outputs)
            .flat_map(|row| {
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let log_sum = max + row.iter().map(|&x| (x - max).exp()).sum::<f64>().ln();
                row.iter().map(move |&x| (x - log_sum) as f32)
            })
            .collect()
    }

    /// The loss and gradient of one utterance (blank 0) by [`scaled`] (`None` where it
    /// declines) and by [`log_domain`].
    #[allow(clippy::type_complexity)]
    fn both_paths(
        log_probs: &[f32],
        n_outputs: usize,
        targets: &[usize],
    ) -> (Option<(f64, Vec<f32>)>, (f64, Vec<f32>)) {
        let steps = log_probs.len() / n_outputs;
        let lattice = Lattice::new(targets, 0, steps);
        let mut gradient = vec![0f32; log_probs.len()];
        let ours =
            scaled(log_probs, n_outputs, &lattice, &mut gradient).map(|loss| (loss, gradient));
        let mut reference = vec![0f32; log_probs.len()];
        let loss = log_domain(log_probs, n_outputs, &lattice, &mut reference);
        (ours, (loss, reference))
    }

    /// `Err` saying how, unless `ours` agrees with `reference`: the loss to 1e-9 relative (to
    /// the larger of the reference and 1), the gradient to 1e-6 absolute.
    fn paths_agree(ours: &(f64, Vec<f32>), reference: &(f64, Vec<f32>)) -> Result<(), String> {
        if !close(ours.0, reference.0, 1e-9) {
            return Err(format!("loss {}, log domain {}", ours.0, reference.0));
        }
        let worst = ours
            .1
            .iter()
            .zip(&reference.1)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        if worst > 1e-6 {
            return Err(format!("gradients differ by {worst}"));
        }
        Ok(())
    }

    /// An utterance whose emissions are all normal `f64`s (every log-probability at least
    /// −700) but whose best alignment's alpha underflows: the log-softmax per step of the
    /// logits [0, 700, 0, 0], [0, 300, 700, 0], [0, 300, 0, 700], [0, 700, 0, 0],
    /// [0, 0, 700, 0] (log-probabilities 0, −300, −400 and −700, exact in `f32`), labels
    /// [1, 2]. The alignment 1 1 1 1 2 has log-probability 0 − 400 − 400 + 0 + 0 = −800 and
    /// every other at most −1400 (1 2 2 2 2), so the loss is 800 (an `f64` log-domain recursion
    /// and a log-sum over the 35 alignments, computed apart: 800.0). At the third step its
    /// prefix's scaled alpha, e^−400·e^−400, rounds to zero while the step's mass (2e^−700, the
    /// prefixes through label 2) stays normal; the recursion without the raises gave
    /// 1400.0000000000002. [`scaled`] declines the utterance (its bound is far above ε), and
    /// [`ctc_alpha_beta`] gives 800 to 1e-4 relative, with the gradient of that one
    /// alignment (−1 at its output of each step, 0 elsewhere) to 1e-6.
    #[test]
    fn ctc_loss_keeps_alignments_through_underflowing_products() {
        #[rustfmt::skip]
        let logits = [
            0.0, 700.0, 0.0, 0.0,
            0.0, 300.0, 700.0, 0.0,
            0.0, 300.0, 0.0, 700.0,
            0.0, 700.0, 0.0, 0.0,
            0.0, 0.0, 700.0, 0.0,
        ];
        let log_probs = log_softmax_rows(&logits, 4);
        assert!(log_probs.iter().all(|&v| v >= -700.0), "{log_probs:?}");
        let (ours, _) = both_paths(&log_probs, 4, &[1, 2]);
        assert!(ours.is_none(), "the scaled recursion ran: {ours:?}");
        let result = ctc_alpha_beta(&log_probs, 5, 4, &[1, 2], 0);
        assert!(close(result.loss, 800.0, 1e-4), "loss {}", result.loss);
        let mut expected = vec![0f32; 20];
        for (t, c) in [1, 1, 1, 1, 2].into_iter().enumerate() {
            expected[t * 4 + c] = -1.0;
        }
        let worst = result
            .gradient
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-6, "gradient {:?}", result.gradient);
    }

    /// Wherever [`scaled`] runs, it agrees with [`log_domain`]: the loss to 1e-9 relative and
    /// the gradient to 1e-6 (the two differ by rounding alone: in a float64 port, by at most
    /// 1e-15 relative and 1e-16), on 12,000 utterances, 1,000 at each of 12 σ log-spaced from
    /// 1 to 600, of logits from N(0, σ) log-softmaxed per step, with 5–30 steps, 4–8 outputs
    /// and 1–4 labels that fit. So that it cannot pass by declining, the scaled recursion runs
    /// on every utterance at σ ≤ 20, on at least 98% at σ ≤ 60, and on at least 80% at
    /// σ ≤ 110, where an underflow is common (the port, over three seeds: every one at σ ≤ 33,
    /// 999–1000 at σ = 58.6 and 897–908 at σ = 104.8, where only 188–207 have no underflow
    /// at all; 299–309 at σ = 187.5, 1–6 at σ = 335, none at σ = 600).
    ///
    /// Without the raises and their bound (an underflowed value kept as zero or a subnormal,
    /// the check on the emissions and the masses alone), the port ran on 12,000 such draws
    /// per seed (three seeds) and returned 15–22 losses off by more than 1e-9 relative (up to
    /// 352 nats), and 10–20 more gradients off by over 1e-6, all at σ = 104.8–335: this test
    /// fails there.
    ///
    /// Cost: about 12,000 × (105 log-softmaxed logits and two recursions over at most 30 × 9
    /// states), a few million floating-point operations, a second or two unoptimised.
    #[test]
    fn scaled_recursion_agrees_with_the_log_domain_wherever_it_runs() {
        const PER_SIGMA: usize = 1000;
        let sigmas: Vec<f64> = (0..12_i32)
            .map(|k| 600f64.powf(f64::from(k) / 11.0))
            .collect();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(0x00c7_c10c);
        let mut ran = vec![0usize; sigmas.len()];
        for (k, &sigma) in sigmas.iter().enumerate() {
            for draw in 0..PER_SIGMA {
                let n_outputs = rng.random_range(4..=8usize);
                let steps = rng.random_range(5..=30usize);
                let targets = loop {
                    let len = rng.random_range(1..=4usize);
                    let targets: Vec<usize> =
                        (0..len).map(|_| rng.random_range(1..n_outputs)).collect();
                    if ctc_reachable(steps, &targets) {
                        break targets;
                    }
                };
                let logits: Vec<f64> = (0..steps * n_outputs)
                    .map(|_| normal(&mut rng, sigma))
                    .collect();
                let log_probs = log_softmax_rows(&logits, n_outputs);
                let (ours, reference) = both_paths(&log_probs, n_outputs, &targets);
                if let Some(ours) = ours {
                    ran[k] += 1;
                    if let Err(error) = paths_agree(&ours, &reference) {
                        panic!(
                            "σ = {sigma:.1}, draw {draw}, labels {targets:?}, {steps} steps × \
                             {n_outputs} outputs: {error}"
                        );
                    }
                }
            }
        }
        for (k, &sigma) in sigmas.iter().enumerate() {
            let least = match sigma {
                s if s <= 20.0 => PER_SIGMA,
                s if s <= 60.0 => PER_SIGMA * 98 / 100,
                s if s <= 110.0 => PER_SIGMA * 80 / 100,
                _ => 0,
            };
            assert!(
                ran[k] >= least,
                "σ = {sigma:.1}: the scaled recursion ran on {} of {PER_SIGMA} (per σ: {ran:?})",
                ran[k]
            );
        }
    }

    /// Long utterances of ordinary log-probabilities take the scaled path: 200 steps, 8
    /// outputs, 30 labels, logits from N(0, 10). States far from the likely alignments
    /// underflow there (175–379 raises in each of 40 such draws of a float64 port, whose bound
    /// stayed below 1e-112; a check declining any underflow declined all 40). On each of 4
    /// draws [`scaled`] runs and agrees with [`log_domain`] (loss to 1e-9 relative, gradient to
    /// 1e-6).
    #[test]
    fn long_ordinary_utterances_take_the_scaled_path() {
        let (steps, n_outputs) = (200, 8);
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(200);
        for draw in 0..4 {
            let targets: Vec<usize> = (0..30).map(|_| rng.random_range(1..n_outputs)).collect();
            let logits: Vec<f64> = (0..steps * n_outputs)
                .map(|_| normal(&mut rng, 10.0))
                .collect();
            let log_probs = log_softmax_rows(&logits, n_outputs);
            let (ours, reference) = both_paths(&log_probs, n_outputs, &targets);
            let ours = ours.unwrap_or_else(|| panic!("draw {draw}: the scaled recursion declined"));
            if let Err(error) = paths_agree(&ours, &reference) {
                panic!("draw {draw}: {error}");
            }
        }
    }

    #[test]
    fn ctc_loss_impl_parses_and_prints() {
        for text in ["burn", "alpha-beta"] {
            assert_eq!(text.parse::<CtcLossImpl>().unwrap().to_string(), text);
        }
        let error = "alphabeta".parse::<CtcLossImpl>().unwrap_err();
        assert!(error.contains("alphabeta"), "{error}");
    }

    #[test]
    #[should_panic(expected = "target label 0 must be below n_outputs 4 and differ from blank 0")]
    fn blank_as_a_label_is_refused() {
        ctc_alpha_beta(&[0.0; 8], 2, 4, &[1, 0], 0);
    }
}
