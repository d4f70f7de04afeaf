//! Redis tier against a real `redis-server` (see `common/mod.rs` for which one): pipelined
//! round trips, exact shared LRU, bytes in flight, corruption, and outages (killed server,
//! paused server) followed by automatic reconnection.

mod common;

use std::time::{Duration, Instant};

use common::{key, payload, unique_prefix, RedisServer};
use pk_tiers::{RedisTier, RedisTierConfig, Tier, TierError};

fn tier(server: &RedisServer, test: &str, edit: impl FnOnce(&mut RedisTierConfig)) -> RedisTier {
    let mut config = RedisTierConfig::new(&server.url);
    config.key_prefix = unique_prefix(test);
    edit(&mut config);
    RedisTier::open(config).unwrap()
}

#[test]
fn pipelined_round_trip() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "round_trip", |_| {});
    let entries: Vec<_> = (0..20)
        .map(|n| (key(n), payload(n, 1000 + 10_000 * n as usize)))
        .collect();
    redis.store_many(&entries).unwrap();
    assert_eq!(redis.stats().pipelines_sent, 1, "20 entries, one pipeline");

    let mut keys: Vec<_> = entries.iter().map(|e| e.0).collect();
    keys.push(key(999));
    let loaded = redis.load_many(&keys).unwrap();
    assert_eq!(
        redis.stats().pipelines_sent,
        2,
        "one payload pipeline (plus one metadata round trip)"
    );
    for (n, got) in loaded.iter().take(20).enumerate() {
        assert_eq!(got.as_deref(), Some(&entries[n].1[..]), "entry {n}");
    }
    assert_eq!(loaded[20], None);
    let total: u64 = entries.iter().map(|e| e.1.len() as u64).sum();
    assert_eq!(redis.usage_bytes(), total);
    assert_eq!(redis.refresh_usage_bytes().unwrap(), total);
    assert!(
        redis.bandwidth().read_bytes_per_s.is_some()
            && redis.bandwidth().write_bytes_per_s.is_some()
    );
}

#[test]
fn contains_delete_and_idempotent_store() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "contains_delete", |_| {});
    redis.store(&key(1), &payload(1, 300)).unwrap();
    redis.store(&key(1), &payload(1, 300)).unwrap();
    assert_eq!(
        redis.usage_bytes(),
        300,
        "a second store of a key is not counted twice"
    );
    assert_eq!(
        redis.contains_many(&[key(1), key(2)]).unwrap(),
        vec![true, false]
    );
    assert!(redis.delete(&key(1)).unwrap());
    assert!(!redis.delete(&key(1)).unwrap());
    assert!(!redis.contains(&key(1)).unwrap());
    assert_eq!(redis.load(&key(1)).unwrap(), None);
    assert_eq!(redis.usage_bytes(), 0);
}

#[test]
fn capacity_is_enforced_with_exact_shared_lru() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "lru", |c| c.capacity_bytes = 3000);
    for n in 1..=3 {
        redis.store(&key(n), &payload(n, 1000)).unwrap();
    }
    redis.load(&key(1)).unwrap().unwrap();
    redis.store(&key(4), &payload(4, 1000)).unwrap();
    let present = redis
        .contains_many(&[key(1), key(2), key(3), key(4)])
        .unwrap();
    assert_eq!(
        present,
        vec![true, false, true, true],
        "key 2 was least recently used"
    );
    assert_eq!(redis.usage_bytes(), 3000);

    // A second client on the same prefix (another server) shares the order and the budget.
    let other = RedisTier::open(redis.config().clone()).unwrap();
    other.load(&key(3)).unwrap().unwrap();
    redis.store(&key(5), &payload(5, 2000)).unwrap();
    let present = redis
        .contains_many(&[key(1), key(3), key(4), key(5)])
        .unwrap();
    assert_eq!(present, vec![false, true, false, true]);
    assert!(matches!(
        redis.store(&key(6), &payload(6, 3001)),
        Err(TierError::TooLarge { .. })
    ));
}

#[test]
fn bytes_in_flight_are_bounded() {
    let server = RedisServer::shared_or_private();
    let limit_bytes = 600 << 10;
    let redis = tier(&server, "in_flight", |c| {
        c.max_in_flight_bytes = limit_bytes
    });
    let entries: Vec<_> = (0..10).map(|n| (key(n), payload(n, 256 << 10))).collect();
    redis.store_many(&entries).unwrap();
    let stats = redis.stats();
    assert_eq!(
        stats.pipelines_sent, 5,
        "two 256 KiB entries per 600 KiB pipeline"
    );
    assert_eq!(stats.max_pipeline_payload_bytes, 512 << 10);

    let keys: Vec<_> = entries.iter().map(|e| e.0).collect();
    let loaded = redis.load_many(&keys).unwrap();
    assert!(loaded
        .iter()
        .zip(&entries)
        .all(|(got, e)| got.as_deref() == Some(&e.1[..])));
    assert_eq!(redis.stats().pipelines_sent, 10);
    assert!(redis.stats().max_pipeline_payload_bytes <= limit_bytes);

    // An entry larger than the bound travels alone (refusing it would make large chunks
    // unstorable); only the capacity refuses entries.
    let big = payload(99, (limit_bytes + 1) as usize);
    redis.store(&key(99), &big).unwrap();
    assert_eq!(redis.stats().pipelines_sent, 11);
    assert_eq!(redis.stats().max_pipeline_payload_bytes, limit_bytes + 1);
    assert_eq!(redis.load(&key(99)).unwrap().as_deref(), Some(&big[..]));
    let small = tier(&server, "in_flight_capacity", |c| c.capacity_bytes = 1000);
    let err = small.store(&key(100), &payload(100, 1001)).unwrap_err();
    assert!(matches!(err, TierError::TooLarge { .. }), "{err}");
}

#[test]
fn corrupt_or_uncommitted_entries_are_misses() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "corrupt", |_| {});
    let prefix = redis.config().key_prefix.clone();
    let mut raw = server.raw();
    redis.store(&key(1), &payload(1, 5000)).unwrap();
    redis.store(&key(2), &payload(2, 5000)).unwrap();
    // Same length, one byte different: only the checksum can tell.
    let mut bad = payload(1, 5000).to_vec();
    bad[17] ^= 1;
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}d:{}", key(1)))
        .arg(bad)
        .query(&mut raw)
        .unwrap();
    // Payload lost behind our back (e.g. Redis maxmemory eviction).
    let _: () = redis::cmd("DEL")
        .arg(format!("{prefix}d:{}", key(2)))
        .query(&mut raw)
        .unwrap();
    // A payload whose writer died before the metadata: invisible.
    let _: () = redis::cmd("SET")
        .arg(format!("{prefix}d:{}", key(3)))
        .arg(&payload(3, 10)[..])
        .query(&mut raw)
        .unwrap();

    assert_eq!(
        redis.load_many(&[key(1), key(2), key(3)]).unwrap(),
        vec![None, None, None]
    );
    assert_eq!(redis.stats().corrupt_entries, 2);
    assert_eq!(
        redis.contains_many(&[key(1), key(2), key(3)]).unwrap(),
        vec![false, false, false]
    );
    assert_eq!(
        redis.usage_bytes(),
        0,
        "dropped entries leave the accounting"
    );
}

#[test]
fn killed_server_gives_fast_errors_then_reconnects_by_itself() {
    let mut server = RedisServer::private();
    let redis = tier(&server, "restart", |c| {
        c.reconnect_backoff = Duration::from_millis(200)
    });
    redis.store(&key(1), &payload(1, 1000)).unwrap();
    server.stop();

    let started = Instant::now();
    assert!(redis.load(&key(1)).is_err(), "the dead connection fails");
    assert!(
        redis.store(&key(2), &payload(2, 1000)).is_err(),
        "the reconnect fails"
    );
    let err = redis.contains(&key(1)).unwrap_err();
    assert!(
        matches!(err, TierError::Unavailable { .. }),
        "backoff answers at once: {err}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "errors must be fast: {:?}",
        started.elapsed()
    );

    server.start();
    std::thread::sleep(Duration::from_millis(250));
    // The restarted server kept nothing (no persistence): a clean miss, then normal service.
    assert_eq!(redis.load(&key(1)).unwrap(), None);
    redis.store(&key(3), &payload(3, 1000)).unwrap();
    assert_eq!(
        redis.load(&key(3)).unwrap().as_deref(),
        Some(&payload(3, 1000)[..])
    );
    let stats = redis.stats();
    assert_eq!(stats.connects, 2);
    assert!(stats.connect_failures >= 1);
}

#[test]
fn stalled_server_times_out_quickly() {
    let server = RedisServer::private();
    let redis = tier(&server, "stall", |c| {
        c.io_timeout = Duration::from_millis(200);
        c.reconnect_backoff = Duration::from_millis(50);
    });
    redis.store(&key(1), &payload(1, 1000)).unwrap();
    let mut raw = server.raw();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("ALL")
        .query(&mut raw)
        .unwrap();

    let started = Instant::now();
    assert!(redis.load(&key(1)).is_err());
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_millis(700),
        "bounded by the io timeout: {waited:?}"
    );

    let _: () = redis::cmd("CLIENT").arg("UNPAUSE").query(&mut raw).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        redis.load(&key(1)).unwrap().as_deref(),
        Some(&payload(1, 1000)[..])
    );
}
