//! A bounded last tier: the configured capacity of the tier that keeps the masters.
//!
//! The placer decides where each context's placed copy lives and treats the last tier as
//! unlimited, because every stored context keeps its uncompressed master there. A user who
//! gives that tier a capacity (`--tier-disk DIR:SIZE` as the slowest tier) gets it
//! honoured here: after each placement, while the masters and the copies placed beside them
//! exceed it, the store drops whole contexts (master, placed copy and meta entry), the
//! least valuable first. A dropped context is no longer stored: its next request is a miss,
//! recomputed at full quality and offered again, as LMCache's local disk evicts when full
//! (its frequency, profile and supplied scores are remembered, `store::ghosts`).
//!
//! "Least valuable" follows the store's policy. LRU and fixed compression drop the least
//! recently used context. EVICPRESS drops the context whose loss of utility (its current
//! placement's utility minus that of recomputing it, both weighted by its frequency) is
//! smallest, the same greedy that demotes within the tiers, taken one step past the last.
//!
//! This differs from the simulator's bounded scenarios (`Placer::bounded`) and from a
//! store with one copy per context (`store::single_copy`), where a compressed copy on a
//! faster tier may outlive its master; here a context never exists without its master, so
//! a hit can always fall back to it. Meta entries (at most 1 MiB
//! each) are not counted: the tier objects are opened with slack above the logical
//! capacities for them and for the files' headers.

use super::*;

impl ContextStore {
    /// Bytes the index accounts on the last tier: every context's master, and the placed
    /// copies there that are not the master (with one copy per context: the copies there).
    pub fn last_tier_bytes(&self) -> u64 {
        let masters = self.copies == Copies::MasterAndPlaced;
        last_tier_bytes_of(&self.state.lock().unwrap(), self.tiers.len() - 1, masters)
    }

    /// The configured capacity of the last tier (`u64::MAX`: unlimited).
    pub fn last_capacity_bytes(&self) -> u64 {
        self.last_capacity_bytes
    }

    /// Worker: drops whole contexts, the least valuable first, until the last tier is
    /// within its capacity. `arrived` (the context just placed) goes last: it is dropped
    /// only when nothing else is left to drop.
    pub(super) fn enforce_last_capacity(&self, arrived: &ChunkKey) {
        if self.last_capacity_bytes == u64::MAX {
            return;
        }
        let last = self.tiers.len() - 1;
        loop {
            let (key, item) = {
                let mut st = self.state.lock().unwrap();
                if last_tier_bytes_of(&st, last, true) <= self.last_capacity_bytes {
                    return;
                }
                let Some(victim) = self.least_valuable(&st, arrived) else {
                    return;
                };
                let item = self
                    .forget(&mut st, &victim)
                    .expect("chosen from the index");
                st.stats.dropped += 1;
                (victim, item)
            };
            // The index no longer points at these copies; a load that read it before the
            // removal finds them gone and recomputes.
            if (item.tier, item.config) != (last, 0) {
                let _ = self.tiers[item.tier].delete(&copy_key(&key, item.config));
            }
            let _ = self.tiers[last].delete(&copy_key(&key, 0));
            let _ = self.tiers[last].delete(&meta_key(&key));
            metrics::counter!("pagekeeper:evicpress_dropped_total").increment(1);
        }
    }

    /// The context to drop next: by the policy's order, `arrived` only when it is alone.
    fn least_valuable(&self, st: &State, arrived: &ChunkKey) -> Option<ChunkKey> {
        let now = self.now_s();
        let placer = Placer {
            delay: &st.delay,
            policy: &self.policy,
            capacities_bytes: &self.capacities_bytes,
        };
        let cost = |e: &Entry| match self.policy {
            Policy::Lru | Policy::Fixed(_) => e.item.last_access_s,
            Policy::Evicpress { .. } => {
                let freq = e.freq.value_at(now, self.half_life_s).max(1e-9);
                let it = self.placement_item(e, freq);
                placer.utility(&it, it.config, it.tier) - placer.utility(&it, 0, placer.n_tiers())
            }
        };
        let others = st.entries.iter().filter(|(k, _)| *k != arrived);
        let victim = others
            .map(|(k, e)| (cost(e), *k))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1 .0.cmp(&b.1 .0)))
            .map(|(_, k)| k);
        victim.or_else(|| st.entries.contains_key(arrived).then_some(*arrived))
    }
}

/// See [`ContextStore::last_tier_bytes`].
fn last_tier_bytes_of(st: &State, last: usize, masters: bool) -> u64 {
    st.entries
        .values()
        .map(|e| {
            let on_last = e.item.tier == last;
            match masters {
                true => {
                    e.item.bytes[0]
                        + (on_last && e.item.config != 0) as u64 * e.item.bytes[e.item.config]
                }
                false => on_last as u64 * e.item.bytes[e.item.config],
            }
        })
        .sum()
}
