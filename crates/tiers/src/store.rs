//! [`TieredStore`]: an ordered list of tiers, fastest first, with LMCache's semantics:
//! a prefix lookup counts contiguous hits only, a hit in a slower tier is copied up into the
//! faster ones (promotion), and what a tier evicts to make room moves down to the next one
//! (demotion; EVICPRESS's meaning of "eviction").
//!
//! NOTE 1: tier errors never reach the caller. A failing tier is a miss (counted in `errors`):
//! the engine's answer to a miss is to recompute, which is always correct.
//! NOTE 2: an entry stored into tier i that tier i refuses (too large, or an error) moves on to
//! tier i+1, so one oversize chunk does not vanish just because RAM is small.
//! NOTE 3: what falls off the last tier is dropped (counted in `StoreReport::dropped`).
//! NOTE 4: with `write_through_last`, `store` also writes the slowest tier at once, so it
//! holds the master copy (EVICPRESS: "the remote tier keeps everything") and other servers
//! sharing it see a chunk immediately, not only after it is evicted from the faster tiers.
//! Victims are then not demoted into the last tier: they are already there.
//! NOTE 5: a tier does not know the size of a chunk until one arrives (it depends on the
//! model and the codec), so a capacity too small for one chunk cannot be refused when the
//! tier is built. Instead each refusal as too large is counted (`too_large`, metric
//! `pagekeeper:tier_too_large_total`), and the first one per tier is logged as a warning
//! with both sizes: without it such a tier would silently store nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::tier::{Payload, Tier};
use crate::{ChunkKey, TierError};

/// Which leading chunks are stored, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixLookup {
    /// Number of leading keys found (contiguously) in some tier.
    pub chunks_found: usize,
    /// For each of those chunks, the index of the fastest tier that holds it.
    pub tier_of_chunk: Vec<usize>,
}

#[derive(Clone, Debug)]
pub struct Loaded {
    pub payload: Payload,
    /// The tier that served it (before promotion).
    pub tier_index: usize,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreReport {
    /// The fastest tier that accepted the new entry, if any.
    pub stored_in: Option<usize>,
    /// Victims moved into a slower tier.
    pub demoted: usize,
    /// Victims that fell off the last tier, or that no tier accepted.
    pub dropped: usize,
    pub errors: usize,
}

/// Per-tier counters, as a plain struct (also exported through the `metrics` facade with a
/// `tier` label; the binary installs the exporter, which adds `model_name`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierMetricsSnapshot {
    pub name: String,
    pub hits: u64,
    pub misses: u64,
    pub errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub loads: u64,
    pub load_latency_us_total: u64,
    pub promotions_in: u64,
    pub demotions_in: u64,
    pub evictions: u64,
    /// Entries this tier refused as larger than it can hold (NOTE 5).
    pub too_large: u64,
    pub usage_bytes: u64,
    pub capacity_bytes: u64,
}

#[derive(Default)]
struct TierMetrics {
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    loads: AtomicU64,
    load_latency_us_total: AtomicU64,
    promotions_in: AtomicU64,
    demotions_in: AtomicU64,
    evictions: AtomicU64,
    too_large: AtomicU64,
}

struct TierSlot {
    tier: Arc<dyn Tier>,
    metrics: TierMetrics,
    /// Whether the first too-large refusal has been logged (NOTE 5).
    too_large_warned: AtomicBool,
}

impl TierSlot {
    fn count(&self, counter: &AtomicU64, metric: &'static str, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(metric, "tier" => self.tier.name().to_owned()).increment(n);
    }

    fn error(&self, op: &str, err: &TierError) {
        tracing::warn!(tier = self.tier.name(), op, error = %err, "tier error treated as a miss");
        self.count(&self.metrics.errors, "pagekeeper:tier_errors_total", 1);
    }

    /// A failed store: a refusal as too large is counted, and warned about once (NOTE 5);
    /// anything else is an error. Returns whether it was an error.
    fn store_failed(&self, err: &TierError) -> bool {
        let TierError::TooLarge {
            size_bytes,
            limit_bytes,
            ..
        } = err
        else {
            self.error("store", err);
            return true;
        };
        self.count(
            &self.metrics.too_large,
            "pagekeeper:tier_too_large_total",
            1,
        );
        if !self.too_large_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                tier = self.tier.name(),
                size_bytes,
                limit_bytes,
                "tier refused an entry larger than it can hold, so it stores no entry of this size; raise its capacity or remove it (warned once; pagekeeper:tier_too_large_total counts them)"
            );
        }
        false
    }
}

pub struct TieredStore {
    slots: Vec<TierSlot>,
    write_through_last: bool,
}

impl TieredStore {
    /// `tiers` fastest first.
    pub fn new(tiers: Vec<Arc<dyn Tier>>) -> TieredStore {
        TieredStore {
            slots: tiers
                .into_iter()
                .map(|tier| TierSlot {
                    tier,
                    metrics: TierMetrics::default(),
                    too_large_warned: AtomicBool::new(false),
                })
                .collect(),
            write_through_last: false,
        }
    }

    /// See NOTE 4.
    pub fn with_write_through_last(mut self, on: bool) -> TieredStore {
        self.write_through_last = on;
        self
    }

    pub fn tiers(&self) -> impl Iterator<Item = &Arc<dyn Tier>> {
        self.slots.iter().map(|s| &s.tier)
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// How many leading `keys` are stored somewhere, asking each tier only about keys the
    /// faster tiers lack (batched, so Redis costs one round trip per lookup).
    pub fn lookup_prefix(&self, keys: &[ChunkKey]) -> PrefixLookup {
        let mut tier_of: Vec<Option<usize>> = vec![None; keys.len()];
        for (t, slot) in self.slots.iter().enumerate() {
            // A key missing from the faster tiers may still be in this one, gap or not: the
            // prefix is only known once every tier has answered.
            let wanted: Vec<usize> = (0..keys.len()).filter(|&i| tier_of[i].is_none()).collect();
            if wanted.is_empty() {
                break;
            }
            let batch: Vec<ChunkKey> = wanted.iter().map(|&i| keys[i]).collect();
            match slot.tier.contains_many(&batch) {
                Ok(found) => {
                    for (&i, hit) in wanted.iter().zip(found) {
                        if hit {
                            tier_of[i] = Some(t);
                        }
                    }
                }
                Err(e) => slot.error("contains", &e),
            }
        }
        let tier_of_chunk: Vec<usize> = tier_of.iter().map_while(|t| *t).collect();
        // The hit rate operators watch: chunks asked for, and the leading ones some tier
        // holds. (`pagekeeper:tier_misses_total` counts failed loads only, so it cannot
        // say how often a prompt found nothing.)
        metrics::counter!("pagekeeper:tier_lookup_chunks_total").increment(keys.len() as u64);
        metrics::counter!("pagekeeper:tier_lookup_hit_chunks_total")
            .increment(tier_of_chunk.len() as u64);
        PrefixLookup {
            chunks_found: tier_of_chunk.len(),
            tier_of_chunk,
        }
    }

    /// Whether some tier holds each of `keys` (not only a leading run), asking each tier
    /// only about the keys the faster tiers lack, in one batch per tier.
    pub fn contains_each(&self, keys: &[ChunkKey]) -> Vec<bool> {
        let mut found = vec![false; keys.len()];
        for slot in &self.slots {
            let wanted: Vec<usize> = (0..keys.len()).filter(|&i| !found[i]).collect();
            if wanted.is_empty() {
                break;
            }
            let batch: Vec<ChunkKey> = wanted.iter().map(|&i| keys[i]).collect();
            match slot.tier.contains_many(&batch) {
                Ok(hits) => {
                    for (&i, hit) in wanted.iter().zip(hits) {
                        found[i] |= hit;
                    }
                }
                Err(e) => slot.error("contains", &e),
            }
        }
        found
    }

    /// The payload from the fastest tier that has it; a hit below tier 0 is copied into every
    /// faster tier (their victims cascade down).
    pub fn load(&self, key: &ChunkKey) -> Option<Loaded> {
        for (t, slot) in self.slots.iter().enumerate() {
            let started = Instant::now();
            let result = slot.tier.load(key);
            let latency_us = started.elapsed().as_micros() as u64;
            match result {
                Ok(Some(payload)) => {
                    let m = &slot.metrics;
                    slot.count(&m.hits, "pagekeeper:tier_hits_total", 1);
                    slot.count(
                        &m.bytes_read,
                        "pagekeeper:tier_bytes_read_total",
                        payload.len() as u64,
                    );
                    slot.count(&m.loads, "pagekeeper:tier_loads_total", 1);
                    slot.count(
                        &m.load_latency_us_total,
                        "pagekeeper:tier_load_latency_us_total",
                        latency_us,
                    );
                    metrics::histogram!("pagekeeper:tier_load_seconds", "tier" => slot.tier.name().to_owned())
                        .record(latency_us as f64 * 1e-6);
                    for faster in 0..t {
                        let up = &self.slots[faster];
                        up.count(
                            &up.metrics.promotions_in,
                            "pagekeeper:tier_promotions_total",
                            1,
                        );
                        self.insert_from(
                            faster,
                            *key,
                            payload.clone(),
                            &mut StoreReport::default(),
                        );
                    }
                    return Some(Loaded {
                        payload,
                        tier_index: t,
                    });
                }
                Ok(None) => slot.count(&slot.metrics.misses, "pagekeeper:tier_misses_total", 1),
                Err(e) => slot.error("load", &e),
            }
        }
        None
    }

    /// Loads the leading chunks in order, stopping at the first one no tier can serve (a
    /// prefix with a hole is useless to the engine).
    pub fn load_prefix(&self, keys: &[ChunkKey]) -> Vec<Loaded> {
        keys.iter().map_while(|k| self.load(k)).collect()
    }

    /// Deletes `key` from every tier, for a payload a tier served that its reader found
    /// corrupt (a codec check that the tier's own checksum cannot see, or the wrong shape).
    /// Storing the key again would not replace it: a tier re-storing a key it holds only
    /// refreshes it, and the load has promoted the payload into the faster tiers. Returns
    /// how many tiers held it.
    pub fn discard(&self, key: &ChunkKey) -> usize {
        let mut held = 0;
        for slot in &self.slots {
            match slot.tier.delete(key) {
                Ok(true) => held += 1,
                Ok(false) => {}
                Err(e) => slot.error("delete", &e),
            }
        }
        held
    }

    /// Stores into the fastest tier; LRU victims cascade into slower tiers.
    pub fn store(&self, key: &ChunkKey, payload: &Payload) -> StoreReport {
        let mut report = StoreReport::default();
        report.stored_in = self.insert_from(0, *key, payload.clone(), &mut report);
        if report.stored_in.is_none() && !self.slots.is_empty() {
            report.dropped += 1;
        }
        let last = self.slots.len().saturating_sub(1);
        if self.write_through_last && report.stored_in.is_some_and(|t| t < last) {
            let slot = &self.slots[last];
            match slot.tier.store(key, payload) {
                Ok(_) => slot.count(
                    &slot.metrics.bytes_written,
                    "pagekeeper:tier_bytes_written_total",
                    payload.len() as u64,
                ),
                Err(e) => {
                    if slot.store_failed(&e) {
                        report.errors += 1;
                    }
                }
            }
        }
        self.publish_usage();
        report
    }

    /// Sets each tier's usage gauge (stores and their demotions change it).
    fn publish_usage(&self) {
        for slot in &self.slots {
            metrics::gauge!("pagekeeper:tier_usage_bytes", "tier" => slot.tier.name().to_owned())
                .set(slot.tier.usage_bytes() as f64);
        }
    }

    /// Inserts `key` at tier `first` or, if refused, the next one; demotes the victims.
    /// Returns the tier that took `key`.
    fn insert_from(
        &self,
        first: usize,
        key: ChunkKey,
        payload: Payload,
        report: &mut StoreReport,
    ) -> Option<usize> {
        let mut stored_in = None;
        let mut pending = vec![(key, payload, true)];
        let last = self.slots.len().saturating_sub(1);
        for t in first..self.slots.len() {
            if self.write_through_last && t == last && t > first {
                // Victims are already in the write-through tier (NOTE 4).
                pending.retain(|(_, _, is_new)| *is_new);
            }
            let slot = &self.slots[t];
            let mut next = Vec::new();
            for (key, payload, is_new) in pending {
                match slot.tier.store(&key, &payload) {
                    Ok(victims) => {
                        slot.count(
                            &slot.metrics.bytes_written,
                            "pagekeeper:tier_bytes_written_total",
                            payload.len() as u64,
                        );
                        if is_new {
                            stored_in = Some(t);
                        } else {
                            report.demoted += 1;
                            slot.count(
                                &slot.metrics.demotions_in,
                                "pagekeeper:tier_demotions_total",
                                1,
                            );
                        }
                        slot.count(
                            &slot.metrics.evictions,
                            "pagekeeper:tier_evictions_total",
                            victims.len() as u64,
                        );
                        next.extend(victims.into_iter().map(|v| (v.key, v.payload, false)));
                    }
                    Err(e) => {
                        if slot.store_failed(&e) {
                            report.errors += 1;
                        }
                        next.push((key, payload, is_new));
                    }
                }
            }
            pending = next;
            if pending.is_empty() {
                break;
            }
        }
        report.dropped += pending.iter().filter(|(_, _, is_new)| !is_new).count();
        stored_in
    }

    pub fn metrics(&self) -> Vec<TierMetricsSnapshot> {
        self.slots
            .iter()
            .map(|slot| {
                let m = &slot.metrics;
                let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
                let usage_bytes = slot.tier.usage_bytes();
                metrics::gauge!("pagekeeper:tier_usage_bytes", "tier" => slot.tier.name().to_owned()).set(usage_bytes as f64);
                TierMetricsSnapshot {
                    name: slot.tier.name().to_owned(),
                    hits: get(&m.hits),
                    misses: get(&m.misses),
                    errors: get(&m.errors),
                    bytes_read: get(&m.bytes_read),
                    bytes_written: get(&m.bytes_written),
                    loads: get(&m.loads),
                    load_latency_us_total: get(&m.load_latency_us_total),
                    promotions_in: get(&m.promotions_in),
                    demotions_in: get(&m.demotions_in),
                    evictions: get(&m.evictions),
                    too_large: get(&m.too_large),
                    usage_bytes,
                    capacity_bytes: slot.tier.capacity_bytes(),
                }
            })
            .collect()
    }
}
