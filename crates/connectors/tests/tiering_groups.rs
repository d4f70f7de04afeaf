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

use pk_connectors::{ReuseConfig, Tiering, TieringConfig, KEY_MODEL_ID};
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
    let t2 = t2.unwrap();
    assert_eq!(t2.stats().window_chunks_loaded, 4, "2 per hit");
    // A prompt sharing only the first 6,000 tokens: the last checkpoint inside them.
    let shortened = t2.stats().hits_shortened_by_window;
    let out = second.generate(&shared, &greedy(), &mut |_| {}).unwrap();
    assert_eq!(out.cached_prompt_tokens, 4096);
    assert_eq!(
        t2.stats().hits_shortened_by_window,
        shortened + 1,
        "23 chunks found"
    );
    assert_eq!(out.token_ids, cold_shared.token_ids);
    second.check_invariants();
    drop((first, t1, second, t2, store));

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

/// Prefill in steps of one chunk, so that the pool releases window blocks at every step:
/// each checkpoint's window must be copied out after the step that computed it, before
/// the next one releases it. A prompt sharing each checkpoint's prefix then hits exactly
/// there, with the cold run's teacher-forced logits bit for bit: every stored window is
/// the KV the cold run computed, none a block that had left the window.
#[test]
fn window_kv_is_copied_between_prefill_steps_and_restores_exactly_at_every_checkpoint() {
    let stepped = EngineConfig {
        max_batch_tokens: 256,
        ..config()
    };
    let (mut cold, _) = engine(None, stepped.clone());
    let (prompt, _) = book_tokens(&cold, 1800, 0);
    let (_, other) = book_tokens(&cold, 4000, 300);
    let store = Arc::new(TieredStore::new(vec![
        Arc::new(RamTier::new(256 << 20)) as Arc<dyn Tier>
    ]));
    let (mut first, t1) = engine(Some(tiers(store.clone(), Some(512))), stepped.clone());
    let t1 = t1.unwrap();
    first.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    let s = t1.stats();
    // 7 whole chunks; hits at 2, 4, 6 (checkpoints) and 7 (the end) need window chunks
    // 0-1, 2-3, 4-5 and 5-6.
    assert_eq!((s.chunks_queued, s.window_chunks_queued), (7, 7), "{s:?}");
    assert_eq!(s.window_chunks_unavailable, 0);
    wait_stored(
        &t1,
        &store,
        s.full_attention_bytes_queued + s.window_bytes_queued,
    );

    let (mut second, t2) = engine(Some(tiers(store.clone(), Some(512))), stepped);
    // (tokens shared with the prompt, the hit). With checkpoints as close as the window
    // every window chunk is stored, so 5 shared chunks hit at 5: the windows of the
    // checkpoints at 4 and 6 together hold what position 1,280 sees.
    for (shared_tokens, hit) in [(612, 512), (1124, 1024), (1380, 1280), (1636, 1536)] {
        let shared: Vec<u32> = prompt[..shared_tokens]
            .iter()
            .chain(&other)
            .copied()
            .collect();
        let (head, cont) = shared.split_at(shared.len() - 16);
        let want = cold.teacher_force(head, cont, &greedy()).unwrap();
        let out = second.generate(head, &greedy(), &mut |_| {}).unwrap();
        assert_eq!(out.cached_prompt_tokens, hit, "hit at the checkpoint");
        let got = second.teacher_force(head, cont, &greedy()).unwrap();
        assert_eq!(got, want, "the same bits after a hit at {hit} tokens");
        second.check_invariants();
    }
    assert_eq!(t2.unwrap().stats().hits_shortened_by_window, 0);
}

/// A prompt that adopts a prefix from the pool's own cache holds only the window blocks
/// its first new token sees; when the tiers have lost the windows of checkpoints inside
/// that prefix (a RAM tier too small for them), those checkpoints are not stored — never
/// from a released block — and are counted. What is stored still restores exactly.
#[test]
fn checkpoints_whose_window_blocks_the_pool_released_are_not_stored() {
    let stepped = EngineConfig {
        max_batch_tokens: 256,
        enable_prefix_caching: true,
        ..config()
    };
    let (mut cold, _) = engine(None, config());
    let (a, _) = book_tokens(&cold, 1800, 0);
    let (_, other) = book_tokens(&cold, 4000, 300);
    let b: Vec<u32> = a[..1700].iter().chain(&other).copied().collect();
    let (b_head, b_cont) = b.split_at(b.len() - 16);
    let want = cold.teacher_force(b_head, b_cont, &greedy()).unwrap();
    let want_out = cold.generate(b_head, &greedy(), &mut |_| {}).unwrap();

    // 6 MiB holds about one window chunk (3.9 MB) and two of full-attention layers.
    let store = Arc::new(TieredStore::new(vec![
        Arc::new(RamTier::new(6 << 20)) as Arc<dyn Tier>
    ]));
    let (mut e, t) = engine(Some(tiers(store.clone(), Some(512))), stepped);
    let t = t.unwrap();
    e.generate(&a, &greedy(), &mut |_| {}).unwrap();
    let s = t.stats();
    wait_stored(
        &t,
        &store,
        s.full_attention_bytes_queued + s.window_bytes_queued,
    );
    let before = t.stats().window_chunks_unavailable;
    let out = e.generate(b_head, &greedy(), &mut |_| {}).unwrap();
    assert!(
        out.cached_prompt_tokens >= 1600,
        "from the pool's prefix cache"
    );
    assert_eq!(out.token_ids, want_out.token_ids);
    let s = t.stats();
    assert!(
        s.window_chunks_unavailable > before,
        "the checkpoints inside the adopted prefix had no window left to store: {s:?}"
    );
    wait_stored(&t, &store, 0);
    drop(e);

    // Whatever the tiers now hold for B restores exactly on a fresh engine.
    let (mut fresh, _) = engine(Some(tiers(store, Some(512))), config());
    let got = fresh.teacher_force(b_head, b_cont, &greedy()).unwrap();
    assert_eq!(got, want);
}

/// A store written by an engine with one table for all layers is never a hit for one with
/// KV cache groups, nor the reverse (their namespaces name the layout), while each hits
/// what it stored itself.
#[test]
fn stores_written_with_and_without_groups_never_serve_each_other() {
    let one_table = EngineConfig {
        hybrid_kv_cache: false,
        ..config()
    };
    let run_on = |store: &Arc<TieredStore>, grouped: bool, prompt: &[u32]| -> usize {
        let cfg = if grouped { config() } else { one_table.clone() };
        let mut e = Engine::load(&gemma_path(), cfg).unwrap();
        assert_eq!(e.kv_group_layout().is_some(), grouped);
        let attached =
            pk_connectors::attach(&mut e, &ReuseConfig::Chunks(tiers(store.clone(), None)))
                .unwrap();
        let out = e.generate(prompt, &greedy(), &mut |_| {}).unwrap();
        let t = attached.tiering().unwrap().clone();
        let s = t.stats();
        drop(e);
        drop(attached);
        wait_stored(
            &t,
            store,
            (s.full_attention_bytes_queued + s.window_bytes_queued).min(1),
        );
        out.cached_prompt_tokens
    };
    let (probe, _) = engine(None, config());
    let (prompt, _) = book_tokens(&probe, 600, 0);
    drop(probe);
    for writer_grouped in [false, true] {
        let store = Arc::new(TieredStore::new(vec![
            Arc::new(RamTier::new(256 << 20)) as Arc<dyn Tier>
        ]));
        assert_eq!(run_on(&store, writer_grouped, &prompt), 0);
        assert_eq!(
            run_on(&store, !writer_grouped, &prompt),
            0,
            "the other layout"
        );
        assert_eq!(
            run_on(&store, writer_grouped, &prompt),
            512,
            "the same layout"
        );
    }
}

/// `prefix_kv` on an engine with KV cache groups: a whole context (here the KV a one-table
/// engine stored in the chunk tiers, every layer of every token) is placed by group, its
/// full-attention layers into the main table and its window layers' tail into the window
/// tables, and gives the cold run's teacher-forced logits bit for bit; a context with
/// dropped tokens is refused by name.
#[test]
fn a_whole_prefix_kv_is_placed_by_group_and_a_dropped_one_is_refused() {
    let store = Arc::new(TieredStore::new(vec![
        Arc::new(RamTier::new(256 << 20)) as Arc<dyn Tier>
    ]));
    let one_table = EngineConfig {
        hybrid_kv_cache: false,
        ..config()
    };
    let mut flat = Engine::load(&gemma_path(), one_table).unwrap();
    let (prompt, cont) = book_tokens(&flat, 1200, 16);
    let attached =
        pk_connectors::attach(&mut flat, &ReuseConfig::Chunks(tiers(store.clone(), None))).unwrap();
    flat.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    let keyer = pk_tiers::ChunkKeyer::new(KEY_MODEL_ID, flat.cache_namespace().as_bytes(), 256, 16)
        .unwrap();
    let fingerprint = flat.cache_namespace().kv_fingerprint();
    drop(flat);
    drop(attached);
    let chunks: Vec<pk_codec::KvContext> = keyer
        .keys(&prompt[..1024], None)
        .iter()
        .map(|key| pk_codec::decode(&store.load(key).unwrap().payload, &fingerprint).unwrap())
        .collect();
    let whole = concat_tokens(&chunks);

    let (mut grouped, _) = engine(None, config());
    let cold = grouped.teacher_force(&prompt, &cont, &greedy()).unwrap();
    let given = GenerateParams {
        prefix_kv: Some(pk_connectors::PrefixKv::given(whole.clone())),
        ..greedy()
    };
    let placed = grouped.teacher_force(&prompt, &cont, &given).unwrap();
    assert_eq!(placed, cold, "the same bits from a given whole context");
    grouped.check_invariants();

    let kept: Vec<usize> = (0..1024).filter(|t| t % 4 != 1).collect();
    let dropped = GenerateParams {
        prefix_kv: Some(pk_connectors::PrefixKv::given(whole.retain_tokens(&kept))),
        ..greedy()
    };
    let err = grouped.teacher_force(&prompt, &cont, &dropped).unwrap_err();
    assert!(format!("{err:#}").contains("prefix_kv"), "{err:#}");
}

/// Stored contexts of consecutive token ranges, joined into one.
fn concat_tokens(parts: &[pk_codec::KvContext]) -> pk_codec::KvContext {
    let p0 = &parts[0];
    let (heads, d) = (p0.n_layers * p0.n_kv_heads, p0.head_dim);
    let join = |of: &dyn Fn(&pk_codec::KvContext) -> &[f32]| -> Vec<f32> {
        let mut out = Vec::new();
        for h in 0..heads {
            for p in parts {
                let n = p.n_tokens();
                out.extend_from_slice(&of(p)[h * n * d..(h + 1) * n * d]);
            }
        }
        out
    };
    let positions = (0..parts.iter().map(|p| p.n_tokens()).sum::<usize>() as u32).collect();
    let (k, v) = (join(&|p| &p.k), join(&|p| &p.v));
    pk_codec::KvContext::new(p0.n_layers, p0.n_kv_heads, d, positions, k, v).unwrap()
}

/// A tier connector built for a grouped layout is refused by an engine with one table, and
/// one built for one table by an engine with groups: neither could read the other's pool.
#[test]
fn a_connector_for_the_other_layout_is_refused() {
    let store = Arc::new(TieredStore::new(vec![
        Arc::new(RamTier::new(64 << 20)) as Arc<dyn Tier>
    ]));
    let (mut grouped, _) = engine(None, config());
    let layout = grouped.kv_group_layout().unwrap();
    let tiering = |e: &Engine, groups: Option<&pk_model::KvGroupLayout>| {
        Arc::new(
            Tiering::new(
                &tiers(store.clone(), None),
                e.cache_namespace(),
                16,
                e.kv_bytes_per_token(),
                groups,
            )
            .unwrap(),
        )
    };
    let err = grouped.set_connector(tiering(&grouped, None)).unwrap_err();
    assert!(err.to_string().contains("KV cache groups"), "{err}");
    let mut flat = Engine::load(
        &gemma_path(),
        EngineConfig {
            hybrid_kv_cache: false,
            ..config()
        },
    )
    .unwrap();
    let err = flat
        .set_connector(tiering(&flat, Some(&layout)))
        .unwrap_err();
    assert!(err.to_string().contains("one block table"), "{err}");
}

/// A corrupted window payload on disk (one byte flipped in the middle of its file) is
/// detected at load: the hit is dropped whole, the prompt is recomputed with the cold run's
/// tokens, only that payload is stored again, and the next engine hits in full.
#[test]
fn a_corrupted_window_payload_is_detected_recomputed_and_stored_again() {
    let dir = tempfile::tempdir().unwrap();
    let disk = || -> (Arc<TieredStore>, Arc<DiskTier>) {
        let tier = Arc::new(
            DiskTier::open(DiskTierConfig {
                dir: dir.path().to_path_buf(),
                capacity_bytes: 1 << 30,
                name: "disk".into(),
                sync_writes: true,
                drop_page_cache: false,
            })
            .unwrap(),
        );
        let store = Arc::new(TieredStore::new(vec![tier.clone() as Arc<dyn Tier>]));
        (store, tier)
    };
    let (mut cold, _) = engine(None, config());
    let (prompt, _) = book_tokens(&cold, 1200, 0);
    let want = cold.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    drop(cold);

    let (store, tier) = disk();
    let (mut first, t1) = engine(Some(tiers(store.clone(), None)), config());
    first.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    let t1 = t1.unwrap();
    let s = t1.stats();
    wait_stored(
        &t1,
        &store,
        s.full_attention_bytes_queued + s.window_bytes_queued,
    );
    let keyer =
        pk_tiers::ChunkKeyer::new(KEY_MODEL_ID, first.cache_namespace().as_bytes(), 256, 16)
            .unwrap();
    drop((first, t1, store));
    // 1,199 tokens before the last: 4 chunks; the end's window needs chunks 2 and 3.
    let window_key = keyer.keys(&prompt[..1024], None)[3].window_layers();
    let path = tier.entry_path(&window_key);
    let mut bytes = std::fs::read(&path).expect("the window payload is on disk");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    drop(tier);

    let (store, _) = disk();
    let (mut second, t2) = engine(Some(tiers(store.clone(), None)), config());
    let t2 = t2.unwrap();
    let out = second.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    assert_eq!(out.cached_prompt_tokens, 0, "the corrupted hit is not used");
    assert_eq!(out.token_ids, want.token_ids);
    let s = t2.stats();
    assert!(s.load_failures >= 1, "{s:?}");
    assert_eq!(
        (s.chunks_queued, s.window_chunks_queued),
        (0, 1),
        "only it is stored again"
    );
    wait_stored(&t2, &store, 1);
    drop((second, t2, store));

    let (store, _) = disk();
    let (mut third, _) = engine(Some(tiers(store, None)), config());
    let out = third.generate(&prompt, &greedy(), &mut |_| {}).unwrap();
    assert_eq!(out.cached_prompt_tokens, 1024);
    assert_eq!(out.token_ids, want.token_ids);
}
