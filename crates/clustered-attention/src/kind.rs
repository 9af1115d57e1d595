//! [`AttentionKind`], which attention a layer computes, and its parser.

use core::fmt;
use core::str::FromStr;

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use crate::MultiHeadClusteredAttention;

/// Which attention a [`MultiHeadClusteredAttention`] layer computes.
///
/// The kind holds no weights, so a trained layer can switch kind for evaluation
/// ([`MultiHeadClusteredAttention::with_attention`]), as the paper's Table 1 does.
/// Parses from and prints as `full`, `clustered:C`, `improved:C:K`, `blocks:C`,
/// `improved-blocks:C:K`, `shared-full`, `lsh:X` (or `lsh:X:M` for chunks of `M`) and
/// `oracle:K`.
///
/// `shared-full` and `lsh:X` are shared-QK attentions: a layer created with one of them
/// computes its keys with the query projection ([`MultiHeadClusteredAttention::shared_qk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttentionKind {
    /// Full softmax attention (paper eq. 1–2).
    Full,
    /// Clustered attention with `clusters` clusters (paper §3.2, eqs. 3–6).
    Clustered {
        /// Number of clusters `C`.
        clusters: usize,
    },
    /// Improved clustered attention (paper §3.3, eqs. 9–11).
    Improved {
        /// Number of clusters `C`.
        clusters: usize,
        /// Number of keys `k` each cluster attends to most, whose scores are recomputed exactly
        /// for every query of the cluster.
        topk: usize,
    },
    /// Clustered attention whose clusters are `clusters` contiguous blocks of positions
    /// ([`QueryGrouping::PositionBlocks`](crate::QueryGrouping::PositionBlocks)) instead of
    /// groups of similar queries: a baseline of the paper's method, not in the paper.
    Blocks {
        /// Number of blocks `C`.
        clusters: usize,
    },
    /// Improved clustered attention over `clusters` contiguous blocks of positions (as
    /// [`Self::Blocks`]): each block's centroid picks its top-k keys, and its queries attend
    /// to them exactly.
    ImprovedBlocks {
        /// Number of blocks `C`.
        clusters: usize,
        /// Number of keys `k` recomputed exactly per block.
        topk: usize,
    },
    /// Full attention with shared queries and keys, the paper's shared-full
    /// ([`SharedFullAttention`](crate::SharedFullAttention)).
    SharedFull,
    /// Reformer's LSH attention, the paper's lsh-X ([`LshAttention`](crate::LshAttention)).
    Lsh {
        /// Hashing rounds `X`.
        rounds: usize,
        /// Queries per chunk of the sorted sequence.
        chunk_size: usize,
    },
    /// Each query's `topk` highest-scoring keys only, the paper's oracle-top
    /// ([`OracleTopAttention`](crate::OracleTopAttention)).
    OracleTop {
        /// Keys kept per query.
        topk: usize,
    },
}

/// Reformer's chunk size, the default of `lsh:X`.
const DEFAULT_CHUNK_SIZE: usize = 32;

impl AttentionKind {
    /// Whether the attention needs keys computed with the query projection (shared-QK).
    pub fn is_shared_qk(&self) -> bool {
        matches!(self, Self::SharedFull | Self::Lsh { .. })
    }

    /// Checks the kind's numbers: every cluster count, `topk`, `rounds` and `chunk_size` at
    /// least 1.
    ///
    /// # Errors
    /// A sentence naming the number that is 0, e.g. "clusters must be at least 1, got 0".
    pub fn validate(&self) -> Result<(), String> {
        let at_least_one = |name: &str, value: usize| {
            if value > 0 {
                Ok(())
            } else {
                Err(format!("{name} must be at least 1, got 0"))
            }
        };
        match *self {
            AttentionKind::Full | AttentionKind::SharedFull => Ok(()),
            AttentionKind::Lsh { rounds, chunk_size } => {
                at_least_one("rounds", rounds)?;
                at_least_one("chunk_size", chunk_size)
            }
            AttentionKind::OracleTop { topk } => at_least_one("topk", topk),
            AttentionKind::Clustered { clusters } | AttentionKind::Blocks { clusters } => {
                at_least_one("clusters", clusters)
            }
            AttentionKind::Improved { clusters, topk }
            | AttentionKind::ImprovedBlocks { clusters, topk } => {
                at_least_one("clusters", clusters)?;
                at_least_one("topk", topk)
            }
        }
    }

    /// Checks the kind's numbers ([`Self::validate`]).
    ///
    /// # Panics
    /// If a cluster count, `topk`, `rounds` or `chunk_size` is 0.
    pub(crate) fn check(&self) {
        if let Err(message) = self.validate() {
            panic!("{message}");
        }
    }
}

impl fmt::Display for AttentionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Self::Full => "full".to_string(),
            Self::Clustered { clusters } => format!("clustered:{clusters}"),
            Self::Improved { clusters, topk } => format!("improved:{clusters}:{topk}"),
            Self::Blocks { clusters } => format!("blocks:{clusters}"),
            Self::ImprovedBlocks { clusters, topk } => {
                format!("improved-blocks:{clusters}:{topk}")
            }
            Self::SharedFull => "shared-full".to_string(),
            Self::Lsh {
                rounds,
                chunk_size: DEFAULT_CHUNK_SIZE,
            } => format!("lsh:{rounds}"),
            Self::Lsh { rounds, chunk_size } => format!("lsh:{rounds}:{chunk_size}"),
            Self::OracleTop { topk } => format!("oracle:{topk}"),
        };
        f.pad(&text)
    }
}

/// Error returned when an [`AttentionKind`] cannot be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseAttentionKindError(String);

impl fmt::Display for ParseAttentionKindError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid attention kind {:?}: expected full, clustered:C, improved:C:K, blocks:C, improved-blocks:C:K, shared-full, lsh:X, lsh:X:M or oracle:K with C, K, X, M ≥ 1",
            self.0
        )
    }
}

impl std::error::Error for ParseAttentionKindError {}

impl FromStr for AttentionKind {
    type Err = ParseAttentionKindError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let error = || ParseAttentionKindError(s.to_string());
        let number = |part: &str| match part.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(error()),
        };
        let parts: Vec<&str> = s.trim().split(':').collect();
        match parts.as_slice() {
            ["full"] => Ok(Self::Full),
            ["clustered", c] => Ok(Self::Clustered {
                clusters: number(c)?,
            }),
            ["improved", c, k] => Ok(Self::Improved {
                clusters: number(c)?,
                topk: number(k)?,
            }),
            ["blocks", c] => Ok(Self::Blocks {
                clusters: number(c)?,
            }),
            ["improved-blocks", c, k] => Ok(Self::ImprovedBlocks {
                clusters: number(c)?,
                topk: number(k)?,
            }),
            ["shared-full"] => Ok(Self::SharedFull),
            ["lsh", x] => Ok(Self::Lsh {
                rounds: number(x)?,
                chunk_size: DEFAULT_CHUNK_SIZE,
            }),
            ["lsh", x, m] => Ok(Self::Lsh {
                rounds: number(x)?,
                chunk_size: number(m)?,
            }),
            ["oracle", k] => Ok(Self::OracleTop { topk: number(k)? }),
            _ => Err(error()),
        }
    }
}
