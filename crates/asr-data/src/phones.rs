//! The phone inventory and the folding of `espeak-ng`'s IPA output onto it.
//!
//! The inventory is the 39 phones of the folded TIMIT set (Lee & Hon, 1989), written in IPA:
//! 15 vowels and diphthongs and 24 consonants. Index 0 of the model's output is the CTC blank;
//! phone `i` of the inventory is output `i + 1`.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

/// The 39 phones of the standard inventory, in IPA, in output order (after the blank).
pub const STANDARD_PHONES: [&str; 39] = [
    "iː", "ɪ", "eɪ", "ɛ", "æ", "ɑ", "ʌ", "ə", "ɜ", "ʊ", "uː", "oʊ", "aɪ", "aʊ", "ɔɪ", "p", "b",
    "t", "d", "k", "ɡ", "f", "v", "θ", "ð", "s", "z", "ʃ", "ʒ", "h", "m", "n", "ŋ", "l", "ɹ", "w",
    "j", "tʃ", "dʒ",
];

/// The CTC blank's output index.
pub const BLANK: usize = 0;

/// A fixed phone inventory: phone `i` (0-based) is model output `i + 1`, output 0 the CTC blank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhoneInventory {
    phones: Vec<String>,
    index: HashMap<String, usize>,
}

impl PhoneInventory {
    /// The standard 39-phone inventory ([`STANDARD_PHONES`]).
    pub fn standard() -> Self {
        Self::new(STANDARD_PHONES.iter().map(|p| p.to_string()).collect())
            .expect("the standard inventory has distinct phones")
    }

    /// An inventory from its phones, in output order.
    ///
    /// # Errors
    /// When a phone is empty, contains white space or occurs twice.
    pub fn new(phones: Vec<String>) -> Result<Self, String> {
        let mut index = HashMap::new();
        for (i, p) in phones.iter().enumerate() {
            if p.is_empty() || p.chars().any(char::is_whitespace) {
                return Err(format!(
                    "phone {} ({p:?}) is empty or contains white space",
                    i + 1
                ));
            }
            if index.insert(p.clone(), i).is_some() {
                return Err(format!("phone {p:?} occurs twice"));
            }
        }
        if phones.is_empty() {
            return Err("the inventory has no phones".into());
        }
        Ok(Self { phones, index })
    }

    /// Reads an inventory stored one phone per line (`phones.txt` of a corpus).
    ///
    /// # Errors
    /// When the file cannot be read or its phones are not a valid inventory.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read the phone inventory: {e}", path.display()))?;
        Self::new(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect(),
        )
        .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes the inventory one phone per line.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        crate::files::write_atomic(path, (self.phones.join("\n") + "\n").as_bytes())
    }

    /// Number of phones (without the blank).
    pub fn len(&self) -> usize {
        self.phones.len()
    }

    /// Always false: an inventory has at least one phone.
    pub fn is_empty(&self) -> bool {
        self.phones.is_empty()
    }

    /// Number of model outputs: the phones and the CTC blank.
    pub fn n_outputs(&self) -> usize {
        self.phones.len() + 1
    }

    /// The model output (1-based; 0 is the blank) of a phone, if it is in the inventory.
    pub fn output_of(&self, phone: &str) -> Option<usize> {
        self.index.get(phone).map(|i| i + 1)
    }

    /// The phone of a model output (`1..=len()`); `None` for the blank or out of range.
    pub fn phone_of(&self, output: usize) -> Option<&str> {
        output
            .checked_sub(1)
            .and_then(|i| self.phones.get(i))
            .map(String::as_str)
    }

    /// The phones, in output order.
    pub fn phones(&self) -> &[String] {
        &self.phones
    }
}

/// An IPA symbol from `espeak-ng --ipa` that the folding table does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownSymbol(pub String);

impl fmt::Display for UnknownSymbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IPA symbol {:?} has no phone in the inventory", self.0)
    }
}

impl std::error::Error for UnknownSymbol {}

/// Folds one `espeak-ng --ipa --sep=" "` token (one phoneme, stress marks included) onto
/// the standard inventory: stress and syllabic marks are dropped, accent variants merged
/// (e.g. `ɒ`, `ɔː` → `ɑ`; `ɾ`, `ʔ` → `t`; `ɚ` → `ɜ`), centring diphthongs split in two
/// (`ɪə` → `ɪ ə`), following the TIMIT 61 → 39 folding where the two overlap.
///
/// # Errors
/// [`UnknownSymbol`] for a token the table does not cover.
pub fn fold_ipa(token: &str) -> Result<Vec<&'static str>, UnknownSymbol> {
    let cleaned: String = token
        .chars()
        .filter(|c| !matches!(c, 'ˈ' | 'ˌ' | '\u{0329}' | '\u{032A}' | '\u{0361}' | '-'))
        .collect();
    let folded: &[&str] = match cleaned.as_str() {
        "" => &[],
        "iː" | "i" => &["iː"],
        "ɪ" | "ᵻ" | "ɨ" | "ɪː" => &["ɪ"],
        "eɪ" | "e" | "eː" | "ɛɪ" | "ei" | "eʲ" => &["eɪ"],
        "ɛ" | "ɛː" => &["ɛ"],
        "æ" | "a" | "aː" | "æː" => &["æ"],
        "ɑː" | "ɑ" | "ɒ" | "ɒː" | "ɔ" | "ɔː" | "a:" | "aa" => &["ɑ"],
        "ʌ" | "ɐ" | "ɐː" => &["ʌ"],
        "ə" | "ᵊ" | "əː" => &["ə"],
        "ɜː" | "ɜ" | "ɝ" | "ɚ" | "øː" | "əɹ" => &["ɜ"],
        "ʊ" | "ʊ̈" | "ɵ" => &["ʊ"],
        "uː" | "u" | "ʉː" | "ʉ" | "ɯ" => &["uː"],
        "oʊ" | "əʊ" | "o" | "oː" | "ɔʊ" | "əu" | "ʌʊ" => &["oʊ"],
        "aɪ" | "ʌɪ" | "ɑɪ" | "ɐɪ" | "əɪ" => &["aɪ"],
        "aʊ" | "ʌʊ̈" | "ʌʉ" | "æʊ" | "ɐʊ" | "əʉ" => &["aʊ"],
        "ɔɪ" | "ɒɪ" | "oɪ" => &["ɔɪ"],
        "ɪə" | "iə" | "ɪɚ" | "iɚ" => &["ɪ", "ə"],
        "eə" | "ɛə" | "eɚ" | "ɛɚ" => &["ɛ", "ə"],
        "ʊə" | "ʊɚ" | "uə" => &["ʊ", "ə"],
        "ɔə" | "oə" | "ɔɚ" | "oɚ" | "ɑə" => &["ɑ", "ə"],
        "aɪə" | "aɪɚ" | "ʌɪə" => &["aɪ", "ə"],
        "aʊə" | "aʊɚ" => &["aʊ", "ə"],
        "ɑːɹ" | "ɔːɹ" | "oːɹ" | "ɔɹ" | "oɹ" => &["ɑ", "ɹ"],
        "ɛɹ" | "eɹ" => &["ɛ", "ɹ"],
        "ɪɹ" | "iɹ" => &["ɪ", "ɹ"],
        "ʊɹ" | "ʉɹ" | "uɹ" => &["ʊ", "ɹ"],
        "ʌɹ" => &["ʌ", "ɹ"],
        "əl" => &["ə", "l"],
        "p" => &["p"],
        "b" => &["b"],
        "t" | "ɾ" | "ʔ" | "t̪" | "tʰ" => &["t"],
        "d" | "d̪" => &["d"],
        "k" | "x" | "kʰ" => &["k"],
        "ɡ" | "g" => &["ɡ"],
        "f" => &["f"],
        "v" => &["v"],
        "θ" => &["θ"],
        "ð" => &["ð"],
        "s" => &["s"],
        "z" => &["z"],
        "ʃ" => &["ʃ"],
        "ʒ" => &["ʒ"],
        "h" | "ɦ" => &["h"],
        "m" => &["m"],
        "n" | "ɲ" => &["n"],
        "ŋ" => &["ŋ"],
        "l" | "ɫ" | "ɬ" => &["l"],
        "ɹ" | "r" | "ɻ" | "ɚɹ" => &["ɹ"],
        "w" | "ʍ" => &["w"],
        "j" => &["j"],
        "tʃ" => &["tʃ"],
        "dʒ" => &["dʒ"],
        _ => return Err(UnknownSymbol(token.to_string())),
    };
    Ok(folded.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folding_targets_are_in_the_standard_inventory() {
        let inventory = PhoneInventory::standard();
        for token in [
            "ˈiː", "ᵻ", "ˈeɪ", "ɒ", "ɚ", "ɾ", "ʔ", "ˈɪə", "aɪə", "t̪", "n̩", "ɡ", "ʌʉ",
        ] {
            for phone in fold_ipa(token).unwrap() {
                assert!(inventory.output_of(phone).is_some(), "{token} -> {phone}");
            }
        }
        assert_eq!(fold_ipa("ˈɪə").unwrap(), ["ɪ", "ə"]);
        assert!(fold_ipa("ʘ").is_err());
    }
}
