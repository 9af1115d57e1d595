//! The Rotten Tomatoes sentences with human sentiment ratings, and long documents joined from
//! them.
//!
//! Source: `movieReviewSnippets_GroundTruth.txt` of Hutto & Gilbert, *VADER: A Parsimonious
//! Rule-based Model for Sentiment Analysis of Social Media Text* (ICWSM 2014), shipped in the
//! `vaderSentiment` 3.3.2 sdist on PyPI (MIT licence): 10,605 sentence-level snippets of
//! rottentomatoes.com reviews (Pang & Lee, 2004), each with the mean of ≥ 20 human ratings on
//! −4…+4. `scripts/get-minilm.sh` fetches it.

use std::path::Path;

use anyhow::{Context, bail};

/// One rated sentence.
#[derive(Debug, Clone, PartialEq)]
pub struct Snippet {
    /// Its ID in the file (1-based, in file order).
    pub id: u32,
    /// Mean human sentiment rating, −4 (most negative) … +4 (most positive).
    pub rating: f64,
    /// The sentence.
    pub text: String,
}

impl Snippet {
    /// The sentiment label: `Some(true)` for a positive rating, `Some(false)` for a negative
    /// one, `None` for exactly 0.
    pub fn positive(&self) -> Option<bool> {
        if self.rating > 0.0 {
            Some(true)
        } else if self.rating < 0.0 {
            Some(false)
        } else {
            None
        }
    }
}

/// Reads the tab-separated `ID, MEAN-SENTIMENT-RATING, TEXT-SNIPPET` file.
///
/// # Errors
/// If the file cannot be read or a line does not have the three fields.
pub fn read_snippets(path: &Path) -> anyhow::Result<Vec<Snippet>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut snippets = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.splitn(3, '\t').collect();
        let [id, rating, text] = fields.as_slice() else {
            bail!(
                "{}:{}: expected ID, rating and text separated by tabs",
                path.display(),
                number + 1
            );
        };
        snippets.push(Snippet {
            id: id
                .parse()
                .with_context(|| format!("{}:{}: ID {id:?}", path.display(), number + 1))?,
            rating: rating
                .parse()
                .with_context(|| format!("{}:{}: rating {rating:?}", path.display(), number + 1))?,
            text: text.to_string(),
        });
    }
    Ok(snippets)
}

/// A document of consecutive same-label sentences.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    /// ID of its first sentence.
    pub first_id: u32,
    /// Number of sentences joined.
    pub sentences: usize,
    /// The label its sentences share.
    pub positive: bool,
    /// Word-piece ids, without special tokens, exactly `content_len` of them.
    pub words: Vec<u32>,
}

/// Joins consecutive sentences of the same label, in file order, into documents of exactly
/// `content_len` word pieces: a document takes sentences until it has `content_len` or more
/// and is cut there (the rest of its last sentence is dropped); a sentence of the other
/// label, or rated 0, ends the run, and a run shorter than `content_len` is dropped.
///
/// `words[i]` are the word-piece ids of `snippets[i]`.
///
/// # Panics
/// If `words` and `snippets` differ in length or `content_len` is 0.
pub fn join_documents(
    snippets: &[Snippet],
    words: &[Vec<u32>],
    content_len: usize,
) -> Vec<Document> {
    assert_eq!(
        snippets.len(),
        words.len(),
        "snippets ({}) and words ({}) must pair up",
        snippets.len(),
        words.len()
    );
    assert!(content_len > 0, "content_len must be at least 1");
    let mut documents = Vec::new();
    let mut current: Option<Document> = None;
    for (snippet, ids) in snippets.iter().zip(words) {
        let Some(positive) = snippet.positive() else {
            current = None;
            continue;
        };
        let document = match current.take() {
            Some(document) if document.positive == positive => document,
            _ => Document {
                first_id: snippet.id,
                sentences: 0,
                positive,
                words: Vec::with_capacity(content_len),
            },
        };
        let mut document = document;
        document.sentences += 1;
        let room = content_len - document.words.len();
        document
            .words
            .extend_from_slice(&ids[..ids.len().min(room)]);
        if document.words.len() == content_len {
            documents.push(document);
        } else {
            current = Some(document);
        }
    }
    documents
}

/// Splits documents for the probe: every third (indices 2, 5, 8, …) is a test document, the
/// others train. The file holds mostly positive sentences first, then mostly negative ones
/// (Pang & Lee's positive and negative reviews); taking every third document gives both
/// splits both labels and every part of the file.
pub fn split_documents(documents: Vec<Document>) -> (Vec<Document>, Vec<Document>) {
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for (i, document) in documents.into_iter().enumerate() {
        if i % 3 == 2 {
            test.push(document);
        } else {
            train.push(document);
        }
    }
    (train, test)
}
