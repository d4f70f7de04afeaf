//! Prompt KV reused across engine restarts through real tiers (RAM, then a disk directory
//! with fsync): the second engine loads the stored chunks instead of prefilling them and
//! produces exactly the same greedy tokens.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_connectors::ReuseConfig;
use pk_engine::{EngineConfig, GenerateParams};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, Tier, TieredStore};

fn tiered(dir: &std::path::Path) -> Arc<TieredStore> {
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(64 << 20));
    let disk: Arc<dyn Tier> = Arc::new(
        DiskTier::open(DiskTierConfig {
            dir: dir.to_path_buf(),
            capacity_bytes: 256 << 20,
            name: "disk".into(),
            sync_writes: true,
            drop_page_cache: false,
        })
        .unwrap(),
    );
    // Write-through to the slowest tier: the disk copy is what survives a restart.
    Arc::new(TieredStore::new(vec![ram, disk]).with_write_through_last(true))
}

use common::tiers_config as config;

#[test]
fn stored_prompt_chunks_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let prompt = &book[5000..5600];
    let params = GenerateParams {
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };

    let store = tiered(dir.path());
    let (mut first, first_tiers) = common::tiered_engine(Default::default(), config(store.clone()));
    let a = first.generate(prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(a.cached_prompt_tokens, 0);
    // The writer thread stores asynchronously; wait until both chunks are visible.
    let t0 = Instant::now();
    while first_tiers.stats().chunks_queued < 2
        || store.metrics().iter().map(|m| m.bytes_written).sum::<u64>() < 2 * 256 * 23040
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "chunks were not stored: {:?}",
            first_tiers.stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Dropping the connector (the engine's and our handle) waits for its writer thread, so
    // the disk holds every chunk.
    drop(first);
    drop(first_tiers);
    drop(store);

    // A new process: empty RAM tier, the same disk directory.
    let (mut second, second_tiers) =
        common::tiered_engine(Default::default(), config(tiered(dir.path())));
    let b = second.generate(prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(
        b.cached_prompt_tokens, 512,
        "two 256-token chunks must come from the disk tier"
    );
    assert_eq!(second_tiers.stats().chunks_loaded, 2);
    assert_eq!(
        a.token_ids, b.token_ids,
        "KV loaded from disk must give the same tokens"
    );
    second.check_invariants();
}

/// Cache keys name the model file's contents, not its name: two GGUFs called the same with
/// different bytes (here one weight byte changed) sharing one disk tier get no hits from
/// each other, while an identical copy of the first does.
#[test]
fn same_named_models_with_different_contents_never_share_tier_entries() {
    let tier_dir = tempfile::tempdir().unwrap();
    same_named_models_share_nothing(&|| tiered(tier_dir.path()));
}

/// The same through one Redis server (the CI's, `PAGEKEEPER_TEST_REDIS`, else a private
/// `redis-server` from PATH), as two servers sharing it would.
#[test]
fn same_named_models_with_different_contents_never_share_redis_entries() {
    let (url, _server) = common::redis_for_test();
    let prefix = format!(
        "pktest:same-name:{}:{:?}:",
        std::process::id(),
        Instant::now()
    );
    let tier = pk_tiers::open_tier(&pk_tiers::TierConfig::Redis {
        url,
        capacity_bytes: Some(256 << 20),
        key_prefix: Some(prefix),
    })
    .unwrap();
    same_named_models_share_nothing(&|| Arc::new(TieredStore::new(vec![tier.clone()])));
}

fn same_named_models_share_nothing(store_for: &dyn Fn() -> Arc<TieredStore>) {
    let copies = tempfile::tempdir().unwrap();
    let original = std::fs::read(common::model_path()).unwrap();
    let file = common::model_path().file_name().unwrap().to_owned();
    let place = |sub: &str, bytes: &[u8]| {
        let d = copies.path().join(sub);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(&file), bytes).unwrap();
        d.join(&file)
    };
    let mut changed = original.clone();
    // The last byte belongs to the last tensor's data (a weight), not to the header.
    *changed.last_mut().unwrap() ^= 0x01;
    let (a, b, c) = (
        place("a", &original),
        place("b", &changed),
        place("c", &original),
    );
    let book = common::book_ids();
    let prompt = &book[7000..7600];
    let params = GenerateParams {
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    let run = |path: &std::path::Path| {
        let store = store_for();
        let one_table = EngineConfig {
            hybrid_kv_cache: false,
            ..Default::default()
        };
        let mut e = pk_engine::Engine::load(path, one_table).unwrap();
        let cfg = ReuseConfig::Chunks(config(store.clone()));
        let _tiers = pk_connectors::attach(&mut e, &cfg).unwrap();
        let out = e.generate(prompt, &params, &mut |_| {}).unwrap();
        let t0 = Instant::now();
        while store.metrics().iter().map(|m| m.bytes_written).sum::<u64>() < 2 * 256 * 23040
            && out.cached_prompt_tokens == 0
        {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "chunks were not stored"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        (out.cached_prompt_tokens, e.kv_fingerprint())
    };
    let (hits_a, fa) = run(&a);
    let (hits_b, fb) = run(&b);
    let (hits_c, fc) = run(&c);
    assert_eq!(hits_a, 0);
    assert_ne!(fa, fb, "different contents, different cache identity");
    assert_eq!(
        hits_b, 0,
        "the changed model must not load the first model's KV"
    );
    assert_eq!(fa, fc);
    assert_eq!(
        hits_c, 512,
        "an identical copy under another path reuses the stored chunks"
    );
}

/// A request waiting for blocks asks the tiers once, not at every engine step (with a
/// Redis tier each ask is a round trip).
#[test]
fn a_waiting_request_makes_one_tier_lookup() {
    let dir = tempfile::tempdir().unwrap();
    // 40 blocks of 16 tokens: the first request holds 33 of them while it decodes.
    let cfg = EngineConfig {
        kv_capacity_tokens: Some(640),
        ..Default::default()
    };
    let (mut e, tiers) = common::tiered_engine(cfg, config(tiered(dir.path())));
    let waited_steps = common::run_with_a_waiting_request(&mut e);
    assert_eq!(
        tiers.stats().lookups,
        2,
        "one lookup per request over {waited_steps} waiting steps"
    );
}
