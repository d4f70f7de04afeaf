//! Whole-context reuse through an EVICPRESS `ContextStore` on real tiers (RAM, then a disk
//! directory), and the `prefix_kv` primitive under it, on the default model.

mod common;

use std::sync::Arc;

use pk_connectors::profiler::{profile_blocking, start_profile_with};
use pk_connectors::{ContextReuse, ContextReuseConfig, PrefixKv};
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_evicpress::{Compression, DelayModel, Grid, Policy, Ranking, StoreConfig, TierSpec};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, Tier};

fn store_config(dir: &std::path::Path, policy: Policy, ram_bytes: u64) -> StoreConfig {
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(ram_bytes * 2 + (8 << 20)));
    let disk: Arc<dyn Tier> = Arc::new(DiskTier::open(DiskTierConfig::new(dir, 1 << 30)).unwrap());
    let spec = |name: &str, bw: f64| TierSpec {
        name: name.into(),
        capacity_bytes: 0,
        read_bytes_per_s: bw,
        access_latency_s: 0.0,
    };
    StoreConfig {
        tiers: vec![ram, disk],
        capacities_bytes: vec![ram_bytes, u64::MAX],
        grid: Grid::parse("q8,q4,knorm-0.5,paged-eviction-0.5").unwrap(),
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

fn engine_with(store: StoreConfig) -> (Engine, Arc<ContextReuse>) {
    // The pool's own prefix cache would serve repeats before the store is asked.
    let config = EngineConfig {
        enable_prefix_caching: false,
        ..Default::default()
    };
    common::contexts_engine(config, contexts_config(store))
}

fn contexts_config(store: StoreConfig) -> ContextReuseConfig {
    ContextReuseConfig {
        store,
        chunk_size_tokens: 256,
        profile_metric: Default::default(),
    }
}

#[test]
fn a_stored_context_is_reused_and_gives_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[2000..2512];
    let prompt = |q: &[u32]| [context, q].concat();
    let params = GenerateParams {
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    };
    let (mut e, c) = engine_with(store_config(dir.path(), Policy::Lru, 256 << 20));

    let a = e
        .generate(&prompt(&book[100..120]), &params, &mut |_| {})
        .unwrap();
    assert!(a.context_load.is_none());
    c.store().flush();
    assert_eq!(
        c.store().len(),
        1,
        "the 512-token context was offered and stored"
    );

    // Another question on the same context: a hit from RAM, uncompressed (LRU).
    let b = e
        .generate(&prompt(&book[200..215]), &params, &mut |_| {})
        .unwrap();
    let load = b
        .context_load
        .expect("the context is loaded from the store");
    assert_eq!(
        (load.tier.as_str(), load.config.as_str()),
        ("ram", "none-0")
    );
    assert_eq!(b.cached_prompt_tokens, 512);

    // The same answer as a cold engine computing everything.
    let mut cold = common::engine(EngineConfig::default());
    let c = cold
        .generate(&prompt(&book[200..215]), &params, &mut |_| {})
        .unwrap();
    assert_eq!(b.token_ids, c.token_ids);
    e.check_invariants();
}

#[test]
fn a_fixed_compression_is_served_compressed_with_positions_kept() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[3000..3768];
    let query = &book[400..420];
    let prompt = [context, query].concat();
    let params = GenerateParams {
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let grid = Grid::parse("q8,q4,knorm-0.5,paged-eviction-0.5").unwrap();
    let fixed = grid
        .index_of(&Compression::parse("paged-eviction-0.5").unwrap())
        .unwrap();
    let (mut e, c) = engine_with(store_config(dir.path(), Policy::Fixed(fixed), 256 << 20));
    e.generate(&prompt, &params, &mut |_| {}).unwrap();
    c.store().flush();
    let b = e.generate(&prompt, &params, &mut |_| {}).unwrap();
    let load = b.context_load.expect("hit");
    assert_eq!(load.config, "paged-eviction-0.5");
    // Half the context's tokens are stored; the query still sits after all 768 positions.
    assert_eq!(b.cached_prompt_tokens, 768);
    assert!(
        b.kv_stored_tokens < 768 / 2 + query.len() + 8 + 16,
        "{}",
        b.kv_stored_tokens
    );
    e.check_invariants();
}

#[test]
fn evicpress_keeps_ram_within_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    // RAM holds about one and a half uncompressed 256-token contexts (23 KB per token).
    let ram_bytes = 256 * 23040 * 3 / 2;
    let (mut e, c) = engine_with(store_config(
        dir.path(),
        Policy::Evicpress {
            alpha: 1.0,
            ranking: Ranking::AbsoluteDrop,
        },
        ram_bytes,
    ));
    let params = GenerateParams {
        max_tokens: 1,
        ..Default::default()
    };
    for i in 0..4 {
        let prompt = [&book[i * 300..i * 300 + 256], &book[50..60]].concat();
        e.generate(&prompt, &params, &mut |_| {}).unwrap();
    }
    let store = c.store();
    store.flush();
    assert_eq!(store.len(), 4);
    let usage = store.usage_bytes();
    assert!(usage[0] <= ram_bytes, "{usage:?}");
    assert!(usage[0] > 0, "something is placed in RAM");
    let rows = store.explain();
    assert_eq!(rows.len(), 4);
    assert!(rows
        .iter()
        .all(|r| r.options.len() == 2 * 5
            && r.options.windows(2).all(|w| w[0].utility >= w[1].utility)));
}

#[test]
fn prefix_kv_stands_in_for_the_computed_prefix() {
    let book = common::book_ids();
    let context = &book[6000..6400];
    let cont = &book[6400..6432];
    let mut e = common::engine(EngineConfig::default());
    let full = e
        .teacher_force(context, cont, &GenerateParams::default())
        .unwrap();

    // The engine's own KV of the context, handed back as a prefix: the same logits.
    let dir = tempfile::tempdir().unwrap();
    let (mut s, sc) = engine_with(store_config(dir.path(), Policy::Lru, 256 << 20));
    s.generate(
        &[context, &cont[..1]].concat(),
        &GenerateParams {
            max_tokens: 1,
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    let store = sc.store();
    store.flush();
    let key = store.explain()[0].key.clone();
    let kv = store
        .load_master(&pk_tiers::ChunkKey::from_hex(&key).unwrap())
        .unwrap();
    assert_eq!(kv.n_original_tokens, 256);
    let params = GenerateParams {
        prefix_kv: Some(Arc::new(PrefixKv { kv })),
        ..Default::default()
    };
    let given = e.teacher_force(context, cont, &params).unwrap();
    let argmax = |r: &Vec<f32>| {
        r.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    for (a, b) in full.iter().zip(&given) {
        assert_eq!(argmax(a), argmax(b));
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-3, "logits differ by {diff}");
    }
}

/// An engine whose store holds book[8000..8512] (stored by a first request), and its key.
fn engine_with_stored_context(
    dir: &std::path::Path,
    book: &[u32],
) -> (Engine, Arc<ContextReuse>, pk_tiers::ChunkKey) {
    let context = &book[8000..8512];
    let (mut e, c) = engine_with(store_config(
        dir,
        Policy::Evicpress {
            alpha: 1.0,
            ranking: Ranking::AbsoluteDrop,
        },
        256 << 20,
    ));
    let key = c.context_key(context, None).unwrap();
    e.generate(
        &[context, &book[10..20]].concat(),
        &GenerateParams {
            max_tokens: 1,
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    c.store().flush();
    (e, c, key)
}

#[test]
fn profiling_measures_quality_per_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let (mut e, c, key) = engine_with_stored_context(dir.path(), &book);
    let store = c.store();
    assert!(
        store.contains(&key),
        "the key the engine computes is the one it stored under"
    );
    let queries: Vec<Vec<u32>> = (0..3)
        .map(|i| book[8600 + i * 40..8620 + i * 40].to_vec())
        .collect();
    let q = profile_blocking(&mut e, &c, key, &queries, 12).unwrap();
    assert_eq!(q.len(), store.grid().len());
    assert_eq!(q[0], 1.0, "the full KV agrees with itself");
    assert!(q.iter().all(|x| (0.0..=1.0).contains(x)));
    // Free-running book text is chaotic (one near-tie flips the rest of a greedy answer),
    // so only a loose floor: 8-bit KV agrees with the full KV on most answer tokens.
    assert!(q[1] >= 0.5, "q8 quality {q:?}");
    let row = &store.explain()[0];
    assert_eq!(row.quality_source, pk_evicpress::QualitySource::Profiled);
    e.check_invariants();
}

/// The share of the full KV's greedy answer to `prompt` (after `full`) that `prefix`'s KV
/// predicts as its most likely token when the answer is forced.
fn forced_agreement(
    e: &mut Engine,
    prompt: &[u32],
    full: &Arc<PrefixKv>,
    prefix: &Arc<PrefixKv>,
) -> f64 {
    let given = |p: &Arc<PrefixKv>, max_tokens| GenerateParams {
        max_tokens,
        prefix_kv: Some(p.clone()),
        ..Default::default()
    };
    let reference = e
        .generate(prompt, &given(full, 10), &mut |_| {})
        .unwrap()
        .token_ids;
    let rows = e
        .teacher_force(prompt, &reference, &given(prefix, 128))
        .unwrap();
    let argmax = |row: &Vec<f32>| {
        row.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32
    };
    let agree = rows
        .iter()
        .zip(&reference)
        .filter(|(row, &t)| argmax(row) == t)
        .count();
    agree as f64 / reference.len() as f64
}

#[test]
fn teacher_forced_profiling_is_the_agreement_on_the_full_kv_answer() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[8000..8512];
    let (mut e, c, key) = engine_with_stored_context(dir.path(), &book);
    let store = c.store();
    let queries: Vec<Vec<u32>> = (0..2)
        .map(|i| book[8600 + i * 40..8620 + i * 40].to_vec())
        .collect();
    let metric = pk_connectors::profiler::QualityMetric::TeacherForced;
    let mut p = start_profile_with(&mut e, &c, key, &queries, 10, metric).unwrap();
    while !p.poll(&mut e).unwrap() {
        assert!(e.has_work(), "profiling requests ended without results");
        e.step();
    }
    let q = p.qualities();
    assert_eq!(q[0], 1.0);
    // The same numbers computed by hand for each configuration: greedy answers from the
    // full KV, forced on the configuration's KV, argmax agreement averaged over queries.
    let full = store.load_master(&key).unwrap();
    let full_prefix = Arc::new(PrefixKv { kv: full.clone() });
    for (c, &got) in q.iter().enumerate().skip(1) {
        let prefix = Arc::new(PrefixKv {
            kv: store.compress(&key, &full, c).unwrap(),
        });
        let sum: f64 = queries
            .iter()
            .map(|query| {
                let prompt = [context, &query[..]].concat();
                forced_agreement(&mut e, &prompt, &full_prefix, &prefix)
            })
            .sum();
        let want = (sum / queries.len() as f64) as f32;
        assert!(
            (got - want).abs() < 1e-6,
            "configuration {c}: profiled {got}, by hand {want}"
        );
    }
    assert!(
        q[1] >= 0.8,
        "8-bit KV predicts most of the full KV's answer tokens: {q:?}"
    );
    e.check_invariants();
}

#[test]
fn a_restarted_engine_adopts_masters_left_on_the_last_tier() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[9000..9512];
    let params = GenerateParams {
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let prompt = [context, &book[300..320]].concat();
    let first = {
        let (mut e, c) = engine_with(store_config(dir.path(), Policy::Lru, 256 << 20));
        let out = e.generate(&prompt, &params, &mut |_| {}).unwrap();
        c.store().flush();
        out
    };
    // A new process: empty RAM, empty index, the same disk directory.
    let (mut e, c) = engine_with(store_config(dir.path(), Policy::Lru, 256 << 20));
    let again = e.generate(&prompt, &params, &mut |_| {}).unwrap();
    let load = again
        .context_load
        .expect("the master on disk is found and adopted");
    // Adoption asks the worker to place the context, which may copy it up to RAM before
    // this load reads it: either tier is a hit on what the first engine stored.
    assert!(load.tier == "disk" || load.tier == "ram", "{}", load.tier);
    assert_eq!(again.cached_prompt_tokens, 512);
    assert_eq!(again.token_ids, first.token_ids);
    let store = c.store();
    store.flush();
    assert_eq!(store.stats().adopted, 1);
    assert_eq!(
        store.placement_of(&c.context_key(context, None).unwrap()),
        Some((0, 0)),
        "a hit is copied up to RAM"
    );
}

#[test]
fn background_requests_yield_to_waiting_user_requests() {
    let book = common::book_ids();
    let mut e = common::engine(EngineConfig {
        max_running_seqs: 1,
        ..Default::default()
    });
    let (tx, rx) = std::sync::mpsc::channel();
    for (name, background) in [("profile-1", true), ("profile-2", true), ("user", false)] {
        let tx = tx.clone();
        let params = GenerateParams {
            max_tokens: 2,
            ignore_eos: true,
            background,
            ..Default::default()
        };
        let sink = Box::new(move |ev: pk_engine::SeqEvent| {
            if matches!(ev, pk_engine::SeqEvent::Finished(_)) {
                let _ = tx.send(name);
            }
            true
        });
        e.submit(pk_engine::Request {
            prompt_ids: book[..32].to_vec(),
            params,
            cache_salt: None,
            sink,
        })
        .unwrap();
    }
    while e.has_work() {
        e.step();
    }
    let order: Vec<&str> = rx.try_iter().collect();
    assert_eq!(
        order,
        vec!["user", "profile-1", "profile-2"],
        "the user's request, submitted last, is admitted first"
    );
}

#[test]
fn kvzip_scores_computed_in_idle_time_are_those_of_the_passes_at_store_time() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[6000..6512];
    let mut cfg = store_config(dir.path(), Policy::Fixed(2), 256 << 20);
    cfg.grid = Grid::parse("q8,kvzip-0.5").unwrap();
    let (mut e, c) = engine_with(cfg);
    c.score_kvzip_in_idle_time();
    let key = c.context_key(context, None).unwrap();
    let params = GenerateParams {
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    e.generate(&[context, &book[10..30]].concat(), &params, &mut |_| {})
        .unwrap();
    let store = c.store();
    store.flush();
    assert_eq!(e.stats.kvzip_store_scored, 0, "nothing ran at store time");
    assert!(!store.is_available(&key, 2));
    assert_eq!(store.kvzip_candidates(4).len(), 1);

    // The idle hook's request: the master (all but its last token) and the kvzip policy.
    let n = pk_connectors::kvzip_scoring::score_pending_blocking(&mut e, &c).unwrap();
    assert_eq!(n, 1);
    assert!(store.is_available(&key, 2) && store.kvzip_candidates(4).is_empty());
    let got = store.kvzip_scores_of(&key).unwrap();

    // The same scores as the passes at store time (the other test's reference: a kvzip
    // run over the context alone on a fresh engine).
    let worst = kvzip_score_gap(&got, context);
    assert!(worst <= 1e-5, "scores differ by up to {worst}");
    e.check_invariants();
}

/// A context stored by one server and adopted by the next before it was scored (its token
/// ids are not stored, only its KV) waits for KVzip scores again once a request brings
/// its tokens, and is then scored in idle time.
#[test]
fn a_context_adopted_before_its_kvzip_scoring_is_scored_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[7000..7512];
    let config = || {
        let mut cfg = store_config(dir.path(), Policy::Fixed(2), 256 << 20);
        cfg.grid = Grid::parse("q8,kvzip-0.5").unwrap();
        cfg
    };
    let params = GenerateParams {
        max_tokens: 2,
        ignore_eos: true,
        ..Default::default()
    };
    let key = {
        let (mut e, c) = engine_with(config());
        c.score_kvzip_in_idle_time();
        e.generate(&[context, &book[10..30]].concat(), &params, &mut |_| {})
            .unwrap();
        c.store().flush();
        assert_eq!(c.store().kvzip_candidates(4).len(), 1, "stored, not scored");
        c.context_key(context, None).unwrap()
    };

    let (mut e, c) = engine_with(config());
    c.score_kvzip_in_idle_time();
    let b = e
        .generate(&[context, &book[40..60]].concat(), &params, &mut |_| {})
        .unwrap();
    assert!(b.context_load.is_some(), "adopted from the disk and loaded");
    let store = c.store();
    store.flush();
    assert_eq!(store.stats().adopted, 1);
    let pending = store.kvzip_candidates(4);
    assert_eq!(pending.len(), 1, "waits for its scores again");
    assert_eq!((pending[0].0, pending[0].1.as_slice()), (key, context));
    let n = pk_connectors::kvzip_scoring::score_pending_blocking(&mut e, &c).unwrap();
    assert_eq!(n, 1);
    assert!(store.is_available(&key, 2) && store.kvzip_candidates(4).is_empty());
    let worst = kvzip_score_gap(&store.kvzip_scores_of(&key).unwrap(), context);
    assert!(worst <= 1e-5, "scores differ by up to {worst}");
    e.check_invariants();
}

/// Asks `context` (512 tokens, stored) again with another question and checks that the
/// hit was served from `config`'s copy, half of the context's tokens dropped.
fn served_half_dropped(e: &mut Engine, context: &[u32], params: &GenerateParams, config: &str) {
    let book = common::book_ids();
    let b = e
        .generate(&[context, &book[40..60]].concat(), params, &mut |_| {})
        .unwrap();
    let load = b.context_load.expect("hit");
    assert_eq!(load.config, config);
    assert_eq!(b.cached_prompt_tokens, 512);
    assert!(
        b.kv_stored_tokens <= 256 + 20 + 4 + 16,
        "{}",
        b.kv_stored_tokens
    );
}

/// The largest difference between `got` and the KVzip scores of a `kvzip` run at `shared`
/// granularity (the mean over every layer and KV head) over `context` alone on a fresh
/// engine; the lengths must match.
fn kvzip_score_gap(got: &[f32], context: &[u32]) -> f32 {
    let mut fresh = common::engine(EngineConfig::default());
    let reference = GenerateParams {
        max_tokens: 2,
        ignore_eos: true,
        kv_policy: Some("kvzip".parse().unwrap()),
        kv_budget: Some(48),
        kv_granularity: Some(pk_kv::KvGranularity::Shared),
        record_prefill_keeps: true,
        ..Default::default()
    };
    let out = fresh.generate(context, &reference, &mut |_| {}).unwrap();
    let want = out.prefill_keeps.unwrap().swap_remove(0).prior_scores;
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// An engine whose store has `grid` and places every context under the grid's second
/// configuration, after `context` (and a 20-token question) was generated from once and
/// stored; with the context's key and the greedy parameters used.
fn stored_under(
    grid: &str,
    dir: &std::path::Path,
    context: &[u32],
) -> (
    Engine,
    Arc<ContextReuse>,
    pk_tiers::ChunkKey,
    GenerateParams,
) {
    let book = common::book_ids();
    let mut cfg = store_config(dir, Policy::Fixed(2), 256 << 20);
    cfg.grid = Grid::parse(grid).unwrap();
    let (mut e, c) = engine_with(cfg);
    let key = c.context_key(context, None).unwrap();
    let params = GenerateParams {
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    e.generate(&[context, &book[10..30]].concat(), &params, &mut |_| {})
        .unwrap();
    c.store().flush();
    (e, c, key, params)
}

#[test]
fn a_kvzip_grid_scores_a_context_by_its_reconstruction_and_serves_it_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[6000..6512];
    let (mut e, c, key, params) = stored_under("q8,kvzip-0.5", dir.path(), context);
    let store = c.store();
    assert_eq!(e.stats.kvzip_store_scored, 1);
    assert_eq!(e.stats.kvzip_store_failed, 0);
    assert!(e.stats.kvzip_store_seconds > 0.0);
    assert!(
        store.is_available(&key, 2),
        "the offer carried KVzip scores"
    );

    // The same scores from a kvzip run over the context alone on a fresh engine: the
    // passes covered the stored context, not the question after it, and each token's
    // score is the mean over every layer and KV head (`shared` granularity's unit).
    let got = store.kvzip_scores_of(&key).unwrap();
    assert_eq!(got.len(), 512);
    let worst = kvzip_score_gap(&got, context);
    assert!(worst <= 1e-6, "scores differ by up to {worst}");

    // Placed with half its tokens dropped by those scores, and served from that copy.
    served_half_dropped(&mut e, context, &params, "kvzip-0.5");
    assert_eq!(e.stats.kvzip_store_scored, 1, "a hit runs no passes");
    e.check_invariants();
}

#[test]
fn a_snapkv_grid_scores_a_context_by_its_last_queries_and_serves_it_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let context = &book[5000..5512];
    let (mut e, c, key, params) = stored_under("q8,snapkv-0.5", dir.path(), context);
    let store = c.store();
    assert!(
        store.is_available(&key, 2),
        "the offer carried the window's queries"
    );

    // The same scores from the queries a cold prefill of the context alone computes: the
    // offer's second pass over the last 64 tokens reproduces them.
    let model = e.cpu_model().unwrap();
    let c = &model.config;
    let g = pk_model::KvGeometry {
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        block_size_tokens: 16,
        num_blocks: 32,
    };
    let mut kv = pk_model::KvStore::new(g, pk_model::KvDtype::F16);
    let table: Vec<u32> = (0..32).collect();
    let fwd = pk_model::SeqForward {
        tokens: context,
        start_position: 0,
        stored_start: 0,
        block_table: &table,
        logits_from: context.len(),
        stored_positions: &[],
        window_tables: &[],
        head_first_keys: &[],
    };
    let (_, mut captured) = model.forward_with_queries(&mut kv, &[fwd], &[64]);
    let window = pk_evicpress::WindowQueries {
        n_heads: c.n_heads,
        positions: (448..512).collect(),
        data: captured.swap_remove(0),
    };
    let master = store.load_master(&key).unwrap();
    let want = pk_evicpress::snapkv_scores(&master, &window).unwrap();
    assert_eq!(store.snapkv_scores_of(&key).unwrap(), want);

    // Placed with half its tokens dropped by those scores, and served from that copy.
    served_half_dropped(&mut e, context, &params, "snapkv-0.5");
    e.check_invariants();
}

/// A request waiting for blocks asks the context store once, not at every engine step (the
/// connector's answer is kept on the waiting sequence).
#[test]
fn a_waiting_request_makes_one_context_lookup() {
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        enable_prefix_caching: false,
        // 40 blocks of 16 tokens: the first request holds 33 of them while it decodes.
        kv_capacity_tokens: Some(640),
        ..Default::default()
    };
    let store = store_config(dir.path(), Policy::Lru, 256 << 20);
    let (mut e, c) = common::contexts_engine(config, contexts_config(store));
    let waited_steps = common::run_with_a_waiting_request(&mut e);
    assert_eq!(
        c.stats().lookups,
        2,
        "one lookup per request over {waited_steps} waiting steps"
    );
}
