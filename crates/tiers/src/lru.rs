//! A byte-accounted LRU index shared by the RAM tier (values = payloads) and the disk tier
//! (values = `()`; the bytes live in files).
//!
//! NOTE 1: recency is a strictly increasing tick, so the eviction order is exact and
//! deterministic (tests assert it as a list), unlike timestamps, which can tie.

use std::collections::{BTreeMap, HashMap};

use crate::ChunkKey;

struct Slot<V> {
    tick: u64,
    size_bytes: u64,
    value: V,
}

pub(crate) struct Lru<V> {
    slots: HashMap<ChunkKey, Slot<V>>,
    by_tick: BTreeMap<u64, ChunkKey>,
    next_tick: u64,
    usage_bytes: u64,
}

impl<V> Lru<V> {
    pub fn new() -> Self {
        Lru {
            slots: HashMap::new(),
            by_tick: BTreeMap::new(),
            next_tick: 0,
            usage_bytes: 0,
        }
    }

    pub fn usage_bytes(&self) -> u64 {
        self.usage_bytes
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.slots.contains_key(key)
    }

    /// Inserts as most recently used. The key must not be present.
    pub fn insert(&mut self, key: ChunkKey, size_bytes: u64, value: V) {
        let tick = self.bump();
        let old = self.slots.insert(
            key,
            Slot {
                tick,
                size_bytes,
                value,
            },
        );
        assert!(old.is_none(), "Lru::insert of a present key {key:?}");
        self.by_tick.insert(tick, key);
        self.usage_bytes += size_bytes;
    }

    /// Marks as most recently used and returns the value.
    pub fn touch(&mut self, key: &ChunkKey) -> Option<&V> {
        let tick = self.bump();
        let slot = self.slots.get_mut(key)?;
        self.by_tick.remove(&slot.tick);
        slot.tick = tick;
        self.by_tick.insert(tick, *key);
        Some(&slot.value)
    }

    pub fn remove(&mut self, key: &ChunkKey) -> Option<(u64, V)> {
        let slot = self.slots.remove(key)?;
        self.by_tick.remove(&slot.tick);
        self.usage_bytes -= slot.size_bytes;
        Some((slot.size_bytes, slot.value))
    }

    /// Removes and returns the least recently used entry.
    pub fn pop_lru(&mut self) -> Option<(ChunkKey, u64, V)> {
        let (_, key) = self.by_tick.pop_first()?;
        let slot = self.slots.remove(&key).expect("by_tick and slots agree");
        self.usage_bytes -= slot.size_bytes;
        Some((key, slot.size_bytes, slot.value))
    }

    /// Keys from least to most recently used.
    pub fn keys_lru_first(&self) -> Vec<ChunkKey> {
        self.by_tick.values().copied().collect()
    }

    pub fn check_invariants(&self) {
        assert_eq!(self.slots.len(), self.by_tick.len());
        let mut usage = 0;
        for (tick, key) in &self.by_tick {
            assert_eq!(self.slots[key].tick, *tick);
            usage += self.slots[key].size_bytes;
        }
        assert_eq!(usage, self.usage_bytes);
    }

    fn bump(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }
}
