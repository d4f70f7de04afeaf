//! The delay model measured where it serves: a calibration at start-up (each tier's write
//! and read bandwidth and access latency, by probe payloads; the model's prefill speed,
//! given by the engine) and an online update from every load the store serves and every
//! prefill the engine observes. Each figure says where it came from (`DelayProvenance`),
//! so `/v1/kv/contexts` never shows a prior as a measurement.

use pk_tiers::{ChunkKey, Payload};
use serde::Serialize;

use super::{ContextStore, StoreError};
use crate::model::DelayModel;

/// Weight of the newest observation in the online averages (about the last ten).
const EWMA_WEIGHT: f64 = 0.2;
/// Prefill steps shorter than this say more about per-step overhead than about prefill
/// speed, so they are not observed.
pub const MIN_PREFILL_SAMPLE_TOKENS: usize = 64;
/// Loads smaller than this measure access latency more than bandwidth (as the tiers' own
/// meters split them).
const MIN_LOAD_SAMPLE_BYTES: u64 = pk_tiers::LATENCY_SAMPLE_MAX_BYTES;
/// Probe rounds per tier at calibration; the tier meters average them.
const CALIBRATION_ROUNDS: usize = 3;

/// Where one figure of the delay model comes from.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Provenance {
    /// `prior` (a constant of the configuration), `calibrated` (measured at start-up) or
    /// `observed` (updated from serving since).
    pub source: &'static str,
    /// Observations folded in since start-up (calibration probes included).
    pub observations: u64,
}

impl Provenance {
    fn prior() -> Provenance {
        Provenance {
            source: "prior",
            observations: 0,
        }
    }

    fn calibrated(&mut self, observations: u64) {
        self.source = "calibrated";
        self.observations += observations;
    }

    fn observed(&mut self) {
        self.source = "observed";
        self.observations += 1;
    }
}

/// Provenance of every figure of a [`DelayModel`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DelayProvenance {
    pub prefill_tokens_per_s: Provenance,
    /// Per tier: read bandwidth and access latency.
    pub tiers: Vec<Provenance>,
    pub decode_s_per_byte: Provenance,
    pub restore_s_per_token: Provenance,
}

impl DelayProvenance {
    pub(super) fn priors(n_tiers: usize) -> DelayProvenance {
        DelayProvenance {
            prefill_tokens_per_s: Provenance::prior(),
            tiers: vec![Provenance::prior(); n_tiers],
            decode_s_per_byte: Provenance::prior(),
            restore_s_per_token: Provenance::prior(),
        }
    }
}

/// The delay model in use and where each of its figures comes from.
#[derive(Clone, Debug, Serialize)]
pub struct DelayReport {
    pub model: DelayModel,
    pub provenance: DelayProvenance,
    /// Per tier, the write bandwidth its meter has measured (placement needs only reads;
    /// writes are shown so that a slow tier is visible before anything is loaded).
    pub write_bytes_per_s: Vec<Option<f64>>,
}

/// What calibrating one tier measured.
#[derive(Clone, Debug, Serialize)]
pub struct TierCalibration {
    pub tier: String,
    /// `None` when the tier was not probed (too full to hold the probe without evicting).
    pub read_bytes_per_s: Option<f64>,
    pub write_bytes_per_s: Option<f64>,
    pub access_latency_s: Option<f64>,
    pub skipped: Option<String>,
}

fn ewma(old: f64, sample: f64) -> f64 {
    old + EWMA_WEIGHT * (sample - old)
}

impl ContextStore {
    /// The delay model, its provenance, and the tiers' measured write bandwidths.
    pub fn delay_report(&self) -> DelayReport {
        let st = self.state.lock().unwrap();
        DelayReport {
            model: st.delay.clone(),
            provenance: st.provenance.clone(),
            write_bytes_per_s: self
                .tiers
                .iter()
                .map(|t| t.bandwidth().write_bytes_per_s)
                .collect(),
        }
    }

    /// Sets the prefill speed measured at start-up (the engine times a prefill).
    pub fn set_calibrated_prefill(&self, tokens_per_s: f64) {
        if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.delay.prefill_tokens_per_s = tokens_per_s;
        st.provenance.prefill_tokens_per_s.calibrated(1);
        drop(st);
        self.publish_metrics();
    }

    /// Folds one observed prefill (`tokens` computed in `seconds`) into the prefill speed.
    pub fn observe_prefill(&self, tokens: usize, seconds: f64) {
        if tokens < MIN_PREFILL_SAMPLE_TOKENS || seconds <= 0.0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.delay.prefill_tokens_per_s =
            ewma(st.delay.prefill_tokens_per_s, tokens as f64 / seconds);
        st.provenance.prefill_tokens_per_s.observed();
    }

    /// Folds one restore (`tokens` written into the engine's pool in `seconds`) in.
    pub fn observe_restore(&self, tokens: usize, seconds: f64) {
        if tokens == 0 || seconds <= 0.0 {
            return;
        }
        let mut st = self.state.lock().unwrap();
        st.delay.restore_s_per_token = ewma(st.delay.restore_s_per_token, seconds / tokens as f64);
        st.provenance.restore_s_per_token.observed();
    }

    /// After a load from `tier` of `bytes` decoded in `decode_s`: the tier's meter has
    /// timed the fetch, so its estimate replaces the model's figure, and the decode time
    /// is folded in.
    pub(super) fn observe_load(&self, tier: usize, bytes: u64, decode_s: f64) {
        if bytes < MIN_LOAD_SAMPLE_BYTES {
            return;
        }
        let mut st = self.state.lock().unwrap();
        sync_tier(&mut st.delay, tier, &self.tiers[tier].bandwidth());
        st.provenance.tiers[tier].observed();
        st.delay.decode_s_per_byte = ewma(st.delay.decode_s_per_byte, decode_s / bytes as f64);
        st.provenance.decode_s_per_byte.observed();
    }

    /// Probes every tier with `probe_bytes` payloads (stored, read back, deleted; a tier
    /// that could not hold the probe without evicting is skipped and keeps its prior) and
    /// sets the model's bandwidths and latencies from the tiers' meters. The caller then
    /// decides with measured figures; nothing stored is touched.
    pub fn calibrate_tiers(&self, probe_bytes: usize) -> Result<Vec<TierCalibration>, StoreError> {
        let payload: Payload = (0..probe_bytes)
            .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[1])
            .collect::<Vec<u8>>()
            .into();
        let small: Payload = payload[..1024.min(probe_bytes)].to_vec().into();
        let mut out = Vec::with_capacity(self.tiers.len());
        for (t, tier) in self.tiers.iter().enumerate() {
            let room = tier.capacity_bytes().saturating_sub(tier.usage_bytes());
            if room < 2 * probe_bytes as u64 {
                out.push(TierCalibration {
                    tier: tier.name().to_string(),
                    read_bytes_per_s: None,
                    write_bytes_per_s: None,
                    access_latency_s: None,
                    skipped: Some(format!(
                        "{room} bytes free, the probe needs {}",
                        2 * probe_bytes
                    )),
                });
                continue;
            }
            for round in 0..CALIBRATION_ROUNDS {
                for (i, p) in [&small, &payload].into_iter().enumerate() {
                    let key = probe_key(t, round, i);
                    // The tier's meter times each operation itself.
                    tier.store(&key, p)?;
                    let got = tier.load(&key)?;
                    tier.delete(&key)?;
                    if got.as_deref() != Some(&p[..]) {
                        return Err(StoreError::CopyMissing);
                    }
                }
            }
            let bw = tier.bandwidth();
            {
                let mut st = self.state.lock().unwrap();
                sync_tier(&mut st.delay, t, &bw);
                st.provenance.tiers[t].calibrated(2 * CALIBRATION_ROUNDS as u64);
            }
            out.push(TierCalibration {
                tier: tier.name().to_string(),
                read_bytes_per_s: bw.read_bytes_per_s,
                write_bytes_per_s: bw.write_bytes_per_s,
                access_latency_s: bw.access_latency_s,
                skipped: None,
            });
        }
        self.publish_metrics();
        Ok(out)
    }
}

/// Copies a tier meter's estimate into the model, figure by figure where it has one.
fn sync_tier(delay: &mut DelayModel, tier: usize, bw: &pk_tiers::BandwidthEstimate) {
    let spec = &mut delay.tiers[tier];
    if let Some(r) = bw.read_bytes_per_s {
        spec.read_bytes_per_s = r;
    }
    if let Some(l) = bw.access_latency_s {
        spec.access_latency_s = l;
    }
}

/// A key no context can have: contexts are keyed by hashes of token ids, and this one is
/// a fixed pattern per (tier, round, size), deleted right after use.
fn probe_key(tier: usize, round: usize, size: usize) -> ChunkKey {
    let mut k = [0xCAu8; 32];
    k[0] = tier as u8;
    k[1] = round as u8;
    k[2] = size as u8;
    k[31] = 0x1B;
    ChunkKey(k)
}
