//! Placement: which (tier, configuration) each stored context gets (spec "Placement").
//!
//! Pure and synchronous: it reads a snapshot of the contexts and returns the new
//! assignment; the store executes the moves on its worker thread. The work per decision is
//! bounded by `MAX_STEPS_PER_TIER` greedy steps per tier, each `O(contexts × configs)`.
//!
//! EVICPRESS (the paper's greedy multi-choice knapsack): a context that arrives or is hit
//! goes to the fastest tier with its best configuration there; then, for each tier S from
//! the fastest, while S holds more bytes than its capacity, every context on S offers its
//! options (a smaller configuration on S, or any configuration on the next tier) and the
//! option with the smallest utility drop is applied: by absolute drop (EVICPRESS) or by
//! drop per byte freed (AdaptCache). What is demoted is then subject to the next tier's
//! capacity. The store's last tier is unlimited (it keeps every master).
//!
//! Bounded tiers (the simulator's scenarios where all tiers together hold less than the
//! working set, the regime of the EVICPRESS paper): a last capacity other than `u64::MAX`
//! is enforced too, and what is demoted from the last tier is dropped (`tier ==
//! n_tiers`): its next request recomputes it at full quality, at the delay model's
//! `recompute_s`. A context kept only compressed has no master to re-encode from
//! (`Item::master` false): it can move down or be dropped, never change configuration.
//!
//! The baselines use the same machinery: `Lru` places every context uncompressed and
//! demotes the least recently used one; `Fixed` does the same with one configuration for
//! every context (the "fixed ratio + LRU" of the paper's comparison).

use serde::Serialize;

use crate::model::{utility, DelayModel};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ranking {
    /// The paper's greedy: smallest absolute utility drop first.
    AbsoluteDrop,
    /// AdaptCache's: smallest utility drop per byte freed first.
    DropPerByte,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Policy {
    /// LMCache-like: no compression, least recently used demoted first.
    Lru,
    /// One configuration (a grid index) for every context, LRU demotion.
    Fixed(usize),
    Evicpress {
        alpha: f64,
        ranking: Ranking,
    },
}

impl Policy {
    pub fn name(&self) -> String {
        match self {
            Policy::Lru => "lru".into(),
            Policy::Fixed(c) => format!("fixed#{c}"),
            Policy::Evicpress { .. } => "evicpress".into(),
        }
    }
}

/// One stored context as placement sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    /// Encoded bytes under each configuration of the grid.
    pub bytes: Vec<u64>,
    /// Stored tokens under each configuration.
    pub kept_tokens: Vec<usize>,
    /// Quality under each configuration, in [0, 1].
    pub quality: Vec<f32>,
    pub frequency: f64,
    pub last_access_s: f64,
    /// Tier index, or `n_tiers` for a context dropped from bounded tiers.
    pub tier: usize,
    pub config: usize,
    /// Whether the full KV exists to encode another configuration from (a master copy,
    /// or the KV a miss just computed); false only for bounded tiers' compressed copies.
    pub master: bool,
}

/// Greedy steps per tier and decision; generous (a step moves one context) but finite.
pub const MAX_STEPS_PER_TIER: usize = 4096;

pub struct Placer<'a> {
    pub delay: &'a DelayModel,
    pub policy: &'a Policy,
    /// Logical capacity of each tier in bytes (the last one is treated as unlimited).
    pub capacities_bytes: &'a [u64],
}

impl Placer<'_> {
    pub fn n_tiers(&self) -> usize {
        self.capacities_bytes.len()
    }

    /// Whether the last tier's capacity is enforced (anything but `u64::MAX`), so that
    /// contexts may be dropped.
    pub fn bounded(&self) -> bool {
        self.capacities_bytes.last().is_some_and(|&c| c != u64::MAX)
    }

    /// The utility of serving `item` from `config` on `tier`; on the dropped "tier" past
    /// the last, a recompute at full quality.
    pub fn utility(&self, item: &Item, config: usize, tier: usize) -> f64 {
        let alpha = match self.policy {
            Policy::Evicpress { alpha, .. } => *alpha,
            _ => 1.0,
        };
        let (quality, ttft) = if tier >= self.n_tiers() {
            (item.quality[0], self.delay.recompute_s(item.kept_tokens[0]))
        } else {
            let ttft = self
                .delay
                .ttft_s(tier, item.bytes[config], item.kept_tokens[config]);
            (item.quality[config], ttft)
        };
        utility(alpha, quality as f64, ttft, item.frequency)
    }

    /// The configuration a context gets when it (re)enters `tier`: without a master, the
    /// one it has.
    fn entry_config(&self, item: &Item, tier: usize) -> usize {
        if !item.master {
            return item.config;
        }
        match self.policy {
            Policy::Lru => 0,
            Policy::Fixed(c) => *c,
            Policy::Evicpress { .. } => (0..item.bytes.len())
                .max_by(|&a, &b| {
                    self.utility(item, a, tier)
                        .total_cmp(&self.utility(item, b, tier))
                        .then(b.cmp(&a))
                })
                .unwrap_or(0),
        }
    }

    fn usage(items: &[Item], tier: usize) -> u64 {
        items
            .iter()
            .filter(|i| i.tier == tier)
            .map(|i| i.bytes[i.config])
            .sum()
    }

    /// Places `items[arrived]` on the fastest tier (it was just stored or hit), then
    /// restores every capacity. Returns the number of greedy steps taken.
    pub fn place(&self, items: &mut [Item], arrived: Option<usize>) -> usize {
        if let Some(a) = arrived {
            let config = self.entry_config(&items[a], 0);
            items[a].tier = 0;
            items[a].config = config;
        }
        let mut steps = 0;
        let limited = self.n_tiers() - usize::from(!self.bounded());
        for tier in 0..limited {
            let capacity = self.capacities_bytes[tier];
            let mut usage = Self::usage(items, tier);
            let mut tier_steps = 0;
            while usage > capacity && tier_steps < MAX_STEPS_PER_TIER {
                let Some((i, to_tier, to_config)) = self.best_option(items, tier) else {
                    break;
                };
                let item = &mut items[i];
                usage -= item.bytes[item.config];
                if to_tier == tier {
                    usage += item.bytes[to_config];
                }
                item.tier = to_tier;
                item.config = to_config;
                tier_steps += 1;
            }
            steps += tier_steps;
        }
        if self.bounded() {
            // Bounded tiers keep one copy per context: a compressed one is all there is.
            for it in items.iter_mut().filter(|it| it.config != 0) {
                it.master = false;
            }
        }
        steps
    }

    /// The option to apply next on an over-full `tier`: (item, new tier, new config).
    fn best_option(&self, items: &[Item], tier: usize) -> Option<(usize, usize, usize)> {
        let on_tier = items.iter().enumerate().filter(|(_, it)| it.tier == tier);
        match self.policy {
            Policy::Lru | Policy::Fixed(_) => on_tier
                .min_by(|a, b| a.1.last_access_s.total_cmp(&b.1.last_access_s))
                .map(|(i, it)| (i, tier + 1, it.config)),
            Policy::Evicpress { ranking, .. } => {
                let mut best: Option<(f64, usize, usize, usize)> = None;
                for (i, it) in on_tier {
                    let current = self.utility(it, it.config, tier);
                    let current_bytes = it.bytes[it.config];
                    let mut consider = |to_tier: usize, to_config: usize, freed: u64| {
                        if freed == 0 {
                            return;
                        }
                        let drop = current - self.utility(it, to_config, to_tier);
                        let key = match ranking {
                            Ranking::AbsoluteDrop => drop,
                            Ranking::DropPerByte => drop / freed as f64,
                        };
                        if best.is_none_or(|b| key < b.0) {
                            best = Some((key, i, to_tier, to_config));
                        }
                    };
                    if !it.master {
                        consider(tier + 1, it.config, current_bytes);
                        continue;
                    }
                    for c in 0..it.bytes.len() {
                        if it.bytes[c] < current_bytes {
                            consider(tier, c, current_bytes - it.bytes[c]);
                        }
                        // Dropped is one option, not one per configuration.
                        if tier + 1 < self.n_tiers() || c == 0 {
                            consider(tier + 1, c, current_bytes);
                        }
                    }
                }
                best.map(|(_, i, t, c)| (i, t, c))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TierSpec;

    fn delay(bw: [f64; 3]) -> DelayModel {
        let tier = |name: &str, bw: f64| TierSpec {
            name: name.into(),
            capacity_bytes: 0,
            read_bytes_per_s: bw,
            access_latency_s: 0.0,
        };
        DelayModel {
            tiers: vec![
                tier("ram", bw[0]),
                tier("disk", bw[1]),
                tier("remote", bw[2]),
            ],
            decode_s_per_byte: 0.0,
            restore_s_per_token: 0.0,
            prefill_tokens_per_s: 1000.0,
            query_tokens: 0,
        }
    }

    /// Configs: none (100 bytes, q 1.0), half (50 bytes, q 0.99), tenth (10 bytes, q 0.2).
    fn item(freq: f64, last: f64) -> Item {
        Item {
            bytes: vec![100, 50, 10],
            kept_tokens: vec![10, 10, 1],
            quality: vec![1.0, 0.99, 0.2],
            frequency: freq,
            last_access_s: last,
            tier: 2,
            config: 0,
            master: true,
        }
    }

    #[test]
    fn lru_demotes_the_least_recent_uncompressed() {
        let d = delay([1000.0, 100.0, 10.0]);
        let caps = [200, 100, u64::MAX];
        let p = Placer {
            delay: &d,
            policy: &Policy::Lru,
            capacities_bytes: &caps,
        };
        let mut items = vec![item(1.0, 0.0), item(1.0, 1.0), item(1.0, 2.0)];
        for i in 0..3 {
            p.place(&mut items, Some(i));
        }
        let at: Vec<_> = items.iter().map(|i| (i.tier, i.config)).collect();
        assert_eq!(at, vec![(1, 0), (0, 0), (0, 0)]);
    }

    #[test]
    fn evicpress_compresses_where_quality_holds_and_keeps_capacity() {
        let d = delay([1000.0, 100.0, 10.0]);
        let caps = [200, 100, u64::MAX];
        let p = Placer {
            delay: &d,
            policy: &Policy::Evicpress {
                alpha: 1.0,
                ranking: Ranking::AbsoluteDrop,
            },
            capacities_bytes: &caps,
        };
        let mut items = vec![
            item(1.0, 0.0),
            item(1.0, 1.0),
            item(1.0, 2.0),
            item(1.0, 3.0),
        ];
        for i in 0..4 {
            p.place(&mut items, Some(i));
        }
        // Four contexts at 50 bytes fit the 200-byte tier; nothing is pushed to 0.2 quality.
        for it in &items {
            assert_eq!((it.tier, it.config), (0, 1), "{items:?}");
        }
        for (tier, &cap) in caps.iter().enumerate().take(2) {
            assert!(Placer::usage(&items, tier) <= cap);
        }
    }

    #[test]
    fn bounded_tiers_drop_what_does_not_fit() {
        let d = delay([1000.0, 100.0, 10.0]);
        // 200 + 100 + 100 bytes for five 100-byte masters.
        let caps = [200, 100, 100];
        let lru = Placer {
            delay: &d,
            policy: &Policy::Lru,
            capacities_bytes: &caps,
        };
        assert!(lru.bounded());
        let mut items: Vec<Item> = (0..5).map(|i| item(1.0, i as f64)).collect();
        for i in 0..5 {
            lru.place(&mut items, Some(i));
        }
        let at: Vec<_> = items.iter().map(|i| i.tier).collect();
        assert_eq!(at, vec![3, 2, 1, 0, 0], "the least recent is dropped");
        // A recompute costs (10 tokens) / 1000 tok/s at full quality.
        let u = lru.utility(&items[0], 0, 3);
        assert!((u - (1.0 - 0.01)).abs() < 1e-9, "{u}");
    }

    #[test]
    fn a_compressed_copy_without_master_keeps_its_configuration() {
        let d = delay([1000.0, 100.0, 10.0]);
        let caps = [50, 50, 50];
        let p = Placer {
            delay: &d,
            policy: &Policy::Evicpress {
                alpha: 1.0,
                ranking: Ranking::AbsoluteDrop,
            },
            capacities_bytes: &caps,
        };
        let mut items = vec![item(1.0, 0.0)];
        items[0].config = 2;
        items[0].master = false;
        p.place(&mut items, Some(0));
        assert_eq!(
            (items[0].tier, items[0].config),
            (0, 2),
            "hit: no master, so no better configuration"
        );
        // Over-full RAM: it can only move down, configuration unchanged.
        let mut items = vec![item(1.0, 0.0), item(1.0, 1.0)];
        for it in items.iter_mut() {
            (it.tier, it.config, it.master) = (0, 1, false);
        }
        p.place(&mut items, None);
        assert!(items.iter().all(|i| i.config == 1), "{items:?}");
        assert_eq!(items.iter().filter(|i| i.tier == 0).count(), 1);
    }

    #[test]
    fn equal_bandwidths_leave_nothing_to_gain() {
        let d = delay([100.0, 100.0, 100.0]);
        let caps = [100, 100, u64::MAX];
        let p = Placer {
            delay: &d,
            policy: &Policy::Evicpress {
                alpha: 1.0,
                ranking: Ranking::DropPerByte,
            },
            capacities_bytes: &caps,
        };
        let mut items = vec![item(1.0, 0.0), item(1.0, 1.0), item(1.0, 2.0)];
        for i in 0..3 {
            p.place(&mut items, Some(i));
        }
        // Moving costs nothing in delay, so the greedy demotes rather than lose quality.
        let compressed = items
            .iter()
            .filter(|i| i.config != 1 && i.config != 0)
            .count();
        assert_eq!(compressed, 0, "{items:?}");
    }
}
