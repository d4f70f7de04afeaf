//! `ContextStore` with a capacity on its last tier (the one that keeps the masters), on a
//! real RAM tier and disk directory: past the capacity whole contexts are dropped (master,
//! placed copy, meta entry), the least valuable by the store's policy first, and a dropped
//! context is a miss that is neither served nor adopted again.

mod common;

use std::sync::Arc;

use pk_codec::KvContext;
use pk_evicpress::{copy_key, ContextStore, Policy, Ranking, StoreError};
use pk_tiers::{ChunkKey, DiskTier, DiskTierConfig, RamTier, Tier};

const N_TOKENS: usize = 256;

fn kv(seed: u32) -> KvContext {
    common::kv(seed, N_TOKENS)
}

/// The bytes of one context's master, as the store accounts them.
fn master_bytes() -> u64 {
    pk_codec::compressed_bytes_estimate(&pk_codec::Method::None, &kv(0).shape()) as u64
}

/// A RAM tier holding `ram_contexts` uncompressed contexts and a disk last tier of
/// `disk_bytes`.
fn store(
    disk: Arc<DiskTier>,
    (ram_contexts, disk_bytes): (u64, u64),
    policy: Policy,
) -> Arc<ContextStore> {
    let ram_bytes = ram_contexts * master_bytes();
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(ram_bytes * 2));
    let cfg = common::ram_disk_config((ram, disk), [ram_bytes, disk_bytes], "q8,q4", policy);
    ContextStore::new(cfg).unwrap()
}

fn disk(dir: &std::path::Path) -> Arc<DiskTier> {
    Arc::new(DiskTier::open(DiskTierConfig::new(dir, 1 << 30)).unwrap())
}

fn key(i: u8) -> ChunkKey {
    ChunkKey([i; 32])
}

/// Offers context `i` and waits until the worker has stored and placed it.
fn offer(s: &ContextStore, i: u8) {
    assert!(s.offer(key(i), kv(i as u32)));
    s.flush();
}

/// `i` is gone from the index and from the disk, is not served, and is not adopted again.
fn assert_dropped(s: &ContextStore, disk: &DiskTier, i: u8) {
    assert!(!s.contains(&key(i)), "context {i} is still indexed");
    assert!(
        !disk.contains(&copy_key(&key(i), 0)).unwrap(),
        "master {i} is on disk"
    );
    assert!(matches!(s.load(&key(i), None), Err(StoreError::NotStored)));
    assert_eq!(
        s.longest_stored(&[key(i)]),
        None,
        "context {i} was adopted again"
    );
}

#[test]
fn lru_drops_the_least_recently_used_context_past_the_last_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let d = disk(dir.path());
    let cap = master_bytes() * 3 + master_bytes() / 2;
    let s = store(d.clone(), (1, cap), Policy::Lru);
    for i in 0..3 {
        offer(&s, i);
    }
    assert_eq!((s.len(), s.stats().dropped), (3, 0));
    // Context 0 is used again, so context 1 is now the least recently used.
    s.load(&key(0), None).unwrap();
    offer(&s, 3);
    s.flush();
    assert_eq!((s.len(), s.stats().dropped), (3, 1));
    assert!(
        s.last_tier_bytes() <= cap,
        "{} > {cap}",
        s.last_tier_bytes()
    );
    assert_dropped(&s, &d, 1);
    for i in [0, 2, 3] {
        let (got, _) = s.load(&key(i), None).unwrap();
        assert_eq!(got.n_original_tokens, N_TOKENS, "context {i}");
    }
    // Offered again, the dropped context is stored again (and another one leaves).
    offer(&s, 1);
    s.flush();
    assert!(s.contains(&key(1)) && s.len() == 3 && s.stats().dropped == 2);
    assert!(s.last_tier_bytes() <= cap);
}

#[test]
fn evicpress_drops_the_context_whose_loss_of_utility_is_smallest() {
    let dir = tempfile::tempdir().unwrap();
    let d = disk(dir.path());
    let cap = master_bytes() * 3 + master_bytes() / 2;
    let policy = Policy::Evicpress {
        alpha: 1.0,
        ranking: Ranking::AbsoluteDrop,
    };
    // RAM holds every context uncompressed, so that the disk holds the masters alone and
    // every context has the same placement: only their frequencies differ.
    let s = store(d.clone(), (8, cap), policy);
    for i in 0..3 {
        offer(&s, i);
    }
    // Contexts 0 and 2 are asked for again and again; context 1 only once, when stored.
    for _ in 0..4 {
        for i in [0, 2] {
            s.load(&key(i), None).unwrap();
        }
    }
    s.flush();
    offer(&s, 3);
    s.flush();
    assert_eq!((s.len(), s.stats().dropped), (3, 1));
    assert_eq!(s.last_tier_bytes(), 3 * master_bytes());
    assert_dropped(&s, &d, 1);
}

#[test]
fn a_master_larger_than_the_last_tier_is_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    let d = disk(dir.path());
    let s = store(d.clone(), (1, master_bytes() / 2), Policy::Lru);
    offer(&s, 0);
    assert_eq!((s.len(), s.stats().skipped_too_large), (0, 1));
    assert!(!d.contains(&copy_key(&key(0), 0)).unwrap());
    assert_eq!(s.last_tier_bytes(), 0);
}

#[test]
fn an_unlimited_last_tier_drops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(disk(dir.path()), (1, u64::MAX), Policy::Lru);
    for i in 0..6 {
        offer(&s, i);
    }
    assert_eq!((s.len(), s.stats().dropped), (6, 0));
    assert_eq!(s.last_tier_bytes(), 6 * master_bytes());
}
