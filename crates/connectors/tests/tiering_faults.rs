//! The chunk tiers when what they serve is not what prefill computes: a payload that passes
//! its tier's checks but fails the codec's is deleted and stored again, and a pool whose
//! dtype a stored chunk cannot be reloaded into exactly never treats the load as exact.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_connectors::KEY_MODEL_ID;
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_model::KvDtype;
use pk_tiers::{ChunkKey, ChunkKeyer, Payload, RamTier, Tier, TieredStore};

use common::tiers_config as config;

fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    }
}

/// The keys of `prompt`'s chunks as the engine's connector derives them.
fn chunk_keys(e: &Engine, prompt: &[u32]) -> Vec<ChunkKey> {
    let keyer = ChunkKeyer::new(KEY_MODEL_ID, e.cache_namespace().as_bytes(), 256, 16).unwrap();
    keyer.keys(&prompt[..prompt.len() - 1], None)
}

/// Waits until `tier` holds `key` with a payload that differs from `not` (when given).
fn wait_for(tier: &RamTier, key: &ChunkKey, not: Option<&Payload>) -> Payload {
    let t0 = Instant::now();
    loop {
        if let Some(p) = tier.load(key).unwrap() {
            if not.is_none_or(|bad| bad[..] != p[..]) {
                return p;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the chunk was not stored"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_chunk_failing_the_codec_check_is_deleted_and_stored_again() {
    let ram = Arc::new(RamTier::new(64 << 20));
    let store = Arc::new(TieredStore::new(vec![ram.clone() as Arc<dyn Tier>]));
    let book = common::book_ids();
    let prompt = &book[3000..3600];
    let engine = || common::tiered_engine(EngineConfig::default(), config(store.clone()));

    let (mut cold, _t) = engine();
    let reference = cold.generate(prompt, &params(), &mut |_| {}).unwrap();
    let keys = chunk_keys(&cold, prompt);
    wait_for(&ram, &keys[1], None);
    // The RAM tier keeps no checksum of its own: a flipped byte there reaches the codec,
    // whose check refuses it (a disk or Redis copy with a valid tier checksum does the same).
    let good = wait_for(&ram, &keys[0], None);
    let mut bytes = good.to_vec();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    let bad = Payload::from(bytes);
    ram.delete(&keys[0]).unwrap();
    ram.store(&keys[0], &bad).unwrap();

    let (mut second, tiers) = engine();
    let out = second.generate(prompt, &params(), &mut |_| {}).unwrap();
    assert_eq!(out.cached_prompt_tokens, 0, "a corrupt chunk is never used");
    assert_eq!(out.token_ids, reference.token_ids);
    assert_eq!(tiers.stats().load_failures, 1);
    let restored = wait_for(&ram, &keys[0], Some(&bad));
    assert_eq!(restored[..], good[..], "the recomputed chunk replaces it");
    drop((second, tiers));

    let (mut third, tiers) = engine();
    let out = third.generate(prompt, &params(), &mut |_| {}).unwrap();
    assert_eq!(out.cached_prompt_tokens, 512, "the prefix is reused again");
    assert_eq!(tiers.stats().chunks_loaded, 2);
    assert_eq!(out.token_ids, reference.token_ids);
}

/// Chunks are stored in f16: an f16 pool reloads them bit for bit and its sequences feed
/// the prefix cache, while a q8 pool's load is inexact, so the reloaded blocks are never
/// cached: the same prompt again loads from the tiers instead of hitting the pool.
#[test]
fn only_an_f16_pool_reloads_stored_chunks_exactly() {
    let book = common::book_ids();
    let prompt = &book[4000..4600];
    for (dtype, loads_after_two_runs) in [(KvDtype::F16, 2), (KvDtype::Q8, 4)] {
        let ram = Arc::new(RamTier::new(64 << 20));
        let store = Arc::new(TieredStore::new(vec![ram.clone() as Arc<dyn Tier>]));
        let cfg = EngineConfig {
            kv_dtype: dtype,
            ..Default::default()
        };
        let (mut cold, _t) = common::tiered_engine(cfg.clone(), config(store.clone()));
        cold.generate(prompt, &params(), &mut |_| {}).unwrap();
        let keys = chunk_keys(&cold, prompt);
        wait_for(&ram, &keys[1], None);
        drop(cold);

        let (mut warm, tiers) = common::tiered_engine(cfg, config(store.clone()));
        for _ in 0..2 {
            let out = warm.generate(prompt, &params(), &mut |_| {}).unwrap();
            assert!(out.cached_prompt_tokens >= 512, "{dtype:?}");
        }
        assert_eq!(
            tiers.stats().chunks_loaded,
            loads_after_two_runs,
            "{dtype:?}"
        );
        warm.check_invariants();
    }
}

/// A tier that holds one chunk keeps a two-chunk prompt's first chunk, not its second:
/// stored, the second would evict the first, and a tail without its head never hits (every
/// run then rewrote both and none hit).
#[test]
fn chunks_past_the_tiers_capacity_are_not_stored() {
    let payload_bytes = 256 * 23040; // SmolLM2's f16 K and V for one 256-token chunk.
    let ram = Arc::new(RamTier::new((payload_bytes + payload_bytes / 2) as u64));
    let store = Arc::new(TieredStore::new(vec![ram.clone() as Arc<dyn Tier>]));
    let book = common::book_ids();
    let prompt = &book[5000..5600];
    let (mut cold, tiers) = common::tiered_engine(EngineConfig::default(), config(store.clone()));
    cold.generate(prompt, &params(), &mut |_| {}).unwrap();
    let keys = chunk_keys(&cold, prompt);
    wait_for(&ram, &keys[0], None);
    drop(cold);
    let stats = tiers.stats();
    assert_eq!(
        (stats.chunks_queued, stats.chunks_skipped_past_capacity),
        (1, 1)
    );
    assert!(ram.load(&keys[1]).unwrap().is_none());

    let (mut warm, _t) = common::tiered_engine(EngineConfig::default(), config(store.clone()));
    let out = warm.generate(prompt, &params(), &mut |_| {}).unwrap();
    assert_eq!(out.cached_prompt_tokens, 256, "the first chunk hits");
}
