//! The chunk tiers on Gemma-3-270M with KV cache groups on (its 15 sliding-window layers in
//! tables of their own that release every block behind the 512-token window): what is
//! stored (every chunk's 3 full-attention layers, the window layers only at checkpoints and
//! at the prompt's end), what a hit loads, and that a hit gives the same bits as a cold run
//! — from RAM, from disk after a restart, from Redis on a second engine, at a checkpoint
//! inside a shared prefix, and after the pool released window blocks the tiers had lost.
//!
//! The model is fetched by `pagekeeper fetch-model --name all` (the README's test command);
//! these tests fail, not skip, without it.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_connectors::{ReuseConfig, Tiering, TieringConfig};
use pk_engine::model_store::{known_model_path, GEMMA3_270M};
use pk_engine::{Engine, EngineConfig, GenerateOutput, GenerateParams};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, Tier, TieredStore};

/// Gemma-3-270M's KV at 8,192 tokens with one table for all 18 layers (f16 K and V, one KV
/// head of 256): the bar's reference.
const ONE_TABLE_BYTES_8K: f64 = 8192.0 * 18.0 * 256.0 * 2.0 * 2.0;

fn gemma_path() -> std::path::PathBuf {
    let p = known_model_path(&GEMMA3_270M);
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all` first",
        p.display()
    );
    p
}

fn config() -> EngineConfig {
    EngineConfig {
        kv_capacity_tokens: Some(12_288),
        // Every hit must come from the tiers, not from the pool of the same engine.
        enable_prefix_caching: false,
        ..Default::default()
    }
}

fn engine(tiers: Option<TieringConfig>, config: EngineConfig) -> (Engine, Option<Arc<Tiering>>) {
    let mut e = Engine::load(&gemma_path(), config).expect("Gemma-3-270M loads");
    assert!(e.kv_group_layout().is_some(), "KV cache groups are on");
    let Some(t) = tiers else { return (e, None) };
    let attached = pk_connectors::attach(&mut e, &ReuseConfig::Chunks(t)).unwrap();
    (e, attached.tiering().cloned())
}

fn tiers(store: Arc<TieredStore>, checkpoint_tokens: Option<usize>) -> TieringConfig {
    TieringConfig {
        store,
        chunk_size_tokens: 256,
        max_pending_bytes: 1 << 30,
        window_checkpoint_tokens: checkpoint_tokens,
    }
}

fn ram_and_disk(dir: &std::path::Path) -> Arc<TieredStore> {
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(512 << 20));
    let disk: Arc<dyn Tier> = Arc::new(
        DiskTier::open(DiskTierConfig {
            dir: dir.to_path_buf(),
            capacity_bytes: 1 << 30,
            name: "disk".into(),
            sync_writes: true,
            drop_page_cache: false,
        })
        .unwrap(),
    );
    Arc::new(TieredStore::new(vec![ram, disk]).with_write_through_last(true))
}

/// The book's first `n` tokens in Gemma's vocabulary, and the `extra` after them.
fn book_tokens(e: &Engine, n: usize, extra: usize) -> (Vec<u32>, Vec<u32>) {
    let text = String::from_utf8_lossy(include_bytes!(
        "../../../tests/fixtures/around-the-world-in-80-days.txt"
    ))
    .into_owned();
    let mut ids = e.tokenizer.encode_prompt(&text, false);
    assert!(ids.len() >= n + extra);
    ids.truncate(n + extra);
    let rest = ids.split_off(n);
    (ids, rest)
}

fn greedy() -> GenerateParams {
    GenerateParams {
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    }
}

/// What a run gives: its greedy output, and the teacher-forced logits of `cont` after the
/// same prompt.
fn run(e: &mut Engine, prompt: &[u32], cont: &[u32]) -> (GenerateOutput, Vec<Vec<f32>>) {
    let out = e.generate(prompt, &greedy(), &mut |_| {}).unwrap();
    let logits = e.teacher_force(prompt, cont, &greedy()).unwrap();
    e.check_invariants();
    (out, logits)
}

/// Waits until the writer thread has handed every queued payload to the tiers.
fn wait_stored(t: &Tiering, store: &TieredStore, at_least_bytes: u64) {
    let t0 = Instant::now();
    while store
        .metrics()
        .iter()
        .map(|m| m.bytes_written)
        .max()
        .unwrap_or(0)
        < at_least_bytes
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "payloads were not stored: {:?}",
            t.stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The bar on Gemma-3-270M at 8,192 tokens: the pool keeps its groups; the tiers
/// get at most 40 % of one table's bytes; the same prompt hits at least 95 % of its tokens
/// from RAM and, after a restart, from disk, with the cold run's greedy tokens and
/// teacher-forced logits bit for bit; a prompt sharing only its first 6,000 tokens hits at
/// the checkpoint at 4,096 and decodes what a cold run decodes.
#[test]
fn gemma3_8k_prompt_hits_from_ram_and_disk_with_the_cold_runs_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cold, _) = engine(None, config());
    let (prompt, cont) = book_tokens(&cold, 8192, 16);
    let (_, other) = book_tokens(&cold, 9000, 256);
    let shared: Vec<u32> = prompt[..6000].iter().chain(&other).copied().collect();
    let (cold_out, cold_logits) = run(&mut cold, &prompt, &cont);
    let cold_shared = cold.generate(&shared, &greedy(), &mut |_| {}).unwrap();
    // The live pool with groups at 8K (the prompt and its 8 tokens): under 30 % of one
    // table's bytes, as without tiers.
    let pool_share = cold_out.kv_bytes as f64 / ONE_TABLE_BYTES_8K;
    drop(cold);

    let store = ram_and_disk(dir.path());
    let (mut first, t1) = engine(Some(tiers(store.clone(), None)), config());
    let t1 = t1.unwrap();
    let out = first.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    assert_eq!(
        out.token_ids, cold_out.token_ids,
        "a storing run is a cold run"
    );
    assert!(pool_share <= 0.30, "pool {}", cold_out.kv_bytes);
    assert_eq!(out.kv_bytes, cold_out.kv_bytes, "the pool keeps its groups");
    let s = t1.stats();
    let written = s.full_attention_bytes_queued + s.window_bytes_queued;
    eprintln!(
        "8K: pool {:.1} % of one table; tiers got {written} bytes ({:.1} %: {} full-attention, {} window in {} chunks)",
        100.0 * pool_share,
        100.0 * written as f64 / ONE_TABLE_BYTES_8K,
        s.full_attention_bytes_queued,
        s.window_bytes_queued,
        s.window_chunks_queued
    );
    assert!(written as f64 <= 0.40 * ONE_TABLE_BYTES_8K, "{s:?}");
    // 31 chunks of full-attention layers; windows at 2,048, 4,096, 6,144 and the end (2
    // chunks each).
    assert_eq!((s.chunks_queued, s.window_chunks_queued), (31, 8), "{s:?}");
    wait_stored(&t1, &store, written);

    // The same prompt on a second engine: from RAM.
    let (mut second, t2) = engine(Some(tiers(store.clone(), None)), config());
    let (out, logits) = run(&mut second, &prompt, &cont);
    assert_eq!(out.cached_prompt_tokens, 31 * 256);
    assert!(out.cached_prompt_tokens as f64 >= 0.95 * prompt.len() as f64);
    assert_eq!(out.token_ids, cold_out.token_ids);
    assert_eq!(logits, cold_logits, "the same bits from RAM");
    assert_eq!(t2.unwrap().stats().window_chunks_loaded, 4, "2 per hit");
    // A prompt sharing only the first 6,000 tokens: the last checkpoint inside them.
    let out = second.generate(&shared, &greedy(), &mut |_| {}).unwrap();
    assert_eq!(out.cached_prompt_tokens, 4096);
    assert_eq!(out.token_ids, cold_shared.token_ids);
    second.check_invariants();
    drop((first, t1, second, store));

    // A restart: an empty RAM tier over the same disk directory.
    let store = ram_and_disk(dir.path());
    let (mut third, t3) = engine(Some(tiers(store.clone(), None)), config());
    let (out, logits) = run(&mut third, &prompt, &cont);
    assert_eq!(out.cached_prompt_tokens, 31 * 256);
    assert_eq!(out.token_ids, cold_out.token_ids);
    assert_eq!(logits, cold_logits, "the same bits from disk");
    let disk_hits = store.metrics()[1].hits;
    assert!(
        disk_hits >= 31 + 2,
        "{disk_hits} disk hits; {:?}",
        t3.unwrap().stats()
    );
}

/// Two engines sharing one Redis server (as two servers would): what the first stored, the
/// second loads, with the cold run's bits.
#[test]
fn gemma3_prompt_stored_by_one_engine_hits_on_another_through_redis() {
    let (url, _guard) = common::redis_for_test();
    let t0 = Instant::now();
    let redis = || -> Arc<TieredStore> {
        let tier = pk_tiers::open_tier(&pk_tiers::TierConfig::Redis {
            url: url.clone(),
            capacity_bytes: Some(256 << 20),
            key_prefix: Some(format!("pktest:groups:{}:{:?}:", std::process::id(), t0)),
        })
        .unwrap();
        Arc::new(TieredStore::new(vec![tier]))
    };
    let (mut cold, _) = engine(None, config());
    let (prompt, cont) = book_tokens(&cold, 2500, 16);
    let (cold_out, cold_logits) = run(&mut cold, &prompt, &cont);
    drop(cold);

    let store = redis();
    let (mut first, t1) = engine(Some(tiers(store.clone(), None)), config());
    first.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    let t1 = t1.unwrap();
    let s = t1.stats();
    wait_stored(
        &t1,
        &store,
        s.full_attention_bytes_queued + s.window_bytes_queued,
    );

    let (mut second, t2) = engine(Some(tiers(redis(), None)), config());
    let (out, logits) = run(&mut second, &prompt, &cont);
    assert_eq!(
        out.cached_prompt_tokens,
        9 * 256,
        "{:?}",
        t2.unwrap().stats()
    );
    assert_eq!(out.token_ids, cold_out.token_ids);
    assert_eq!(logits, cold_logits, "the same bits through Redis");
}
