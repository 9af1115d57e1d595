//! Greedy CTC decoding and the phone error rate.

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
