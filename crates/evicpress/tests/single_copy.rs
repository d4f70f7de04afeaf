//! `ContextStore` with one copy per context (`Copies::PlacedOnly`, the EVICPRESS paper's
//! store), on a real RAM tier and disk directory whose capacities together hold less than
//! the working set: no master is written, what does not fit is dropped (and remembered),
//! compression lets more contexts stay, a compressed copy cannot be re-encoded, and an
//! unreadable copy is a miss, never served.

mod common;

use std::sync::Arc;

use pk_codec::KvContext;
use pk_evicpress::{copy_key, ContextStore, Copies, Policy, Ranking, StoreError};
use pk_tiers::{ChunkKey, DiskTier, DiskTierConfig, Payload, RamTier, Tier};

const N_TOKENS: usize = 256;

fn kv(seed: u32) -> KvContext {
    common::kv(seed, N_TOKENS)
}

/// The bytes of one uncompressed context, as the store accounts them.
fn full_bytes() -> u64 {
    pk_codec::compressed_bytes_estimate(&pk_codec::Method::None, &kv(0).shape()) as u64
}

struct Fixture {
    store: Arc<ContextStore>,
    ram: Arc<RamTier>,
    disk: Arc<DiskTier>,
    _dir: tempfile::TempDir,
}

/// RAM and disk holding `(ram, disk)` uncompressed contexts, one copy per context.
fn fixture(contexts: (u64, u64), grid: &str, policy: Policy) -> Fixture {
    fixture_with_ram(contexts, grid, policy, 1 << 30)
}

/// As [`fixture`], with a RAM tier that refuses payloads over `ram_physical_bytes`.
fn fixture_with_ram(
    contexts: (u64, u64),
    grid: &str,
    policy: Policy,
    ram_physical_bytes: u64,
) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let ram = Arc::new(RamTier::new(ram_physical_bytes));
    let disk = Arc::new(DiskTier::open(DiskTierConfig::new(dir.path(), 1 << 30)).unwrap());
    let caps = [contexts.0 * full_bytes(), contexts.1 * full_bytes()];
    let tiers: (Arc<dyn Tier>, Arc<dyn Tier>) = (ram.clone(), disk.clone());
    let mut cfg = common::ram_disk_config(tiers, caps, grid, policy);
    cfg.copies = Copies::PlacedOnly;
    Fixture {
        store: ContextStore::new(cfg).unwrap(),
        ram,
        disk,
        _dir: dir,
    }
}

fn key(i: u8) -> ChunkKey {
    ChunkKey([i; 32])
}

/// Every stored copy of context `i` on both tiers, by configuration index.
fn copies_of(f: &Fixture, i: u8, n_configs: usize) -> Vec<(usize, usize)> {
    let mut at = Vec::new();
    for c in 0..n_configs {
        if f.ram.contains(&copy_key(&key(i), c)).unwrap() {
            at.push((0, c));
        }
        if f.disk.contains(&copy_key(&key(i), c)).unwrap() {
            at.push((1, c));
        }
    }
    at
}

#[test]
fn lru_keeps_one_copy_and_drops_what_the_tiers_cannot_hold() {
    let f = fixture((1, 2), "q8,q4", Policy::Lru);
    for i in 0..4u8 {
        assert!(f.store.offer(key(i), kv(i as u32)));
        f.store.flush();
    }
    // The newest in RAM, the next two on disk, the oldest dropped: no master anywhere.
    assert_eq!(f.store.placement_of(&key(3)), Some((0, 0)));
    assert_eq!(f.store.placement_of(&key(2)), Some((1, 0)));
    assert_eq!(f.store.placement_of(&key(1)), Some((1, 0)));
    assert_eq!(copies_of(&f, 3, 3), vec![(0, 0)]);
    assert_eq!(copies_of(&f, 2, 3), vec![(1, 0)]);
    assert!(!f.store.contains(&key(0)));
    assert!(copies_of(&f, 0, 3).is_empty());
    assert!(matches!(
        f.store.load(&key(0), None),
        Err(StoreError::NotStored)
    ));
    assert_eq!(f.store.stats().dropped, 1);
    assert_eq!(f.store.ghost_count(), 1);
    assert!(f.store.usage_bytes()[1] <= 2 * full_bytes());
    assert_eq!(f.store.last_tier_bytes(), 2 * full_bytes());
    // Nothing is adopted from the last tier (its copies are not masters).
    assert_eq!(f.store.longest_stored(&[key(0)]), None);
    let (got, report) = f.store.load(&key(1), None).unwrap();
    assert_eq!((got.n_tokens(), report.tier.as_str()), (N_TOKENS, "disk"));
}

#[test]
fn evicpress_compresses_to_keep_more_contexts_and_a_compressed_copy_stays_compressed() {
    let policy = Policy::Evicpress {
        alpha: 1.0,
        ranking: Ranking::AbsoluteDrop,
    };
    // Tiers for two uncompressed contexts; q4 (a quarter of the bytes) costs little quality.
    let f = fixture((1, 1), "q8,q4", policy);
    for i in 0..6u8 {
        f.store
            .preset_profile(&key(i), vec![1.0, 0.995, 0.99])
            .unwrap();
        assert!(f.store.offer(key(i), kv(i as u32)));
        f.store.flush();
    }
    let stored: Vec<u8> = (0..6).filter(|&i| f.store.contains(&key(i))).collect();
    assert!(stored.len() > 2, "only {stored:?} stored");
    for &i in &stored {
        let (tier, config) = f.store.placement_of(&key(i)).unwrap();
        assert_eq!(copies_of(&f, i, 3), vec![(tier, config)], "context {i}");
        if config != 0 {
            assert!(matches!(
                f.store.load_master(&key(i)),
                Err(StoreError::NoFullKv)
            ));
        }
    }
    let compressed = stored
        .iter()
        .find(|&&i| f.store.placement_of(&key(i)).unwrap().1 != 0)
        .copied()
        .expect("some context compressed");
    // A hit re-places it on the fastest tier, in the configuration it has.
    let before = f.store.placement_of(&key(compressed)).unwrap().1;
    f.store.load(&key(compressed), None).unwrap();
    f.store.flush();
    if let Some((_, after)) = f.store.placement_of(&key(compressed)) {
        assert_eq!(after, before);
    }
    assert!(f.store.usage_bytes()[0] <= full_bytes());
    assert!(f.store.usage_bytes()[1] <= full_bytes());
}

#[test]
fn a_dropped_context_comes_back_with_its_profile_frequency_and_scores() {
    let n = N_TOKENS;
    let kvzip: Vec<f32> = (0..n).map(|t| if t % 3 == 0 { 0.9 } else { 0.1 }).collect();
    let f = fixture((1, 1), "q8,kvzip-0.6", Policy::Lru);
    let profile = vec![1.0, 0.97, 0.6];
    f.store.preset_profile(&key(0), profile.clone()).unwrap();
    assert!(f
        .store
        .offer_with_scores(key(0), kv(0), None, Some(kvzip.clone())));
    f.store.flush();
    for i in 1..3u8 {
        assert!(f.store.offer(key(i), kv(i as u32)));
        f.store.flush();
    }
    assert!(!f.store.contains(&key(0)));
    assert!(f.store.knows_kvzip_scores(&key(0)));
    // Recomputed and offered again without scores: they, and the profile, come back.
    assert!(f.store.offer(key(0), kv(0)));
    f.store.flush();
    assert!(f.store.contains(&key(0)));
    assert_eq!(f.store.kvzip_scores_of(&key(0)).unwrap(), kvzip);
    assert!(f.store.is_available(&key(0), 2));
    let row = f
        .store
        .explain()
        .into_iter()
        .find(|r| r.key == key(0).to_hex())
        .unwrap();
    assert_eq!(row.quality_source, pk_evicpress::QualitySource::Profiled);
    assert!(row.frequency > 1.5, "frequency {}", row.frequency);
    // A wrong-length profile is refused by name.
    assert!(matches!(
        f.store.preset_profile(&key(9), vec![1.0]),
        Err(StoreError::ProfileLength { got: 1, grid: 3 })
    ));
}

#[test]
fn an_unreadable_only_copy_is_a_miss_and_is_forgotten() {
    let f = fixture((2, 2), "q8", Policy::Lru);
    assert!(f.store.offer(key(7), kv(7)));
    f.store.flush();
    assert_eq!(f.store.placement_of(&key(7)), Some((0, 0)));
    let copy = copy_key(&key(7), 0);
    let mut bytes = f.ram.load(&copy).unwrap().unwrap().to_vec();
    bytes[100] ^= 0xFF;
    f.ram.delete(&copy).unwrap();
    f.ram.store(&copy, &Payload::from(bytes)).unwrap();
    assert!(matches!(
        f.store.load(&key(7), None),
        Err(StoreError::OnlyCopyUnreadable(_))
    ));
    assert!(!f.store.contains(&key(7)));
    assert!(copies_of(&f, 7, 2).is_empty());
    assert_eq!(f.store.stats().unreadable_dropped, 1);
    // Its next offer (the recompute's KV) is stored again.
    assert!(f.store.offer(key(7), kv(7)));
    f.store.flush();
    assert_eq!(f.store.placement_of(&key(7)), Some((0, 0)));
}

/// Every indexed context has exactly its placed copy on the tiers; every other has none.
fn assert_one_copy_each(f: &Fixture, n_contexts: u8, n_configs: usize) {
    for i in 0..n_contexts {
        let want: Vec<(usize, usize)> = f.store.placement_of(&key(i)).into_iter().collect();
        assert_eq!(copies_of(f, i, n_configs), want, "context {i}");
    }
}

#[test]
fn copies_and_index_agree_through_offers_hits_and_drops() {
    let policies = [
        Policy::Lru,
        Policy::Fixed(2),
        Policy::Evicpress {
            alpha: 1.0,
            ranking: Ranking::AbsoluteDrop,
        },
        Policy::Evicpress {
            alpha: 4.0,
            ranking: Ranking::AbsoluteDrop,
        },
    ];
    for policy in policies {
        let f = fixture((1, 1), "q8,q4", policy.clone());
        let mut x = 12345u32;
        for step in 0..120 {
            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
            let i = ((x >> 16) % 8) as u8;
            if step % 3 == 0 {
                let q = 0.9 + (i as f32) / 100.0;
                let _ = f.store.preset_profile(&key(i), vec![1.0, q, q - 0.05]);
            }
            if f.store.contains(&key(i)) {
                f.store.load(&key(i), None).unwrap();
            } else {
                assert!(f.store.offer(key(i), kv(i as u32)));
            }
            f.store.flush();
            assert_one_copy_each(&f, 8, 3);
        }
    }
}

#[test]
fn an_arrival_whose_copy_cannot_be_written_is_not_stored() {
    // Placement puts the arrival in RAM, whose tier refuses a payload that large.
    let f = fixture_with_ram((2, 2), "q8", Policy::Lru, 1024);
    assert!(f.store.offer(key(4), kv(4)));
    f.store.flush();
    assert!(!f.store.contains(&key(4)));
    assert!(copies_of(&f, 4, 2).is_empty());
    assert!(matches!(
        f.store.load(&key(4), None),
        Err(StoreError::NotStored)
    ));
}
