//! Eviction granularity: which parts of the model choose their tokens together.
//!
//! One block table serves every layer of a sequence, so every layer and KV head stores
//! the same number of tokens. What may differ is *which* tokens: with `layer`, each layer
//! runs its own policy instance over its own keys and values and keeps its own tokens in
//! the table's slots; with `head`, each (layer, KV head) does. The slots of one block then
//! hold different tokens in different layers or heads. Attention needs no positions (keys
//! carry RoPE already), so only sliding-window layers, whose window is over positions,
//! need the kept tokens' positions: they always choose together (one unit), and the
//! sequence's stored positions follow that unit.
//!
//! kvpress selects per layer and per KV head; PagedEviction's authors per layer at prefill.

use std::fmt;
use std::str::FromStr;

/// Which units choose their kept tokens independently (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default, PartialOrd, Ord)]
pub enum KvGranularity {
    /// One selection for all layers and heads, from scores averaged over them.
    #[default]
    Shared,
    /// Each layer selects its own tokens (scores averaged over its KV heads).
    Layer,
    /// Each KV head of each layer selects its own tokens.
    Head,
}

/// The names `KvGranularity` parses, for error messages.
pub const VALID_GRANULARITIES: &str = "shared, layer, head";

impl KvGranularity {
    pub const ALL: [KvGranularity; 3] = [
        KvGranularity::Shared,
        KvGranularity::Layer,
        KvGranularity::Head,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KvGranularity::Shared => "shared",
            KvGranularity::Layer => "layer",
            KvGranularity::Head => "head",
        }
    }
}

impl fmt::Display for KvGranularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvGranularity {
    type Err = super::PolicyError;
    fn from_str(text: &str) -> Result<Self, super::PolicyError> {
        KvGranularity::ALL
            .into_iter()
            .find(|g| g.name() == text.trim())
            .ok_or_else(|| super::PolicyError::UnknownGranularity {
                name: text.to_string(),
            })
    }
}

/// One unit of selection: a set of layers and either every KV head or one.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct SelectionUnit {
    pub layers: Vec<usize>,
    /// `None`: every KV head of `layers`.
    pub kv_head: Option<usize>,
}

/// The selection units of a model with `n_layers` layers of `n_kv_heads` KV heads, where
/// `windowed(layer)` says whether a layer has a sliding window. Windowed layers form one
/// unit of their own at every granularity except `shared` (where one unit holds all).
/// Every (layer, KV head) is in exactly one unit.
pub fn selection_units(
    granularity: KvGranularity,
    n_layers: usize,
    n_kv_heads: usize,
    windowed: impl Fn(usize) -> bool,
) -> Vec<SelectionUnit> {
    if granularity == KvGranularity::Shared {
        return vec![SelectionUnit {
            layers: (0..n_layers).collect(),
            kv_head: None,
        }];
    }
    let windowed_layers: Vec<usize> = (0..n_layers).filter(|&l| windowed(l)).collect();
    let mut units = Vec::new();
    if !windowed_layers.is_empty() {
        units.push(SelectionUnit {
            layers: windowed_layers,
            kv_head: None,
        });
    }
    for layer in (0..n_layers).filter(|&l| !windowed(l)) {
        match granularity {
            KvGranularity::Layer => units.push(SelectionUnit {
                layers: vec![layer],
                kv_head: None,
            }),
            _ => units.extend((0..n_kv_heads).map(|h| SelectionUnit {
                layers: vec![layer],
                kv_head: Some(h),
            })),
        }
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_valid_ones() {
        for g in KvGranularity::ALL {
            assert_eq!(g.name().parse::<KvGranularity>().unwrap(), g);
        }
        let err = "per-token"
            .parse::<KvGranularity>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("per-token") && err.contains(VALID_GRANULARITIES),
            "{err}"
        );
    }

    #[test]
    fn units_cover_every_layer_and_head_once() {
        for g in KvGranularity::ALL {
            // Gemma 3's pattern: every 6th layer global, the others windowed.
            let units = selection_units(g, 12, 2, |l| l % 6 != 5);
            let mut seen = vec![[0u32; 2]; 12];
            for u in &units {
                for &l in &u.layers {
                    match u.kv_head {
                        Some(h) => seen[l][h] += 1,
                        None => seen[l].iter_mut().for_each(|c| *c += 1),
                    }
                }
            }
            assert!(seen.iter().all(|s| *s == [1, 1]), "{g}: {seen:?}");
            let windowed_units = units
                .iter()
                .filter(|u| u.layers.iter().any(|&l| l % 6 != 5))
                .count();
            assert_eq!(windowed_units, 1, "{g}: windowed layers choose together");
        }
        assert_eq!(
            selection_units(KvGranularity::Layer, 30, 3, |_| false).len(),
            30
        );
        assert_eq!(
            selection_units(KvGranularity::Head, 30, 3, |_| false).len(),
            90
        );
        assert_eq!(
            selection_units(KvGranularity::Shared, 30, 3, |_| false).len(),
            1
        );
    }
}
