//! Values saved as JSON files, written whole or not at all: the training log
//! ([`TrainingLog`](crate::train::TrainingLog)) and the tables' results
//! ([`compare`](crate::compare)).

use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Writes `value` as pretty JSON to `path`, through a temporary file in the same directory
/// renamed into place, so the file is whole or absent.
///
/// # Errors
/// When the directory cannot be written.
pub fn save_json<T: Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)? + "\n";
    asr_data::files::write_atomic(path, text.as_bytes())
        .with_context(|| format!("{}: cannot write", path.display()))
}

/// Reads a value written by [`save_json`].
///
/// # Errors
/// When the file cannot be read or does not hold a `T`.
pub fn load_json<T: DeserializeOwned>(path: &Path) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: not a saved result", path.display()))
}
