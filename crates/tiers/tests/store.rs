//! TieredStore: contiguous prefix lookup across tiers, promotion, demotion cascade, failing
//! tiers as misses, and the full RAM → disk → Redis stack.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{key, payload, unique_prefix, RedisServer};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, RedisTier, RedisTierConfig, Tier, TieredStore};

#[test]
fn prefix_lookup_counts_contiguous_hits_across_tiers() {
    let ram = Arc::new(RamTier::new(1 << 20));
    let slow = Arc::new(RamTier::named("slow", 1 << 20));
    let store = TieredStore::new(vec![ram.clone(), slow.clone()]);
    ram.store(&key(0), &payload(0, 10)).unwrap();
    slow.store(&key(1), &payload(1, 10)).unwrap();
    ram.store(&key(2), &payload(2, 10)).unwrap();
    slow.store(&key(2), &payload(2, 10)).unwrap();
    // key 3 is nowhere; key 4 exists but after the gap it is useless.
    slow.store(&key(4), &payload(4, 10)).unwrap();
    let keys: Vec<_> = (0..5).map(key).collect();
    let found = store.lookup_prefix(&keys);
    assert_eq!(found.chunks_found, 3);
    assert_eq!(
        found.tier_of_chunk,
        vec![0, 1, 0],
        "the fastest tier holding each chunk"
    );
    assert_eq!(store.lookup_prefix(&keys[3..]).chunks_found, 0);
    assert_eq!(store.lookup_prefix(&[]).chunks_found, 0);
}

#[test]
fn a_slow_tier_hit_is_promoted() {
    let dir = tempfile::tempdir().unwrap();
    let ram = Arc::new(RamTier::new(1 << 20));
    let disk = Arc::new(DiskTier::open(DiskTierConfig::new(dir.path(), 1 << 20)).unwrap());
    let store = TieredStore::new(vec![ram.clone(), disk.clone()]);
    disk.store(&key(1), &payload(1, 1000)).unwrap();

    let first = store.load(&key(1)).unwrap();
    assert_eq!(
        (first.tier_index, &first.payload[..]),
        (1, &payload(1, 1000)[..])
    );
    assert!(ram.contains(&key(1)).unwrap(), "copied up");
    assert!(disk.contains(&key(1)).unwrap(), "a copy, not a move");
    assert_eq!(store.load(&key(1)).unwrap().tier_index, 0);
    assert!(store.load(&key(2)).is_none());

    let m = store.metrics();
    assert_eq!(
        (
            m[0].name.as_str(),
            m[0].hits,
            m[0].misses,
            m[0].promotions_in
        ),
        ("ram", 1, 2, 1)
    );
    assert_eq!(
        (m[1].name.as_str(), m[1].hits, m[1].misses, m[1].bytes_read),
        ("disk", 1, 1, 1000)
    );
    assert_eq!(m[0].bytes_written, 1000);
    assert_eq!(m[1].usage_bytes, 1064);
}

#[test]
fn victims_cascade_down_and_fall_off_the_last_tier() {
    let dir = tempfile::tempdir().unwrap();
    let ram = Arc::new(RamTier::new(2000));
    let disk = Arc::new(DiskTier::open(DiskTierConfig::new(dir.path(), 2 * 1064)).unwrap());
    let last = Arc::new(RamTier::named("remote", 1000));
    let store = TieredStore::new(vec![ram.clone(), disk.clone(), last.clone()]);
    let mut reports = Vec::new();
    for n in 1..=6 {
        reports.push(store.store(&key(n), &payload(n, 1000)));
    }
    assert_eq!(ram.keys_lru_first(), vec![key(5), key(6)]);
    assert_eq!(disk.keys_lru_first(), vec![key(3), key(4)]);
    assert_eq!(last.keys_lru_first(), vec![key(2)]);
    assert_eq!(
        reports
            .iter()
            .map(|r| (r.stored_in, r.demoted, r.dropped))
            .collect::<Vec<_>>(),
        vec![
            (Some(0), 0, 0),
            (Some(0), 0, 0),
            (Some(0), 1, 0), // 1 → disk
            (Some(0), 1, 0), // 2 → disk
            (Some(0), 2, 0), // 3 → disk, 1 → remote
            (Some(0), 2, 1), // 4 → disk, 2 → remote, 1 dropped
        ]
    );
    // Everything still stored is found, each chunk from its own tier.
    let found = store.lookup_prefix(&[key(5), key(3), key(2)]);
    assert_eq!(found.tier_of_chunk, vec![0, 1, 2]);
    // An entry too big for RAM goes straight to the next tier.
    let big = store.store(&key(7), &payload(7, 2050));
    assert_eq!((big.stored_in, big.errors), (Some(1), 0));
}

#[test]
fn an_unreachable_tier_is_a_fast_miss() {
    // Nothing listens on port 1.
    let mut config = RedisTierConfig::new("redis://127.0.0.1:1");
    config.key_prefix = unique_prefix("unreachable");
    let redis: Arc<dyn Tier> = Arc::new(RedisTier::open(config).unwrap());
    let ram = Arc::new(RamTier::new(1 << 20));
    let store = TieredStore::new(vec![ram.clone(), redis]);
    store.store(&key(1), &payload(1, 100));
    let started = Instant::now();
    assert_eq!(store.lookup_prefix(&[key(1), key(2)]).chunks_found, 1);
    assert!(store.load(&key(2)).is_none());
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    assert!(store.metrics()[1].errors >= 2);
}

#[test]
fn write_through_keeps_a_master_copy_in_the_last_tier() {
    let ram = Arc::new(RamTier::new(2000));
    let remote = Arc::new(RamTier::named("remote", 1 << 20));
    let store = TieredStore::new(vec![ram.clone(), remote.clone()]).with_write_through_last(true);
    for n in 1..=3 {
        store.store(&key(n), &payload(n, 1000));
    }
    assert_eq!(ram.keys_lru_first(), vec![key(2), key(3)]);
    assert_eq!(
        remote.keys_lru_first(),
        vec![key(1), key(2), key(3)],
        "written at store time, not demoted"
    );
    assert_eq!(store.metrics()[1].demotions_in, 0);
}

#[test]
fn full_stack_ram_disk_redis() {
    let server = RedisServer::shared_or_private();
    let dir = tempfile::tempdir().unwrap();
    let mut config = RedisTierConfig::new(&server.url);
    config.key_prefix = unique_prefix("full_stack");
    let redis = Arc::new(RedisTier::open(config).unwrap());
    let keys: Vec<_> = (0..4).map(key).collect();
    {
        // Small upper tiers: the first chunks are demoted all the way to Redis.
        let ram = Arc::new(RamTier::new(1 << 16));
        let disk =
            Arc::new(DiskTier::open(DiskTierConfig::new(dir.path(), (1 << 16) + 64)).unwrap());
        let store = TieredStore::new(vec![ram, disk, redis.clone()]);
        for (n, k) in keys.iter().enumerate() {
            store.store(k, &payload(n as u64, 1 << 16));
        }
        assert_eq!(store.lookup_prefix(&keys).tier_of_chunk, vec![2, 2, 1, 0]);
    }
    // "After a restart": fresh RAM (chunk 3 lived only there), the same disk directory and Redis.
    let ram = Arc::new(RamTier::new(1 << 20));
    let disk = Arc::new(DiskTier::open(DiskTierConfig::new(dir.path(), 1 << 20)).unwrap());
    let store = TieredStore::new(vec![ram.clone(), disk.clone(), redis.clone()]);
    assert_eq!(store.lookup_prefix(&keys).tier_of_chunk, vec![2, 2, 1]);
    let loaded = store.load_prefix(&keys);
    assert_eq!(
        loaded.iter().map(|l| l.tier_index).collect::<Vec<_>>(),
        vec![2, 2, 1]
    );
    for (n, l) in loaded.iter().enumerate() {
        assert_eq!(&l.payload[..], &payload(n as u64, 1 << 16)[..]);
    }
    assert_eq!(
        store.lookup_prefix(&keys).tier_of_chunk,
        vec![0, 0, 0],
        "all promoted to RAM"
    );
    assert!(disk.contains(&keys[0]).unwrap(), "and to disk on the way");

    // With write-through, a second server sharing Redis sees a new chunk at once.
    let writer = TieredStore::new(vec![Arc::new(RamTier::new(1 << 20)), redis.clone()])
        .with_write_through_last(true);
    writer.store(&key(10), &payload(10, 1000));
    let reader = TieredStore::new(vec![Arc::new(RamTier::new(1 << 20)), redis]);
    assert_eq!(reader.load(&key(10)).map(|l| l.tier_index), Some(1));
}

#[test]
fn a_tier_too_small_for_an_entry_counts_each_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let ram = Arc::new(RamTier::new(100));
    let disk = Arc::new(DiskTier::open(DiskTierConfig::new(dir.path(), 1 << 20)).unwrap());
    let store = TieredStore::new(vec![ram.clone(), disk.clone()]);
    for n in 0..3 {
        let report = store.store(&key(n), &payload(n, 1000));
        assert_eq!(report.stored_in, Some(1), "the entry moves on to the disk");
        assert_eq!(report.errors, 0, "a refusal as too large is not an error");
    }
    let metrics = store.metrics();
    assert_eq!(metrics[0].too_large, 3, "every refusal is counted");
    assert_eq!((metrics[0].usage_bytes, metrics[0].errors), (0, 0));
    assert_eq!(metrics[1].too_large, 0);

    // With no tier able to take it, the entry is dropped, and still counted.
    let alone = TieredStore::new(vec![Arc::new(RamTier::new(100)) as Arc<dyn Tier>]);
    let report = alone.store(&key(9), &payload(9, 1000));
    assert_eq!((report.stored_in, report.dropped), (None, 1));
    assert_eq!(alone.metrics()[0].too_large, 1);
}
