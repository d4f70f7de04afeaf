//! Measures each tier on 1 MiB payloads (the size of a 256-token chunk of a small model's
//! KV is in this range) and the disk tier's index rebuild time.
//!
//! `cargo run --release -p pk-tiers --example tier_bench -- [--redis redis://127.0.0.1:6391] [--dir PATH]`
//! Redis defaults to `$PAGEKEEPER_TEST_REDIS` and is skipped (with a note) when neither is given.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pk_tiers::{
    ChunkKey, DiskTier, DiskTierConfig, Payload, RamTier, RedisTier, RedisTierConfig, Tier,
};

const PAYLOAD_BYTES: usize = 1 << 20;
const ENTRIES: u64 = 256;

fn key(n: u64) -> ChunkKey {
    ChunkKey(*blake3::hash(&n.to_le_bytes()).as_bytes())
}

fn payload(n: u64) -> Payload {
    let mut bytes = vec![0u8; PAYLOAD_BYTES];
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(n ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
    }
    Arc::from(bytes)
}

fn mb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e6
}

fn report(label: &str, bytes: u64, elapsed: Duration) {
    println!(
        "{label:<44} {:>9.1} MB/s  ({:.1} ms total, {} entries)",
        mb_per_s(bytes, elapsed),
        elapsed.as_secs_f64() * 1e3,
        ENTRIES
    );
}

fn bench_ram(payloads: &[(ChunkKey, Payload)]) {
    let ram = RamTier::new(1 << 40);
    let total = ENTRIES * PAYLOAD_BYTES as u64;
    let t = Instant::now();
    for (k, p) in payloads {
        // Copy in, as a caller holding the KV elsewhere would.
        ram.store(k, &Payload::from(&p[..])).unwrap();
    }
    report("ram store (copy in)", total, t.elapsed());
    let t = Instant::now();
    let mut sink = vec![0u8; PAYLOAD_BYTES];
    for (k, _) in payloads {
        sink.copy_from_slice(&ram.load(k).unwrap().unwrap());
        std::hint::black_box(&mut sink);
    }
    report("ram load (copy out)", total, t.elapsed());
    let bw = ram.bandwidth();
    println!(
        "ram reported: read {:.0} MB/s (memcpy calibration), access latency {:.2} µs",
        bw.read_bytes_per_s.unwrap() / 1e6,
        bw.access_latency_s.unwrap_or(0.0) * 1e6
    );
}

fn bench_disk(dir: &std::path::Path, payloads: &[(ChunkKey, Payload)]) {
    let disk = DiskTier::open(DiskTierConfig::new(dir.join("bench"), 1 << 40)).unwrap();
    let total = ENTRIES * PAYLOAD_BYTES as u64;
    let t = Instant::now();
    for (k, p) in payloads {
        disk.store(k, p).unwrap();
    }
    report("disk store (fsync file + dir each)", total, t.elapsed());
    let t = Instant::now();
    for (k, _) in payloads {
        disk.load(k).unwrap().unwrap();
    }
    report("disk load (page cache warm)", total, t.elapsed());
    let cold = std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok();
    if cold {
        let t = Instant::now();
        for (k, _) in payloads {
            disk.load(k).unwrap().unwrap();
        }
        report("disk load (after drop_caches)", total, t.elapsed());
    } else {
        println!("disk load cold: skipped (cannot write /proc/sys/vm/drop_caches)");
    }
    let bw = disk.bandwidth();
    println!(
        "disk reported: read {:.0} MB/s, write {:.0} MB/s, access latency {:.1} µs",
        bw.read_bytes_per_s.unwrap_or(0.0) / 1e6,
        bw.write_bytes_per_s.unwrap_or(0.0) / 1e6,
        bw.access_latency_s.unwrap_or(0.0) * 1e6
    );

    // Index rebuild: 1,000 small entries (the scan reads headers only, so size barely matters).
    let scan_dir = dir.join("scan");
    {
        let mut config = DiskTierConfig::new(&scan_dir, 1 << 40);
        config.sync_writes = false;
        let disk = DiskTier::open(config).unwrap();
        let small: Payload = Arc::from(vec![7u8; 4096]);
        for n in 0..1000 {
            disk.store(&key(1_000_000 + n), &small).unwrap();
        }
    }
    for label in ["first reopen", "second reopen"] {
        let disk = DiskTier::open(DiskTierConfig::new(&scan_dir, 1 << 40)).unwrap();
        let scan = disk.scan_report();
        println!(
            "disk index rebuild ({label}): {} entries in {:.2} ms",
            scan.entries,
            scan.elapsed.as_secs_f64() * 1e3
        );
    }
    // The directory is locked while a tier holds it (disk.rs, NOTE 7): close before reopening.
    drop(disk);
    let disk = DiskTier::open(DiskTierConfig::new(dir.join("bench"), 1 << 40)).unwrap();
    let scan = disk.scan_report();
    println!(
        "disk index rebuild: {} entries of 1 MiB in {:.2} ms",
        scan.entries,
        scan.elapsed.as_secs_f64() * 1e3
    );
}

fn bench_redis(url: &str, payloads: &[(ChunkKey, Payload)], max_in_flight_bytes: u64) {
    println!(
        "redis with max_in_flight_bytes = {} MiB",
        max_in_flight_bytes >> 20
    );
    let mut config = RedisTierConfig::new(url);
    config.max_in_flight_bytes = max_in_flight_bytes;
    config.key_prefix = format!("pkbench:{}:", std::process::id());
    config.io_timeout = Duration::from_secs(5);
    let redis = RedisTier::open(config).unwrap();
    let total = ENTRIES * PAYLOAD_BYTES as u64;
    let t = Instant::now();
    redis.store_many(payloads).unwrap();
    report("redis store_many (pipelined)", total, t.elapsed());
    let keys: Vec<ChunkKey> = payloads.iter().map(|p| p.0).collect();
    let t = Instant::now();
    let loaded = redis.load_many(&keys).unwrap();
    report("redis load_many (pipelined)", total, t.elapsed());
    assert!(loaded.iter().all(Option::is_some));
    let t = Instant::now();
    for k in &keys {
        redis.load(k).unwrap().unwrap();
    }
    report("redis load one at a time", total, t.elapsed());
    let bw = redis.bandwidth();
    println!(
        "redis reported: read {:.0} MB/s, write {:.0} MB/s; stats {:?}",
        bw.read_bytes_per_s.unwrap_or(0.0) / 1e6,
        bw.write_bytes_per_s.unwrap_or(0.0) / 1e6,
        redis.stats()
    );
    for k in &keys {
        redis.delete(k).unwrap();
    }
}

/// Each tier's speed on 1 MiB payloads, and the disk tier's index rebuild time.
#[derive(Parser)]
#[command(name = "tier_bench")]
struct Args {
    /// The Redis server to measure; `$PAGEKEEPER_TEST_REDIS` without it, skipped without both.
    #[arg(long = "redis", value_name = "URL")]
    redis_url: Option<String>,
    /// The parent of the disk tier's temporary directory; the system's temporary one without it.
    #[arg(long, value_name = "PATH")]
    dir: Option<String>,
}

fn main() {
    let args = Args::parse();
    let redis_url = args
        .redis_url
        .or_else(|| std::env::var("PAGEKEEPER_TEST_REDIS").ok());
    let temp = tempfile::tempdir_in(
        args.dir
            .unwrap_or_else(|| std::env::temp_dir().display().to_string()),
    )
    .unwrap();

    let payloads: Vec<(ChunkKey, Payload)> = (0..ENTRIES).map(|n| (key(n), payload(n))).collect();
    println!("payload {} KiB × {ENTRIES}", PAYLOAD_BYTES >> 10);
    bench_ram(&payloads);
    bench_disk(temp.path(), &payloads);
    match redis_url {
        Some(url) => {
            for max_in_flight_mib in [1u64, 4, 16, 64] {
                bench_redis(&url, &payloads, max_in_flight_mib << 20);
            }
        }
        None => println!("redis: skipped (pass --redis URL or set PAGEKEEPER_TEST_REDIS)"),
    }
}
