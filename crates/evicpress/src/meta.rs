//! The persisted part of a context's index entry: its profile, access count and decayed
//! frequency, and the queries kept for re-profiling. It is stored beside the context's
//! master on the last tier, so that what a restart (a disk last tier) or another server (a
//! shared Redis) adopts is the context as it was known, not a stranger to be profiled again
//! under the prior. LMCache loses its disk index on restart; a master alone would lose
//! everything EVICPRESS learnt about the context.
//!
//! Format: a 32-byte BLAKE3 digest of the rest, then JSON. A digest mismatch, a parse
//! error, another version or a grid that differs from the store's makes the entry ignored
//! (the context is then adopted with the prior, as without it); it is never trusted.

use pk_tiers::ChunkKey;
use serde::{Deserialize, Serialize};

pub(crate) const META_VERSION: u32 = 1;
/// Larger entries are refused on both sides: queries are bounded by the store's limit,
/// and nothing else grows.
pub(crate) const MAX_META_BYTES: usize = 1 << 20;

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct ContextMeta {
    pub version: u32,
    /// The grid's configurations by name: a profile only means something for its grid.
    pub grid: Vec<String>,
    pub profile: Option<Vec<f32>>,
    pub hits: u64,
    /// The decayed access count at `saved_unix_s`.
    pub frequency: f64,
    pub saved_unix_s: f64,
    pub queries: Vec<Vec<u32>>,
    /// SnapKV token scores (computed by the engine when it offered the context; they cannot
    /// be recomputed from the KV). Absent in entries written before they existed.
    #[serde(default)]
    pub snapkv_scores: Option<Vec<f32>>,
    /// KVzip token scores (computed by the engine's reconstruction passes when it offered
    /// the context). Absent in entries written before they existed.
    #[serde(default)]
    pub kvzip_scores: Option<Vec<f32>>,
}

/// Where a context's meta entry lives on the last tier.
pub(crate) fn meta_key(ctx: &ChunkKey) -> ChunkKey {
    let mut h = blake3::Hasher::new();
    h.update(b"pagekeeper-evicpress-meta-v1");
    h.update(&ctx.0);
    ChunkKey(*h.finalize().as_bytes())
}

pub(crate) fn unix_now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Why a stored meta entry is ignored (the context is then re-profiled).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MetaError {
    #[error("meta entry of {0} bytes")]
    Size(usize),
    #[error("meta entry checksum mismatch")]
    Checksum,
    #[error("meta entry: {0}")]
    Json(String),
    #[error("meta entry version {0} (expected {META_VERSION})")]
    Version(u32),
    #[error("meta entry made for another grid")]
    OtherGrid,
    #[error("meta entry {0} malformed")]
    Malformed(&'static str),
}

impl ContextMeta {
    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("plain data serialises");
        let mut out = blake3::hash(&json).as_bytes().to_vec();
        out.extend_from_slice(&json);
        out
    }

    /// Decodes and validates an entry for a store whose grid is `grid`.
    pub fn decode(bytes: &[u8], grid: &[String]) -> Result<ContextMeta, MetaError> {
        if bytes.len() < 32 || bytes.len() > MAX_META_BYTES {
            return Err(MetaError::Size(bytes.len()));
        }
        let (digest, json) = bytes.split_at(32);
        if blake3::hash(json).as_bytes() != digest {
            return Err(MetaError::Checksum);
        }
        let m: ContextMeta =
            serde_json::from_slice(json).map_err(|e| MetaError::Json(e.to_string()))?;
        if m.version != META_VERSION {
            return Err(MetaError::Version(m.version));
        }
        if m.grid != grid {
            return Err(MetaError::OtherGrid);
        }
        if let Some(p) = &m.profile {
            if p.len() != grid.len() || p.iter().any(|q| !(0.0..=1.0).contains(q)) {
                return Err(MetaError::Malformed("profile"));
            }
        }
        if !(m.frequency.is_finite() && m.frequency >= 0.0 && m.saved_unix_s.is_finite()) {
            return Err(MetaError::Malformed("frequency"));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ContextMeta {
        ContextMeta {
            version: META_VERSION,
            grid: vec!["none-0".into(), "q8".into()],
            profile: Some(vec![1.0, 0.9]),
            hits: 7,
            frequency: 3.5,
            saved_unix_s: 1.0e9,
            queries: vec![vec![1, 2, 3]],
            snapkv_scores: Some(vec![0.5, 0.25]),
            kvzip_scores: Some(vec![0.75, 0.125]),
        }
    }

    #[test]
    fn round_trips_and_rejects_damage() {
        let m = meta();
        let grid = m.grid.clone();
        let bytes = m.encode();
        assert_eq!(ContextMeta::decode(&bytes, &grid).unwrap(), m);
        let mut bad = bytes.clone();
        let last = bad.len() - 2;
        bad[last] ^= 1;
        assert!(ContextMeta::decode(&bad, &grid)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
        assert!(ContextMeta::decode(&bytes[..20], &grid).is_err());
        assert!(ContextMeta::decode(&bytes, &["none-0".to_string()])
            .unwrap_err()
            .to_string()
            .contains("grid"));
        let mut wrong = meta();
        wrong.profile = Some(vec![1.0, 1.5]);
        assert!(ContextMeta::decode(&wrong.encode(), &grid)
            .unwrap_err()
            .to_string()
            .contains("profile"));
    }
}
