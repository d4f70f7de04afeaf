//! The EVICPRESS delay model measured on this machine before serving (spec "Profiling": the
//! utility weighs load delay against quality, so its delays must be this machine's): a
//! prefill of this model timed through the engine's public API, and each tier probed.

use pk_engine::Engine;

use crate::contexts::ContextReuse;

/// Tokens of the prefill timed at start-up: `bench perf`'s shortest default context, so
/// that the two figures compare.
const CALIBRATION_PREFILL_TOKENS: usize = 512;
/// Bytes of each tier probe at start-up: about one 2K-token context of SmolLM2 in f16.
const CALIBRATION_PROBE_BYTES: usize = 4 << 20;

/// What [`calibrate_context_store`] measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DelayCalibration {
    pub prefill_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub tiers: Vec<pk_evicpress::TierCalibration>,
}

/// Times a prefill of `CALIBRATION_PREFILL_TOKENS` tokens of `engine`'s model and probes
/// each tier of `contexts`' store, and gives the store both. Runs before serving (no
/// requests in flight); serving then keeps the figures current from every prefill and load.
pub fn calibrate_context_store(
    engine: &mut Engine,
    contexts: &ContextReuse,
) -> anyhow::Result<DelayCalibration> {
    let store = contexts.store();
    let cfg = engine.model_config();
    let n = CALIBRATION_PREFILL_TOKENS.min(cfg.context_length - 1);
    // Any ids do: prefill costs the same whatever the tokens say.
    let vocab = cfg.vocab_size as u64;
    let tokens: Vec<u32> = (0..n as u64)
        .map(|i| ((i * 7919 + 11) % vocab) as u32)
        .collect();
    // A short run first, so that the timed one does not pay for weights paged in.
    engine.score(&tokens[..16.min(n)], 16.min(n) - 1)?;
    let t0 = std::time::Instant::now();
    engine.score(&tokens, n - 1)?;
    let prefill_tokens_per_s = n as f64 / t0.elapsed().as_secs_f64();
    store.set_calibrated_prefill(prefill_tokens_per_s);
    let tiers = store
        .calibrate_tiers(CALIBRATION_PROBE_BYTES)
        .map_err(anyhow::Error::msg)?;
    Ok(DelayCalibration {
        prefill_tokens: n,
        prefill_tokens_per_s,
        tiers,
    })
}
