//! The [`Tier`] trait every backend implements, and the [`BandwidthMeter`] that measures each
//! tier for EVICPRESS's delay model (`ttft ≈ access latency + bytes / read bandwidth`).
//!
//! NOTE 1: the API is synchronous and every method may block on I/O; tiers are driven from a
//! background thread, never from the engine loop.
//! NOTE 2: a tier that has to make room reports what it evicted, payload included, so the
//! caller can demote it to the next slower tier (in EVICPRESS eviction means demotion).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{ChunkKey, TierError};

/// Stored bytes. Shared, so the RAM tier and promotion never copy a payload.
pub type Payload = Arc<[u8]>;

/// An entry a tier removed to make room.
#[derive(Clone, Debug)]
pub struct Evicted {
    pub key: ChunkKey,
    pub payload: Payload,
}

pub trait Tier: Send + Sync {
    fn name(&self) -> &str;

    /// Stores `payload` under `key`, evicting least-recently-used entries if needed, and
    /// returns them. Storing a key that is already present only refreshes its recency: keys
    /// name content, so the bytes are the same. An entry larger than the tier is refused with
    /// [`TierError::TooLarge`].
    fn store(&self, key: &ChunkKey, payload: &Payload) -> Result<Vec<Evicted>, TierError>;

    /// The payload, or `None` on a miss. A corrupted entry is a miss (and is deleted).
    fn load(&self, key: &ChunkKey) -> Result<Option<Payload>, TierError>;

    fn contains(&self, key: &ChunkKey) -> Result<bool, TierError>;

    /// Returns whether the key was present.
    fn delete(&self, key: &ChunkKey) -> Result<bool, TierError>;

    fn capacity_bytes(&self) -> u64;

    /// Bytes held now (for Redis: as of the last operation, since other servers share it).
    fn usage_bytes(&self) -> u64;

    /// Measured read/write bandwidth and per-access latency.
    fn bandwidth(&self) -> BandwidthEstimate;

    /// Batched forms; backends with round trips (Redis) override them with pipelines.
    fn store_many(&self, entries: &[(ChunkKey, Payload)]) -> Result<Vec<Evicted>, TierError> {
        let mut evicted = Vec::new();
        for (key, payload) in entries {
            evicted.extend(self.store(key, payload)?);
        }
        Ok(evicted)
    }

    fn load_many(&self, keys: &[ChunkKey]) -> Result<Vec<Option<Payload>>, TierError> {
        keys.iter().map(|k| self.load(k)).collect()
    }

    fn contains_many(&self, keys: &[ChunkKey]) -> Result<Vec<bool>, TierError> {
        keys.iter().map(|k| self.contains(k)).collect()
    }
}

/// A snapshot of a tier's measured speed. `None` until the tier has seen a matching operation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BandwidthEstimate {
    pub read_bytes_per_s: Option<f64>,
    pub write_bytes_per_s: Option<f64>,
    pub access_latency_s: Option<f64>,
}

impl BandwidthEstimate {
    /// Estimated seconds to load `bytes` from this tier: latency + bytes / read bandwidth.
    pub fn load_seconds(&self, bytes: u64) -> Option<f64> {
        Some(self.access_latency_s.unwrap_or(0.0) + bytes as f64 / self.read_bytes_per_s?)
    }
}

/// Operations at or below this size measure latency; above it, bandwidth. Splitting by size
/// keeps a stream of small `contains` calls from being read as a very slow bandwidth.
pub const LATENCY_SAMPLE_MAX_BYTES: u64 = 64 * 1024;
/// Weight of the newest sample in the moving averages (about the last ten operations).
const EWMA_ALPHA: f64 = 0.2;

/// Exponentially weighted moving averages of a tier's latency and bandwidth.
#[derive(Debug, Default)]
pub struct BandwidthMeter {
    state: Mutex<BandwidthEstimate>,
}

impl BandwidthMeter {
    /// A meter that starts from known bandwidths (the RAM tier, whose loads are zero-copy,
    /// reports a calibrated memcpy bandwidth instead of measuring pointer copies).
    pub fn with_prior(read_bytes_per_s: f64, write_bytes_per_s: f64) -> BandwidthMeter {
        BandwidthMeter {
            state: Mutex::new(BandwidthEstimate {
                read_bytes_per_s: Some(read_bytes_per_s),
                write_bytes_per_s: Some(write_bytes_per_s),
                access_latency_s: None,
            }),
        }
    }

    pub fn record_read(&self, bytes: u64, elapsed: Duration) {
        self.record(bytes, elapsed, true);
    }

    pub fn record_write(&self, bytes: u64, elapsed: Duration) {
        self.record(bytes, elapsed, false);
    }

    /// A lookup or miss: latency only.
    pub fn record_access(&self, elapsed: Duration) {
        let mut s = self.state.lock().unwrap();
        s.access_latency_s = Some(ewma(s.access_latency_s, elapsed.as_secs_f64()));
    }

    pub fn estimate(&self) -> BandwidthEstimate {
        *self.state.lock().unwrap()
    }

    fn record(&self, bytes: u64, elapsed: Duration, read: bool) {
        let seconds = elapsed.as_secs_f64();
        let mut s = self.state.lock().unwrap();
        if bytes <= LATENCY_SAMPLE_MAX_BYTES {
            s.access_latency_s = Some(ewma(s.access_latency_s, seconds));
            return;
        }
        // Subtract the fixed per-access cost so bandwidth is the marginal rate; keep at least
        // a tenth of the time so one noisy latency sample cannot make the rate infinite.
        let transfer_s = (seconds - s.access_latency_s.unwrap_or(0.0))
            .max(seconds * 0.1)
            .max(1e-9);
        let rate = bytes as f64 / transfer_s;
        let slot = if read {
            &mut s.read_bytes_per_s
        } else {
            &mut s.write_bytes_per_s
        };
        // Averaged as seconds per byte, not as a rate: a load's expected time is the mean of
        // times, and a rate average would let one fast sample hide a slowdown for dozens
        // of operations (5 GB/s then 200 kB/s averages to 4 GB/s; as times, to 1 MB/s).
        let s_per_byte = ewma(slot.map(|r| 1.0 / r), 1.0 / rate);
        *slot = Some(1.0 / s_per_byte);
    }
}

fn ewma(old: Option<f64>, sample: f64) -> f64 {
    match old {
        None => sample,
        Some(old) => old + EWMA_ALPHA * (sample - old),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meter_splits_latency_and_bandwidth() {
        let m = BandwidthMeter::default();
        assert_eq!(m.estimate(), BandwidthEstimate::default());
        m.record_access(Duration::from_micros(100));
        m.record_read(1 << 20, Duration::from_micros(1100)); // 1 MiB in 1 ms after latency
        let e = m.estimate();
        assert!((e.access_latency_s.unwrap() - 1e-4).abs() < 1e-12);
        let read = e.read_bytes_per_s.unwrap();
        assert!(
            (read - (1u64 << 20) as f64 / 1e-3).abs() / read < 1e-9,
            "{read}"
        );
        assert!(e.write_bytes_per_s.is_none());
        let load_s = e.load_seconds(1 << 20).unwrap();
        assert!((load_s - 1.1e-3).abs() < 1e-9, "{load_s}");
    }

    /// A tier that slows down shows it at the next operation: the meter averages time per
    /// byte, so one slow read among fast ones moves the estimate by its weight in time.
    #[test]
    fn one_slow_read_shows_a_slowdown_at_once() {
        let m = BandwidthMeter::with_prior(5e9, 5e9);
        m.record_read(1 << 20, Duration::from_secs_f64((1 << 20) as f64 / 2e5));
        let read = m.estimate().read_bytes_per_s.unwrap();
        assert!(read < 2e6, "{read} bytes/s after a 200 kB/s read");
    }
}
