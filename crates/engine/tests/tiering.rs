//! Prompt KV reused across engine restarts through real tiers (RAM, then a disk directory
//! with fsync): the second engine loads the stored chunks instead of prefilling them and
//! produces exactly the same greedy tokens.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_engine::{EngineConfig, GenerateParams, TieringConfig};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, Tier, TieredStore};

fn tiered(dir: &std::path::Path) -> Arc<TieredStore> {
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(64 << 20));
    let disk: Arc<dyn Tier> = Arc::new(
        DiskTier::open(DiskTierConfig { dir: dir.to_path_buf(), capacity_bytes: 256 << 20, name: "disk".into(), sync_writes: true, drop_page_cache: false }).unwrap(),
    );
    // Write-through to the slowest tier: the disk copy is what survives a restart.
    Arc::new(TieredStore::new(vec![ram, disk]).with_write_through_last(true))
}

fn config(store: Arc<TieredStore>) -> EngineConfig {
    EngineConfig { tiering: Some(TieringConfig { store, chunk_size_tokens: 256, max_pending_bytes: 64 << 20 }), ..Default::default() }
}

#[test]
fn stored_prompt_chunks_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let book = common::book_ids();
    let prompt = &book[5000..5600];
    let params = GenerateParams { max_tokens: 16, ignore_eos: true, ..Default::default() };

    let store = tiered(dir.path());
    let mut first = common::engine(config(store.clone()));
    let a = first.generate(prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(a.cached_prompt_tokens, 0);
    // The writer thread stores asynchronously; wait until both chunks are visible.
    let t0 = Instant::now();
    while first.tiering_stats().unwrap().chunks_queued < 2 || store.metrics().iter().map(|m| m.bytes_written).sum::<u64>() < 2 * 256 * 23040 {
        assert!(t0.elapsed() < Duration::from_secs(30), "chunks were not stored: {:?}", first.tiering_stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Dropping the engine waits for its writer thread, so the disk holds every chunk.
    drop(first);
    drop(store);

    // A new process: empty RAM tier, the same disk directory.
    let mut second = common::engine(config(tiered(dir.path())));
    let b = second.generate(prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(b.cached_prompt_tokens, 512, "two 256-token chunks must come from the disk tier");
    assert_eq!(second.tiering_stats().unwrap().chunks_loaded, 2);
    assert_eq!(a.token_ids, b.token_ids, "KV loaded from disk must give the same tokens");
    second.check_invariants();
}
