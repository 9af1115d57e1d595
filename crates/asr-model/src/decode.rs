//! CTC decoding (greedy, or a prefix beam search with a phone n-gram LM) and the phone error
//! rate.

use crate::phones::BLANK;

/// Greedy (best path) CTC decoding of one utterance: the arg-max output per frame, repeats
/// collapsed, blanks dropped (Graves et al., 2006, section 3.2).
///
/// `best_path` holds the arg-max output of each valid frame (0 = blank).
pub fn greedy_ctc_decode(best_path: &[usize]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut previous = None;
    for &output in best_path {
        if Some(output) != previous && output != BLANK {
            out.push(output);
        }
        previous = Some(output);
    }
    out
}

/// Levenshtein distance between two label sequences (substitutions, insertions and
/// deletions each cost 1), computed by `strsim`.
pub fn edit_distance(hypothesis: &[usize], reference: &[usize]) -> usize {
    strsim::generic_levenshtein(&hypothesis.to_vec(), &reference.to_vec())
}

/// Accumulates the phone error rate over a split: total edit distance / total reference
/// phones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhoneErrorRate {
    /// Sum of the edit distances.
    pub errors: usize,
    /// Sum of the reference lengths.
    pub reference_phones: usize,
}

impl PhoneErrorRate {
    /// Adds one utterance.
    pub fn add(&mut self, hypothesis: &[usize], reference: &[usize]) {
        self.errors += edit_distance(hypothesis, reference);
        self.reference_phones += reference.len();
    }

    /// Adds utterances pairwise: `hypotheses[i]` against `references[i]`.
    ///
    /// # Panics
    /// When the two lists differ in length.
    pub fn add_all(&mut self, hypotheses: &[Vec<usize>], references: &[Vec<usize>]) {
        assert_eq!(
            hypotheses.len(),
            references.len(),
            "{} hypotheses for {} references",
            hypotheses.len(),
            references.len()
        );
        for (hypothesis, reference) in hypotheses.iter().zip(references) {
            self.add(hypothesis, reference);
        }
    }

    /// Adds another accumulator's counts.
    pub fn merge(&mut self, other: PhoneErrorRate) {
        self.errors += other.errors;
        self.reference_phones += other.reference_phones;
    }

    /// The phone error rate in percent (0 when there is no reference phone).
    pub fn percent(&self) -> f64 {
        if self.reference_phones == 0 {
            0.0
        } else {
            100.0 * self.errors as f64 / self.reference_phones as f64
        }
    }
}

/// A phone n-gram language model with Witten–Bell interpolated smoothing (Witten and Bell,
/// 1991; as in Chen and Goodman, 1998, §2.5), over model outputs `1..n_outputs` and an end of
/// utterance. Each utterance is padded with `order − 1` start symbols.
///
/// `P(w | h) = (c(h, w) + T(h) · P(w | h')) / (c(h) + T(h))`, with `h'` the history without its
/// first symbol, `T(h)` the number of distinct symbols seen after `h`, and a history never
/// seen left to `P(w | h')`; below the unigrams, the uniform distribution.
#[derive(Debug, Clone)]
pub struct PhoneLm {
    order: usize,
    n_outputs: usize,
    /// For each history (0 to `order − 1` symbols): counts of the symbols that followed it.
    counts: std::collections::HashMap<Vec<usize>, std::collections::HashMap<usize, u32>>,
}

/// The start-of-utterance symbol of [`PhoneLm`] histories.
const START: usize = usize::MAX;

impl PhoneLm {
    /// The end-of-utterance symbol: scored by [`PhoneLm::log_prob`] like a phone.
    pub const END: usize = usize::MAX - 1;

    /// Counts the n-grams of `utterances` (each a sequence of model outputs, `1..n_outputs`).
    ///
    /// # Panics
    /// When `order` is 0, or an output is 0 (the blank) or not below `n_outputs`.
    pub fn new<'a>(
        order: usize,
        n_outputs: usize,
        utterances: impl IntoIterator<Item = &'a [usize]>,
    ) -> Self {
        assert!(order >= 1, "a phone LM needs order ≥ 1, got 0");
        let mut counts: std::collections::HashMap<_, std::collections::HashMap<_, u32>> =
            Default::default();
        for utterance in utterances {
            let mut symbols = vec![START; order - 1];
            for &output in utterance {
                assert!(
                    output != BLANK && output < n_outputs,
                    "phone LM: output {output} is not a phone of 1..{n_outputs}"
                );
                symbols.push(output);
            }
            symbols.push(Self::END);
            for end in order - 1..symbols.len() {
                for k in 0..order {
                    let history = symbols[end - k..end].to_vec();
                    *counts
                        .entry(history)
                        .or_default()
                        .entry(symbols[end])
                        .or_default() += 1;
                }
            }
        }
        Self {
            order,
            n_outputs,
            counts,
        }
    }

    /// The model's order (n).
    pub fn order(&self) -> usize {
        self.order
    }

    /// The number of model outputs (phones + blank) it was made for.
    pub fn n_outputs(&self) -> usize {
        self.n_outputs
    }

    /// `ln P(symbol | the last order − 1 outputs of prefix)`, `symbol` a phone output or
    /// [`PhoneLm::END`]; histories shorter than `order − 1` are padded with start symbols.
    pub fn log_prob(&self, prefix: &[usize], symbol: usize) -> f64 {
        let k = self.order - 1;
        let mut history: Vec<usize> = vec![START; k.saturating_sub(prefix.len())];
        history.extend_from_slice(&prefix[prefix.len().saturating_sub(k)..]);
        // Phones 1..n_outputs and the end.
        let mut p = 1.0 / self.n_outputs as f64;
        for start in (0..=k).rev() {
            if let Some(next) = self.counts.get(&history[start..]) {
                let total: u32 = next.values().sum();
                let types = next.len() as f64;
                let seen = next.get(&symbol).copied().unwrap_or(0) as f64;
                p = (seen + types * p) / (total as f64 + types);
            }
        }
        p.ln()
    }
}

/// Settings of [`beam_search`].
#[derive(Debug, Clone)]
pub struct BeamSearch {
    /// The phone language model.
    pub lm: PhoneLm,
    /// Prefixes kept after each step.
    pub width: usize,
    /// Weight α of the LM's log-probabilities.
    pub lm_weight: f64,
    /// Bonus β added per emitted phone (against the LM's bias towards short outputs).
    pub insertion_bonus: f64,
}

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

/// CTC prefix beam search with a phone LM (Hannun et al., 2014, "First-pass large vocabulary
/// continuous speech recognition using bi-directional recurrent DNNs", Algorithm 1): the
/// prefix `l` maximizing `ln P_ctc(l | x) + α · ln P_lm(l, end) + β · |l|` among the `width`
/// best prefixes kept at each step.
///
/// `log_probs` holds `steps × n_outputs` log-probabilities (output 0 the blank), row-major.
///
/// # Panics
/// When `log_probs.len()` is not a multiple of the LM's `n_outputs`, or `width` is 0.
pub fn beam_search(log_probs: &[f32], search: &BeamSearch) -> Vec<usize> {
    let n = search.lm.n_outputs;
    assert!(search.width > 0, "beam width must be at least 1, got 0");
    assert!(
        log_probs.len().is_multiple_of(n),
        "log_probs has {} values, not a multiple of n_outputs = {n}",
        log_probs.len()
    );
    type Beams = std::collections::HashMap<Vec<usize>, (f64, f64)>;
    let (alpha, beta) = (search.lm_weight, search.insertion_bonus);
    let mut beams: Beams = [(Vec::new(), (0.0, f64::NEG_INFINITY))].into();
    for row in log_probs.chunks(n) {
        let mut next: Beams = Default::default();
        for (prefix, &(blank, non_blank)) in &beams {
            let total = log_add(blank, non_blank);
            let entry = next
                .entry(prefix.clone())
                .or_insert((f64::NEG_INFINITY, f64::NEG_INFINITY));
            entry.0 = log_add(entry.0, total + row[BLANK] as f64);
            let last = prefix.last().copied();
            for (c, &p) in row.iter().enumerate().skip(1) {
                let p = p as f64;
                if Some(c) == last {
                    let entry = next.get_mut(prefix).expect("inserted above");
                    entry.1 = log_add(entry.1, non_blank + p);
                }
                // A repeated phone is a new one only after a blank.
                let from = if Some(c) == last { blank } else { total };
                if from == f64::NEG_INFINITY {
                    continue;
                }
                let mut extended = prefix.clone();
                extended.push(c);
                let score = from + p + alpha * search.lm.log_prob(prefix, c) + beta;
                let entry = next
                    .entry(extended)
                    .or_insert((f64::NEG_INFINITY, f64::NEG_INFINITY));
                entry.1 = log_add(entry.1, score);
            }
        }
        let mut ranked: Vec<_> = next.into_iter().collect();
        ranked.sort_by(|a, b| {
            log_add(b.1.0, b.1.1)
                .total_cmp(&log_add(a.1.0, a.1.1))
                .then_with(|| a.0.cmp(&b.0))
        });
        ranked.truncate(search.width);
        beams = ranked.into_iter().collect();
    }
    beams
        .into_iter()
        .map(|(prefix, (b, nb))| {
            let score = log_add(b, nb) + alpha * search.lm.log_prob(&prefix, PhoneLm::END);
            (prefix, score)
        })
        .max_by(|a, b| a.1.total_cmp(&b.1).then_with(|| b.0.cmp(&a.0)))
        .map(|(prefix, _)| prefix)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A corpus of phone outputs 1..4 (n_outputs 5).
    fn corpus() -> Vec<Vec<usize>> {
        vec![
            vec![1, 2, 3],
            vec![1, 2, 2, 4],
            vec![3, 1],
            vec![2, 4, 4, 1, 2],
        ]
    }

    fn lm(order: usize) -> PhoneLm {
        PhoneLm::new(order, 5, corpus().iter().map(Vec::as_slice))
    }

    /// Over the phones and the end, P(· | h) sums to 1 for seen, unseen and short histories.
    #[test]
    fn phone_lm_distributions_sum_to_one() {
        for order in 1..=4 {
            let lm = lm(order);
            for history in [&[][..], &[1], &[1, 2], &[4, 4, 4], &[3, 3, 2, 1]] {
                let total: f64 = (1..5)
                    .chain([PhoneLm::END])
                    .map(|w| lm.log_prob(history, w).exp())
                    .sum();
                assert!(
                    (total - 1.0).abs() < 1e-12,
                    "order {order}, history {history:?}: sum {total}"
                );
            }
        }
    }

    /// Witten–Bell values worked out by hand for a bigram model of two utterances.
    #[test]
    fn phone_lm_matches_witten_bell_by_hand() {
        // Outputs 1..3 and the end: a uniform base of 1/4. Unigram counts: 1 twice, 2 once,
        // 3 once, the end twice (6 tokens, 4 types).
        let lm = PhoneLm::new(2, 4, [&[1, 2][..], &[1, 3]]);
        // P(2) = (1 + 4/4) / (6 + 4) = 0.2; after 1: 2 once, 3 once (2 tokens, 2 types).
        let expected = (1.0 + 2.0 * 0.2) / (2.0 + 2.0);
        assert!((lm.log_prob(&[1], 2) - f64::ln(expected)).abs() < 1e-12);
        // P(1) = (2 + 1) / 10; after the start: 1 twice (2 tokens, 1 type).
        let expected = (2.0 + 0.3) / 3.0;
        assert!((lm.log_prob(&[], 1) - f64::ln(expected)).abs() < 1e-12);
        // P(end) = (2 + 1) / 10; after 3: the end once (1 token, 1 type).
        let expected = (1.0 + 0.3) / 2.0;
        assert!((lm.log_prob(&[3], PhoneLm::END) - f64::ln(expected)).abs() < 1e-12);
    }

    /// Pseudo-random log-softmax rows, `steps × n`.
    fn log_probs(steps: usize, n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as f64 / (1u64 << 31) as f64
        };
        (0..steps)
            .flat_map(|_| {
                let logits: Vec<f64> = (0..n).map(|_| 3.0 * next()).collect();
                let norm = logits.iter().map(|l| l.exp()).sum::<f64>().ln();
                logits.into_iter().map(move |l| (l - norm) as f32)
            })
            .collect()
    }

    /// With a beam wide enough to keep every prefix, the beam search finds the labeling of
    /// the highest `ln P_ctc + α ln P_lm + β |l|`, found here by enumerating every alignment
    /// (n^steps paths, collapsed by the CTC rule) and scoring each labeling; to 1e-9 in score.
    #[test]
    fn wide_beam_search_finds_the_best_labeling_of_all_alignments() {
        let (steps, n) = (6, 4);
        let lm = PhoneLm::new(2, n, [&[1, 2][..], &[2, 2, 3], &[3, 1, 1]]);
        for (seed, alpha, beta) in [(1, 0.0, 0.0), (2, 0.7, 0.3), (3, 1.5, -0.5), (4, 0.4, 1.0)] {
            let rows = log_probs(steps, n, seed);
            let mut labelings: std::collections::HashMap<Vec<usize>, f64> = Default::default();
            for path in 0..n.pow(steps as u32) {
                let alignment: Vec<usize> =
                    (0..steps).map(|t| path / n.pow(t as u32) % n).collect();
                let p: f64 = alignment
                    .iter()
                    .enumerate()
                    .map(|(t, &c)| rows[t * n + c] as f64)
                    .sum();
                let entry = labelings
                    .entry(greedy_ctc_decode(&alignment))
                    .or_insert(f64::NEG_INFINITY);
                *entry = log_add(*entry, p);
            }
            let score = |l: &[usize], ctc: f64| {
                let lm_score: f64 = (0..l.len())
                    .map(|i| lm.log_prob(&l[..i], l[i]))
                    .sum::<f64>()
                    + lm.log_prob(l, PhoneLm::END);
                ctc + alpha * lm_score + beta * l.len() as f64
            };
            let (best, best_score) = labelings
                .iter()
                .map(|(l, &ctc)| (l.clone(), score(l, ctc)))
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap();
            let search = BeamSearch {
                lm: lm.clone(),
                width: 10_000,
                lm_weight: alpha,
                insertion_bonus: beta,
            };
            let found = beam_search(&rows, &search);
            let found_score = score(&found, labelings[&found]);
            assert!(
                (found_score - best_score).abs() < 1e-9,
                "seed {seed}: beam {found:?} ({found_score}) against {best:?} ({best_score})"
            );
        }
    }
}
