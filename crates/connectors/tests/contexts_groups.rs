//! The EVICPRESS context store on Gemma-3-270M with KV cache groups on (its 15
//! sliding-window layers in tables of their own that release every block behind the
//! 512-token window): a context is stored by group (the 3 full-attention layers of every
//! token under the chosen configuration, the window layers' tail window only), reloads
//! after a restart with a cold run's bits when stored uncompressed, is served dropped with
//! its window intact, is profiled on that layout, and is never read across a change of
//! layout; a context whose window the pool released before it was copied is not stored.
//!
//! The model is fetched by `pagekeeper fetch-model --name all` (the README's test command);
//! these tests fail, not skip, without it.

use std::sync::Arc;

use pk_connectors::profiler::profile_blocking;
use pk_connectors::{ContextReuse, ContextReuseConfig, ReuseConfig};
use pk_engine::model_store::{known_model_path, GEMMA3_270M};
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_evicpress::{DelayModel, Grid, Policy, StoreConfig, TierSpec};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, Tier};

/// Gemma-3-270M: 18 layers of one KV head of 256, every sixth full attention.
const ONE_TABLE_BYTES_PER_TOKEN: f64 = 18.0 * 256.0 * 2.0 * 2.0;
const CONTEXT_TOKENS: usize = 2048;

fn gemma_path() -> std::path::PathBuf {
    let p = known_model_path(&GEMMA3_270M);
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all` first",
        p.display()
    );
    p
}

fn store_config(dir: &std::path::Path, grid: &str, policy: Policy) -> StoreConfig {
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(256 << 20));
    let disk: Arc<dyn Tier> = Arc::new(DiskTier::open(DiskTierConfig::new(dir, 1 << 30)).unwrap());
    let spec = |name: &str, bw: f64| TierSpec {
        name: name.into(),
        capacity_bytes: 0,
        read_bytes_per_s: bw,
        access_latency_s: 0.0,
    };
    StoreConfig {
        tiers: vec![ram, disk],
        capacities_bytes: vec![128 << 20, u64::MAX],
        grid: Grid::parse(grid).unwrap(),
        policy,
        fingerprint: [0; 32],
        delay: DelayModel {
            tiers: vec![spec("ram", 5e9), spec("disk", 2e8)],
            decode_s_per_byte: 1e-9,
            restore_s_per_token: 1e-6,
            prefill_tokens_per_s: 300.0,
            query_tokens: 32,
        },
        frequency_half_life_s: 600.0,
        reprofile_threshold: 0.05,
        max_pending_bytes: 512 << 20,
        max_queries_per_context: 4,
        copies: pk_evicpress::Copies::MasterAndPlaced,
    }
}

fn config(groups: bool) -> EngineConfig {
    EngineConfig {
        kv_capacity_tokens: Some(8192),
        // Every hit must come from the store, not from the pool of the same engine.
        enable_prefix_caching: false,
        hybrid_kv_cache: groups,
        ..Default::default()
    }
}

fn engine(store: Option<StoreConfig>, config: EngineConfig) -> (Engine, Option<Arc<ContextReuse>>) {
    let mut e = Engine::load(&gemma_path(), config).expect("Gemma-3-270M loads");
    let Some(store) = store else { return (e, None) };
    let cfg = ContextReuseConfig {
        store,
        chunk_size_tokens: 256,
        profile_metric: Default::default(),
    };
    let attached = pk_connectors::attach(&mut e, &ReuseConfig::Contexts(cfg)).unwrap();
    (e, attached.contexts().cloned())
}

/// The book in Gemma's vocabulary: a context of `CONTEXT_TOKENS`, then questions.
fn book(e: &Engine) -> Vec<u32> {
    let text = String::from_utf8_lossy(include_bytes!(
        "../../../tests/fixtures/around-the-world-in-80-days.txt"
    ))
    .into_owned();
    let ids = e.tokenizer.encode_prompt(&text, false);
    assert!(ids.len() > CONTEXT_TOKENS + 400);
    ids
}

fn greedy() -> GenerateParams {
    GenerateParams {
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    }
}

fn prompt(book: &[u32], question: usize) -> Vec<u32> {
    let q = CONTEXT_TOKENS + 100 + 40 * question;
    [&book[..CONTEXT_TOKENS], &book[q..q + 20]].concat()
}

#[test]
fn gemma3_context_is_stored_by_group_and_reloads_after_a_restart_with_the_cold_runs_bits() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cold, _) = engine(None, config(true));
    let book = book(&cold);
    let (p0, p1) = (prompt(&book, 0), prompt(&book, 1));
    let cont = &book[CONTEXT_TOKENS + 500..CONTEXT_TOKENS + 512];
    let cold_out = cold.generate(&p1, &greedy(), &mut |_| {}).unwrap();
    let cold_logits = cold.teacher_force(&p1, cont, &greedy()).unwrap();
    drop(cold);

    let (mut first, c) = engine(
        Some(store_config(dir.path(), "q8,q4", Policy::Lru)),
        config(true),
    );
    assert!(
        first.kv_group_layout().is_some(),
        "KV cache groups stay on with the store"
    );
    let c = c.unwrap();
    first.generate(&p0, &greedy(), &mut |_| {}).unwrap();
    c.store().flush();
    assert_eq!(c.store().len(), 1, "the context was offered and stored");
    let row = &c.store().explain()[0];
    let by_group = row.bytes_by_group.expect("stored by group");
    let one_table = ONE_TABLE_BYTES_PER_TOKEN * CONTEXT_TOKENS as f64;
    eprintln!(
        "{} tokens: {} bytes stored ({:.1} % of one table: {} full-attention, {} window)",
        row.n_tokens,
        row.bytes,
        100.0 * row.bytes as f64 / one_table,
        by_group.full_attention,
        by_group.sliding_window
    );
    assert_eq!(row.n_tokens, CONTEXT_TOKENS);
    // 3 full-attention layers of 2,048 tokens; 15 window layers of the 511 positions the
    // next token sees; headers and positions besides.
    let layer_token_bytes = 256 * 2 * 2;
    assert!(by_group.full_attention >= (3 * CONTEXT_TOKENS * layer_token_bytes) as u64);
    assert!(by_group.sliding_window >= (15 * 511 * layer_token_bytes) as u64);
    assert!((row.bytes as f64) < 0.40 * one_table, "{row:?}");
    drop((first, c));

    // A restart: an empty RAM tier and index over the same disk directory.
    let (mut second, c) = engine(
        Some(store_config(dir.path(), "q8,q4", Policy::Lru)),
        config(true),
    );
    let c = c.unwrap();
    let out = second.generate(&p1, &greedy(), &mut |_| {}).unwrap();
    let load = out
        .context_load
        .as_ref()
        .expect("the master on disk is adopted and loaded");
    assert_eq!(load.config, "none-0");
    assert_eq!(out.cached_prompt_tokens, CONTEXT_TOKENS);
    assert_eq!(
        out.token_ids, cold_out.token_ids,
        "the same tokens as a cold run"
    );
    let logits = second.teacher_force(&p1, cont, &greedy()).unwrap();
    assert_eq!(logits, cold_logits, "the same bits as a cold run");
    assert_eq!(c.stats().hits, 2);
    second.check_invariants();
}

#[test]
fn gemma3_dropped_context_keeps_its_window_and_is_profiled_by_group() {
    let dir = tempfile::tempdir().unwrap();
    let grid = "q4,knorm-0.5";
    let knorm = Grid::parse(grid)
        .unwrap()
        .index_of(&pk_evicpress::Compression::parse("knorm-0.5").unwrap())
        .unwrap();
    let (mut e, c) = engine(
        Some(store_config(dir.path(), grid, Policy::Fixed(knorm))),
        config(true),
    );
    let c = c.unwrap();
    let book = book(&e);
    e.generate(&prompt(&book, 0), &greedy(), &mut |_| {})
        .unwrap();
    c.store().flush();
    let out = e
        .generate(&prompt(&book, 1), &greedy(), &mut |_| {})
        .unwrap();
    let load = out.context_load.as_ref().expect("a hit");
    assert_eq!(load.config, "knorm-0.5");
    assert_eq!(out.cached_prompt_tokens, CONTEXT_TOKENS);
    // Half the context's tokens in the full-attention layers, then the question and
    // the answer but the last sampled token.
    let kept = pk_codec::drop::n_kept_tokens(CONTEXT_TOKENS, &pk_codec::DropSpec::new(0.5));
    assert_eq!(out.kv_stored_tokens, kept + 20 + 7, "{out:?}");
    e.check_invariants();

    let key = c.context_key(&book[..CONTEXT_TOKENS], None).unwrap();
    let queries: Vec<Vec<u32>> = (2..4)
        .map(|i| prompt(&book, i)[CONTEXT_TOKENS..].to_vec())
        .collect();
    let q = profile_blocking(&mut e, &c, key, &queries, 8).unwrap();
    assert_eq!(q[0], 1.0, "the full KV agrees with itself");
    assert!(q.iter().all(|x| (0.0..=1.0).contains(x)), "{q:?}");
    assert!(
        q[1] >= 0.5,
        "4-bit KV agrees with the full KV on most answer tokens: {q:?}"
    );
    assert_eq!(
        c.store().explain()[0].quality_source,
        pk_evicpress::QualitySource::Profiled
    );
    e.check_invariants();
}

#[test]
fn gemma3_stores_never_cross_a_change_of_layout() {
    let dir = tempfile::tempdir().unwrap();
    let (mut one_table, c) = engine(
        Some(store_config(dir.path(), "q8", Policy::Lru)),
        config(false),
    );
    let book = book(&one_table);
    one_table
        .generate(&prompt(&book, 0), &greedy(), &mut |_| {})
        .unwrap();
    c.unwrap().store().flush();
    drop(one_table);
    let (mut grouped, c) = engine(
        Some(store_config(dir.path(), "q8", Policy::Lru)),
        config(true),
    );
    let out = grouped
        .generate(&prompt(&book, 1), &greedy(), &mut |_| {})
        .unwrap();
    assert!(
        out.context_load.is_none(),
        "one table's store is not read by groups"
    );
    let c = c.unwrap();
    c.store().flush();
    assert_eq!(c.stats().hits, 0);
    drop((grouped, c));
    // And the reverse: the grouped engine stored its own; one table does not read it.
    let (mut one_table, c) = engine(
        Some(store_config(dir.path(), "q8", Policy::Lru)),
        config(false),
    );
    let out = one_table
        .generate(&prompt(&book, 2), &greedy(), &mut |_| {})
        .unwrap();
    let load = out
        .context_load
        .expect("its own context, stored at the start, is found");
    assert_eq!(load.config, "none-0");
    assert_eq!(c.unwrap().stats().hits, 1);
}

#[test]
fn gemma3_context_whose_window_left_the_pool_is_not_stored() {
    // The pool's prefix cache serves an earlier prompt 2,240 tokens long, so the first
    // prefill step of the next one starts 192 positions past the 2,048-token context's
    // end: the cache adopted only the window blocks position 2,240 sees, the ones before
    // that the context's successor would see are gone, and the context must not be
    // stored (nor anything else in their place).
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        enable_prefix_caching: true,
        ..config(true)
    };
    let (mut e, _) = engine(None, cfg.clone());
    let book = book(&e);
    let long: Vec<u32> = book[..CONTEXT_TOKENS + 200].to_vec();
    e.generate(&long, &greedy(), &mut |_| {}).unwrap();
    let store = store_config(dir.path(), "q8", Policy::Lru);
    let cfg = ContextReuseConfig {
        store,
        chunk_size_tokens: 256,
        profile_metric: Default::default(),
    };
    let attached = pk_connectors::attach(&mut e, &ReuseConfig::Contexts(cfg)).unwrap();
    let c = attached.contexts().unwrap().clone();
    let longer = [&long[..], &book[5000..5010]].concat();
    let out = e.generate(&longer, &greedy(), &mut |_| {}).unwrap();
    assert_eq!(
        out.cached_prompt_tokens,
        CONTEXT_TOKENS + 192,
        "a prefix-cache hit"
    );
    c.store().flush();
    assert_eq!(c.stats().window_gone, 1, "{:?}", c.stats());
    assert_eq!(c.store().len(), 0, "nothing stored");
    e.check_invariants();
}

#[test]
fn gemma3_refuses_a_snapkv_grid_with_groups() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = Engine::load(&gemma_path(), config(true)).unwrap();
    let cfg = ContextReuseConfig {
        store: store_config(dir.path(), "q8,snapkv-0.5", Policy::Lru),
        chunk_size_tokens: 256,
        profile_metric: Default::default(),
    };
    let err = pk_connectors::attach(&mut e, &ReuseConfig::Contexts(cfg)).unwrap_err();
    let err = err.to_string();
    assert!(
        err.contains("--evicpress-grid configuration snapkv-0.5"),
        "{err}"
    );
}
