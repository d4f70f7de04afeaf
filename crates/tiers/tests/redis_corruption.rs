//! Redis tier against a real `redis-server` (see `common/mod.rs` for which one), with its
//! keys damaged behind its back: corrupt control keys, metadata that lies about sizes, and
//! payloads larger than their metadata says. Usage must always equal the bytes the scripts
//! accounted for, and nothing may become visible without being accounted.

mod common;

use common::{key, payload, unique_prefix, RedisServer};
use pk_tiers::{ChunkKey, RedisTier, RedisTierConfig, Tier, TierError};

fn tier(server: &RedisServer, test: &str, edit: impl FnOnce(&mut RedisTierConfig)) -> RedisTier {
    let mut config = RedisTierConfig::new(&server.url);
    config.key_prefix = unique_prefix(test);
    edit(&mut config);
    RedisTier::open(config).unwrap()
}

/// Runs one command on a raw connection, behind the tier's back.
fn raw_cmd<T: redis::FromRedisValue>(raw: &mut redis::Connection, args: &[&str]) -> T {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query(raw).unwrap()
}

fn entry_key(redis: &RedisTier, kind: &str, k: &ChunkKey) -> String {
    format!("{}{kind}:{k}", redis.config().key_prefix)
}

/// The shard's usage counter as stored in Redis, and the number of entries in its LRU.
fn usage_and_lru_len(redis: &RedisTier, raw: &mut redis::Connection) -> (u64, u64) {
    let prefix = &redis.config().key_prefix;
    let usage: String = raw_cmd(raw, &["GET", &format!("{prefix}usage")]);
    let lru_len: u64 = raw_cmd(raw, &["ZCARD", &format!("{prefix}lru")]);
    (usage.parse().unwrap(), lru_len)
}

#[test]
fn corrupt_usage_and_clock_are_rebuilt_and_new_entries_stay_accounted() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "corrupt_usage", |c| c.capacity_bytes = 3000);
    let prefix = redis.config().key_prefix.clone();
    let mut raw = server.raw();
    redis.store(&key(1), &payload(1, 1000)).unwrap();
    redis.store(&key(2), &payload(2, 1000)).unwrap();
    let _: () = raw_cmd(&mut raw, &["SET", &format!("{prefix}usage"), "garbage"]);
    let _: () = raw_cmd(&mut raw, &["SET", &format!("{prefix}clock"), "not-a-clock"]);

    redis.store(&key(3), &payload(3, 1000)).unwrap();
    assert_eq!(
        redis.stats().control_key_repairs,
        1,
        "one script repaired both"
    );
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (3000, 3));
    assert_eq!(redis.usage_bytes(), 3000);
    let ttl: i64 = raw_cmd(&mut raw, &["TTL", &entry_key(&redis, "d", &key(3))]);
    assert_eq!(ttl, -1, "the committed payload is persistent");

    // The capacity still holds: the fourth entry evicts the least recently used one.
    redis.store(&key(4), &payload(4, 1000)).unwrap();
    assert_eq!(
        redis
            .contains_many(&[key(1), key(2), key(3), key(4)])
            .unwrap(),
        vec![false, true, true, true]
    );
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (3000, 3));
}

#[test]
fn a_corrupt_lru_refuses_writes_naming_the_key_until_it_is_deleted() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "corrupt_lru", |_| {});
    let lru_key = format!("{}lru", redis.config().key_prefix);
    let mut raw = server.raw();
    redis.store(&key(1), &payload(1, 1000)).unwrap();
    let _: () = raw_cmd(&mut raw, &["DEL", &lru_key]);
    let _: () = raw_cmd(&mut raw, &["SET", &lru_key, "oops"]);

    match redis.store(&key(2), &payload(2, 1000)) {
        Err(TierError::CorruptKey { key, reason, .. }) => {
            assert_eq!(key, lru_key);
            assert!(reason.contains("not a sorted set"), "{reason}");
        }
        other => panic!("expected CorruptKey, got {other:?}"),
    }
    assert!(
        !redis.contains(&key(2)).unwrap(),
        "nothing unaccounted is visible"
    );
    assert_eq!(
        redis.load(&key(1)).unwrap().as_deref(),
        Some(&payload(1, 1000)[..]),
        "reads go on"
    );

    // The operator deletes the key; the next write rebuilds the LRU from the recorded sizes.
    let _: () = raw_cmd(&mut raw, &["DEL", &lru_key]);
    redis.store(&key(3), &payload(3, 1000)).unwrap();
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (2000, 2));
    assert_eq!(redis.stats().control_key_repairs, 1);
    assert_eq!(
        redis.contains_many(&[key(1), key(2), key(3)]).unwrap(),
        vec![true, false, true]
    );
}

#[test]
fn a_prefix_written_without_recorded_sizes_is_migrated_from_its_metadata() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "migrate_sizes", |_| {});
    let mut raw = server.raw();
    redis.store(&key(1), &payload(1, 1000)).unwrap();
    redis.store(&key(2), &payload(2, 2000)).unwrap();
    // What an earlier version left: the same keys, without the sizes hash.
    let sizes_key = format!("{}sizes", redis.config().key_prefix);
    let _: () = raw_cmd(&mut raw, &["DEL", &sizes_key]);

    redis.store(&key(3), &payload(3, 500)).unwrap();
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (3500, 3));
    assert!(redis.delete(&key(2)).unwrap());
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (1500, 2));
}

#[test]
fn metadata_cannot_move_usage() {
    let server = RedisServer::shared_or_private();
    let redis = tier(&server, "lying_meta", |_| {});
    let mut raw = server.raw();
    for n in 1..=3 {
        redis.store(&key(n), &payload(n, 1000)).unwrap();
    }

    // A size far larger than what was accounted: deleting must subtract only 1000.
    let _: () = raw_cmd(
        &mut raw,
        &["SET", &entry_key(&redis, "m", &key(1)), "v1 99999999999 1"],
    );
    assert!(redis.delete(&key(1)).unwrap());
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (2000, 2));

    // Metadata that does not parse: the entry is corrupt, dropped at its accounted size.
    let _: () = raw_cmd(
        &mut raw,
        &["SET", &entry_key(&redis, "m", &key(2)), "v1 notanumber"],
    );
    assert_eq!(redis.load(&key(2)).unwrap(), None);
    assert_eq!(redis.stats().corrupt_entries, 1);
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (1000, 1));

    // Garbage metadata left where a new entry goes is replaced, and the entry accounted.
    let _: () = raw_cmd(
        &mut raw,
        &["SET", &entry_key(&redis, "m", &key(4)), "v1 notanumber"],
    );
    redis.store(&key(4), &payload(4, 1000)).unwrap();
    assert_eq!(
        redis.load(&key(4)).unwrap().as_deref(),
        Some(&payload(4, 1000)[..])
    );
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (2000, 2));
    assert_eq!(redis.usage_bytes(), 2000);
}

/// `total_net_output_bytes` from `INFO stats`: what the server has sent to all clients.
fn net_output_bytes(raw: &mut redis::Connection) -> u64 {
    let info: String = raw_cmd(raw, &["INFO", "stats"]);
    info.lines()
        .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
        .expect("INFO stats has total_net_output_bytes")
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn reads_stop_at_the_length_in_the_metadata() {
    // Private: the byte count below is the whole server's, so no other test may share it.
    let server = RedisServer::private();
    let redis = tier(&server, "oversized_payload", |c| {
        c.max_in_flight_bytes = 64 << 10
    });
    let mut raw = server.raw();
    redis.store(&key(1), &payload(1, 1000)).unwrap();
    redis.store(&key(2), &payload(2, 1000)).unwrap();
    // Same first 1000 bytes, then 8 MiB more: the checksum alone would accept the prefix.
    let mut big = payload(1, 1000).to_vec();
    big.resize(8 << 20, 7);
    let _: () = redis::cmd("SET")
        .arg(entry_key(&redis, "d", &key(1)))
        .arg(big)
        .query(&mut raw)
        .unwrap();

    let sent_before = net_output_bytes(&mut raw);
    assert_eq!(
        redis.load_many(&[key(1), key(2)]).unwrap(),
        vec![None, Some(payload(2, 1000))]
    );
    let sent_bytes = net_output_bytes(&mut raw) - sent_before;
    assert!(
        sent_bytes < 64 << 10,
        "the read must stop at the 1000 bytes the metadata says, not the 8 MiB stored: {sent_bytes} bytes sent"
    );
    assert_eq!(redis.stats().corrupt_entries, 1);
    assert_eq!(usage_and_lru_len(&redis, &mut raw), (1000, 1));
}

/// Metadata is read only as far as the longest valid one: an 8 MiB value written over it is
/// a corrupt entry found for a few bytes, not a read of 8 MiB.
#[test]
fn metadata_reads_stop_at_the_longest_valid_metadata() {
    let server = RedisServer::private();
    let redis = tier(&server, "oversized_meta", |_| {});
    let mut raw = server.raw();
    redis.store(&key(1), &payload(1, 1000)).unwrap();
    redis.store(&key(2), &payload(2, 1000)).unwrap();
    let _: () = redis::cmd("SET")
        .arg(entry_key(&redis, "m", &key(1)))
        .arg(vec![b'1'; 8 << 20])
        .query(&mut raw)
        .unwrap();

    let sent_before = net_output_bytes(&mut raw);
    assert_eq!(
        redis.load_many(&[key(1), key(2), key(3)]).unwrap(),
        vec![None, Some(payload(2, 1000)), None]
    );
    let sent_bytes = net_output_bytes(&mut raw) - sent_before;
    assert!(
        sent_bytes < 64 << 10,
        "{sent_bytes} bytes sent for three metadata reads"
    );
    assert_eq!(redis.stats().corrupt_entries, 1);
}
