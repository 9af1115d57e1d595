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
mod tests;
