//! Compression configurations: what EVICPRESS may do to one stored context's KV
//! (spec `evicpress.md`, "Configuration"), as a grid the placement code enumerates.
//!
//! A configuration is a method and a ratio. For token dropping the ratio is the fraction
//! of tokens dropped (the paper's r). For quantization it is the fraction of the f16 bytes
//! saved by the bit width (q8 0.5, q4 0.75, q2 0.875), so that every configuration can be
//! named `<method>-<ratio>` the same way; the real size, scales included, comes from
//! `pk_codec::compressed_bytes_estimate`.

use std::fmt;

use pk_codec::{DropSpec, KvShape, Method, Precision, QuantSpec};

/// How tokens are ranked for dropping. Every score but SnapKV's and KVzip's is computed from
/// the stored keys and values alone. SnapKV needs the queries of the context's last tokens,
/// and KVzip the model's reconstruction passes over the context, neither of which a stored
/// context has: the engine supplies their scores when it offers the context
/// (`ContextStore::offer_scored`) and the store keeps them with the index entry and in the
/// persisted meta; a context stored without them cannot use those configurations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropScore {
    /// PagedEviction's ‖v‖/‖k‖ (spec `paged-eviction.md`).
    PagedEviction,
    /// Inverse key L2 norm: low-norm keys draw attention.
    KNorm,
    /// KeyDiff: keys least similar to the mean key are kept.
    KeyDiff,
    /// StreamingLLM: the sink and the most recent tokens.
    StreamingLlm,
    /// SnapKV: attention from the context's last 64 tokens (its observation window),
    /// pooled over 5 neighbours (spec `baselines.md`); scores supplied by the engine.
    SnapKv,
    /// KVzip (issue 37): the most attention each token receives while the model is
    /// teacher-forced to repeat the context, averaged over layers and KV heads; scores
    /// supplied by the engine, whose reconstruction passes compute them once per context.
    KvZip,
}

impl DropScore {
    pub fn name(self) -> &'static str {
        match self {
            DropScore::PagedEviction => "paged-eviction",
            DropScore::KNorm => "knorm",
            DropScore::KeyDiff => "keydiff",
            DropScore::StreamingLlm => "streaming-llm",
            DropScore::SnapKv => "snapkv",
            DropScore::KvZip => "kvzip",
        }
    }

    /// Whether the score needs the context's queries (and so must be supplied with it).
    pub fn needs_queries(self) -> bool {
        self == DropScore::SnapKv
    }

    /// Whether the scores come from the engine with the context (SnapKV's and KVzip's),
    /// not from its stored keys and values.
    pub fn is_supplied(self) -> bool {
        matches!(self, DropScore::SnapKv | DropScore::KvZip)
    }

    pub const ALL: [DropScore; 6] = [
        DropScore::PagedEviction,
        DropScore::KNorm,
        DropScore::KeyDiff,
        DropScore::StreamingLlm,
        DropScore::SnapKv,
        DropScore::KvZip,
    ];
}

/// One compression choice for a whole context.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compression {
    None,
    /// KIVI quantization with separate key and value precisions.
    Quant {
        key: Precision,
        value: Precision,
    },
    /// Token dropping at `ratio`, kept tokens in f16.
    Drop {
        score: DropScore,
        ratio: f32,
    },
}

impl Compression {
    /// The pk-codec method that implements this configuration.
    pub fn method(&self) -> Method {
        match *self {
            Compression::None => Method::None,
            Compression::Quant { key, value } => Method::Quant(QuantSpec::kv(key, value)),
            Compression::Drop { ratio, .. } => Method::Drop(DropSpec::new(ratio)),
        }
    }

    /// The scores this configuration drops by, if it drops.
    pub fn drop_score(&self) -> Option<DropScore> {
        match *self {
            Compression::Drop { score, .. } => Some(score),
            _ => None,
        }
    }

    pub fn method_name(&self) -> String {
        match *self {
            Compression::None => "none".into(),
            Compression::Quant { key, value } if key == value => format!("q{}", key.bits()),
            Compression::Quant { key, value } => format!("k{}v{}", key.bits(), value.bits()),
            Compression::Drop { score, .. } => score.name().into(),
        }
    }

    /// r: dropped fraction of tokens, or saved fraction of f16 bits.
    pub fn ratio(&self) -> f32 {
        match *self {
            Compression::None => 0.0,
            Compression::Quant { key, value } => 1.0 - (key.bits() + value.bits()) as f32 / 32.0,
            Compression::Drop { ratio, .. } => ratio,
        }
    }

    /// Encoded size of a context of `shape` under this configuration.
    pub fn bytes(&self, shape: &KvShape) -> u64 {
        pk_codec::compressed_bytes_estimate(&self.method(), shape) as u64
    }

    /// Encoded size of `ctx` (not dropped before) under this configuration, its window
    /// part (a context stored with KV cache groups) included.
    pub fn bytes_of(&self, ctx: &pk_codec::KvContext) -> u64 {
        pk_codec::context_bytes_estimate(&self.method(), ctx) as u64
    }

    /// Parses `none`, `q8`, `q4`, `q2`, `k8v4` (any two of 16/8/4/2), or
    /// `<score>-<ratio>` / `drop-<score>-<ratio>` with a score name of [`DropScore`].
    pub fn parse(s: &str) -> Result<Compression, GridError> {
        let s = s.trim();
        let precision = |bits: &str| match bits {
            "16" => Some(Precision::F16),
            "8" => Some(Precision::Q8),
            "4" => Some(Precision::Q4),
            "2" => Some(Precision::Q2),
            _ => None,
        };
        if s == "none" {
            return Ok(Compression::None);
        }
        if let Some(bits) = s.strip_prefix('q') {
            if let Some(p) = precision(bits) {
                return Ok(Compression::Quant { key: p, value: p });
            }
        }
        if let Some(rest) = s.strip_prefix('k') {
            if let Some((k, v)) = rest.split_once('v') {
                if let (Some(key), Some(value)) = (precision(k), precision(v)) {
                    return Ok(Compression::Quant { key, value });
                }
            }
        }
        let body = s.strip_prefix("drop-").unwrap_or(s);
        if let Some((name, ratio)) = body.rsplit_once('-') {
            if let Some(score) = DropScore::ALL.into_iter().find(|d| d.name() == name) {
                let bad_ratio = || GridError::BadRatio {
                    input: s.to_owned(),
                };
                let ratio: f32 = ratio.parse().map_err(|_| bad_ratio())?;
                if !(0.0..1.0).contains(&ratio) {
                    return Err(bad_ratio());
                }
                return Ok(Compression::Drop { score, ratio });
            }
        }
        Err(GridError::Unknown {
            input: s.to_owned(),
        })
    }
}

impl fmt::Display for Compression {
    /// `<method>-<ratio>`, e.g. `none-0`, `q4-0.75`, `knorm-0.5`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.method_name(), self.ratio())
    }
}

/// A compression name or grid that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GridError {
    #[error("unknown compression {input:?} (expected none, q8, q4, q2, k8v4, or <paged-eviction|knorm|keydiff|streaming-llm|snapkv|kvzip>-<ratio>)")]
    Unknown { input: String },
    #[error("the drop ratio in {input:?} must be a number in [0, 1)")]
    BadRatio { input: String },
    #[error("at most {MAX_GRID_CONFIGS} configurations")]
    TooMany,
}

/// The configurations a store may choose from. Index 0 is always `Compression::None`:
/// the uncompressed master copy, and the configuration of a context that is not yet placed.
#[derive(Clone, Debug, PartialEq)]
pub struct Grid {
    configs: Vec<Compression>,
}

/// Most configurations a grid may hold: bounds the placement's work per decision.
pub const MAX_GRID_CONFIGS: usize = 64;

impl Grid {
    /// `none` followed by `others` (duplicates and extra `none`s removed).
    pub fn new(others: impl IntoIterator<Item = Compression>) -> Result<Grid, GridError> {
        let mut configs = vec![Compression::None];
        for c in others {
            if !configs.contains(&c) {
                configs.push(c);
            }
        }
        if configs.len() > MAX_GRID_CONFIGS {
            return Err(GridError::TooMany);
        }
        Ok(Grid { configs })
    }

    /// A comma-separated list of [`Compression::parse`] names.
    pub fn parse(list: &str) -> Result<Grid, GridError> {
        Grid::new(
            list.split(',')
                .filter(|s| !s.trim().is_empty())
                .map(Compression::parse)
                .collect::<Result<Vec<_>, _>>()?,
        )
    }

    /// The default grid: quantization 8/4/2-bit and K8V4, and dropping by PagedEviction,
    /// KNorm and KeyDiff scores at the paper's ratios. SnapKV (`snapkv-<ratio>`) is opt-in:
    /// its scores cost an attention pass of the context's last 64 queries over the whole
    /// context on the store's worker thread for every new context. KVzip (`kvzip-<ratio>`)
    /// is opt-in too: its scores cost about two prefills of every new context on the
    /// engine's thread.
    pub fn default_grid() -> Grid {
        let mut others = vec![
            Compression::Quant {
                key: Precision::Q8,
                value: Precision::Q8,
            },
            Compression::Quant {
                key: Precision::Q8,
                value: Precision::Q4,
            },
            Compression::Quant {
                key: Precision::Q4,
                value: Precision::Q4,
            },
            Compression::Quant {
                key: Precision::Q2,
                value: Precision::Q2,
            },
        ];
        for score in [
            DropScore::PagedEviction,
            DropScore::KNorm,
            DropScore::KeyDiff,
        ] {
            for ratio in [0.2, 0.4, 0.5, 0.6, 0.8, 0.9] {
                others.push(Compression::Drop { score, ratio });
            }
        }
        Grid::new(others).expect("the default grid is small")
    }

    pub fn configs(&self) -> &[Compression] {
        &self.configs
    }

    pub fn len(&self) -> usize {
        self.configs.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn index_of(&self, c: &Compression) -> Option<usize> {
        self.configs.iter().position(|x| x == c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in Grid::default_grid().configs() {
            let name = match c {
                Compression::Drop { score, ratio } => format!("{}-{}", score.name(), ratio),
                other => other.method_name(),
            };
            assert_eq!(Compression::parse(&name).unwrap(), *c, "{name}");
        }
        assert_eq!(
            Compression::parse("drop-knorm-0.5").unwrap(),
            Compression::Drop {
                score: DropScore::KNorm,
                ratio: 0.5
            }
        );
        assert_eq!(
            Compression::parse("kvzip-0.25").unwrap(),
            Compression::Drop {
                score: DropScore::KvZip,
                ratio: 0.25
            }
        );
        assert!(Compression::parse("knorm-1.5").is_err());
        assert!(Compression::parse("q3").is_err());
        assert_eq!(
            Compression::parse("k8v4").unwrap().to_string(),
            "k8v4-0.625"
        );
    }

    #[test]
    fn sizes_shrink_with_compression() {
        let shape = KvShape {
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 64,
            n_tokens: 512,
        };
        let g = Grid::default_grid();
        let full = g.configs()[0].bytes(&shape);
        for c in &g.configs()[1..] {
            assert!(c.bytes(&shape) < full, "{c} is not smaller");
        }
        let q8 = Compression::parse("q8").unwrap().bytes(&shape) as f64;
        // 8 bits plus an f16 minimum and scale per 32 elements: 9/16 of f16.
        assert!(
            (q8 / full as f64 - 0.5625).abs() < 0.01,
            "{}",
            q8 / full as f64
        );
    }
}
