//! The CPU-RAM tier: payloads held in memory under a byte capacity, evicted in LRU order.
//! Evicted payloads are returned to the caller for demotion, never silently dropped.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::lru::Lru;
use crate::tier::{BandwidthEstimate, BandwidthMeter, Evicted, Payload, Tier};
use crate::{ChunkKey, TierError};

pub struct RamTier {
    name: String,
    capacity_bytes: u64,
    entries: Mutex<Lru<Payload>>,
    meter: BandwidthMeter,
}

impl RamTier {
    pub fn new(capacity_bytes: u64) -> RamTier {
        RamTier::named("ram", capacity_bytes)
    }

    pub fn named(name: &str, capacity_bytes: u64) -> RamTier {
        // Loads hand out a shared pointer, so timing them says nothing about bandwidth. What
        // the delay model needs is how fast the engine can copy the bytes into its pool: a
        // memcpy, measured once here.
        let memcpy_bytes_per_s = measure_memcpy_bytes_per_s();
        RamTier {
            name: name.to_owned(),
            capacity_bytes,
            entries: Mutex::new(Lru::new()),
            meter: BandwidthMeter::with_prior(memcpy_bytes_per_s, memcpy_bytes_per_s),
        }
    }

    /// Keys from least to most recently used (the eviction order).
    pub fn keys_lru_first(&self) -> Vec<ChunkKey> {
        self.entries.lock().unwrap().keys_lru_first()
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn check_invariants(&self) {
        let entries = self.entries.lock().unwrap();
        entries.check_invariants();
        assert!(entries.usage_bytes() <= self.capacity_bytes);
    }
}

impl Tier for RamTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn store(&self, key: &ChunkKey, payload: &Payload) -> Result<Vec<Evicted>, TierError> {
        let started = Instant::now();
        let size_bytes = payload.len() as u64;
        if size_bytes > self.capacity_bytes {
            return Err(TierError::TooLarge {
                tier: self.name.clone(),
                size_bytes,
                limit_bytes: self.capacity_bytes,
            });
        }
        let mut entries = self.entries.lock().unwrap();
        if entries.touch(key).is_some() {
            return Ok(Vec::new());
        }
        let mut evicted = Vec::new();
        while entries.usage_bytes() + size_bytes > self.capacity_bytes {
            let (key, _, payload) = entries.pop_lru().expect("usage > 0 means an entry exists");
            evicted.push(Evicted { key, payload });
        }
        entries.insert(*key, size_bytes, payload.clone());
        drop(entries);
        self.meter.record_access(started.elapsed());
        Ok(evicted)
    }

    fn load(&self, key: &ChunkKey) -> Result<Option<Payload>, TierError> {
        let started = Instant::now();
        let hit = self.entries.lock().unwrap().touch(key).cloned();
        self.meter.record_access(started.elapsed());
        Ok(hit)
    }

    fn contains(&self, key: &ChunkKey) -> Result<bool, TierError> {
        Ok(self.entries.lock().unwrap().contains(key))
    }

    fn delete(&self, key: &ChunkKey) -> Result<bool, TierError> {
        Ok(self.entries.lock().unwrap().remove(key).is_some())
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn usage_bytes(&self) -> u64 {
        self.entries.lock().unwrap().usage_bytes()
    }

    fn bandwidth(&self) -> BandwidthEstimate {
        self.meter.estimate()
    }
}

/// Best of three 8 MiB copies (about a millisecond in all), measured once per process.
fn measure_memcpy_bytes_per_s() -> f64 {
    static MEASURED: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *MEASURED.get_or_init(measure_memcpy_once)
}

fn measure_memcpy_once() -> f64 {
    const BYTES: usize = 8 << 20;
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let started = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(started.elapsed());
    }
    BYTES as f64 / best.as_secs_f64().max(1e-9)
}
