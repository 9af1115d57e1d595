//! No code: the features that the workspace's programs (`asr`, `text-encoder`) ask of the
//! dependencies they share with Burn, unified in this crate's manifest, so that one build of
//! Burn's crates serves both (see its Cargo.toml).
