//! Tests of the CTC loss: against burn-nn's `CTCLoss`, the sum over alignments, the scaled and
//! log-domain recursions against each other.

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
        let labels =
            Tensor::<2, Int>::from_data(TensorData::new(padded.clone(), [batch, width]), &device);
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
    let logits = Tensor::<2>::random([steps, n_outputs], Distribution::Normal(0.0, 1.5), &cpu());
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
    let ours = scaled(log_probs, n_outputs, &lattice, &mut gradient).map(|loss| (loss, gradient));
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
