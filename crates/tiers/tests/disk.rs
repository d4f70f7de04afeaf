//! Disk tier against real files with fsync: round trip, restart, corruption, capacity/LRU,
//! crash leftovers, and the index rebuild time.

mod common;

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use common::{key, payload};
use pk_tiers::{DiskTier, DiskTierConfig, Tier, TierError};

const HEADER_BYTES: u64 = 64;

fn open(dir: &Path, capacity_bytes: u64) -> DiskTier {
    DiskTier::open(DiskTierConfig::new(dir, capacity_bytes)).unwrap()
}

#[test]
fn round_trip_contains_delete() {
    let dir = tempfile::tempdir().unwrap();
    let disk = open(dir.path(), 1 << 20);
    assert_eq!(disk.load(&key(1)).unwrap(), None);
    disk.store(&key(1), &payload(1, 5000)).unwrap();
    assert_eq!(
        disk.load(&key(1)).unwrap().as_deref(),
        Some(&payload(1, 5000)[..])
    );
    assert!(disk.contains(&key(1)).unwrap());
    assert_eq!(disk.usage_bytes(), 5000 + HEADER_BYTES);
    assert_eq!(
        fs::metadata(disk.entry_path(&key(1))).unwrap().len(),
        5000 + HEADER_BYTES
    );
    assert!(disk.delete(&key(1)).unwrap());
    assert!(!disk.delete(&key(1)).unwrap());
    assert!(!disk.entry_path(&key(1)).exists());
    assert_eq!(disk.usage_bytes(), 0);
    // An empty payload is a valid entry.
    disk.store(&key(2), &payload(2, 0)).unwrap();
    assert_eq!(disk.load(&key(2)).unwrap().as_deref(), Some(&[][..]));
    disk.check_invariants();
}

#[test]
fn restart_rebuilds_the_index_and_keeps_lru_order() {
    let dir = tempfile::tempdir().unwrap();
    let order_before;
    {
        let disk = open(dir.path(), 1 << 20);
        for n in 1..=4 {
            disk.store(&key(n), &payload(n, 1000 * n as usize)).unwrap();
        }
        disk.load(&key(2)).unwrap().unwrap();
        order_before = disk.keys_lru_first();
        assert_eq!(order_before, vec![key(1), key(3), key(4), key(2)]);
    }
    let disk = open(dir.path(), 1 << 20);
    let scan = disk.scan_report();
    assert_eq!(
        (
            scan.entries,
            scan.corrupt_files_removed,
            scan.temp_files_removed
        ),
        (4, 0, 0)
    );
    assert_eq!(
        disk.keys_lru_first(),
        order_before,
        "recency survives the restart (mtime)"
    );
    assert_eq!(disk.usage_bytes(), 10_000 + 4 * HEADER_BYTES);
    for n in 1..=4 {
        assert_eq!(
            disk.load(&key(n)).unwrap().as_deref(),
            Some(&payload(n, 1000 * n as usize)[..])
        );
    }
    // A smaller capacity on restart evicts the least recently used entries.
    drop(disk);
    let disk = open(dir.path(), 8000);
    assert_eq!(disk.scan_report().over_capacity_removed, 2);
    assert_eq!(disk.keys_lru_first(), vec![key(3), key(4)]);
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        3,
        "two entries and the marker"
    );
}

#[test]
fn corrupted_entries_are_detected_deleted_counted_and_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let disk = open(dir.path(), 1 << 20);
    for n in 1..=3 {
        disk.store(&key(n), &payload(n, 4000)).unwrap();
    }
    // 1: one flipped payload byte: the length is right, the checksum is not.
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(disk.entry_path(&key(1)))
        .unwrap();
    f.seek(SeekFrom::Start(HEADER_BYTES + 1234)).unwrap();
    f.write_all(&[payload(1, 4000)[1234] ^ 0x40]).unwrap();
    drop(f);
    // 2: truncated mid-payload.
    OpenOptions::new()
        .write(true)
        .open(disk.entry_path(&key(2)))
        .unwrap()
        .set_len(HEADER_BYTES + 100)
        .unwrap();

    assert!(disk.contains(&key(1)).unwrap(), "not yet known to be bad");
    assert_eq!(disk.load(&key(1)).unwrap(), None);
    assert_eq!(disk.load(&key(2)).unwrap(), None);
    assert_eq!(disk.corrupt_entries(), 2);
    assert!(!disk.contains(&key(1)).unwrap() && !disk.contains(&key(2)).unwrap());
    assert!(!disk.entry_path(&key(1)).exists() && !disk.entry_path(&key(2)).exists());
    assert_eq!(disk.usage_bytes(), 4000 + HEADER_BYTES);
    assert_eq!(
        disk.load(&key(3)).unwrap().as_deref(),
        Some(&payload(3, 4000)[..])
    );

    // At open: a truncated entry, a garbage file with an entry name, and a stray file.
    OpenOptions::new()
        .write(true)
        .open(disk.entry_path(&key(3)))
        .unwrap()
        .set_len(10)
        .unwrap();
    drop(disk);
    fs::write(
        dir.path().join(format!("{}.kv", key(9))),
        b"definitely not an entry",
    )
    .unwrap();
    fs::write(dir.path().join("notes.txt"), b"garbage").unwrap();
    let disk = open(dir.path(), 1 << 20);
    assert_eq!(disk.scan_report().corrupt_files_removed, 3);
    assert_eq!(disk.corrupt_entries(), 3);
    assert_eq!(disk.scan_report().entries, 0);
    assert_eq!(disk.load(&key(3)).unwrap(), None);
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        1,
        "only the marker is left"
    );
}

#[test]
fn a_file_renamed_onto_another_key_is_not_served() {
    let dir = tempfile::tempdir().unwrap();
    let disk = open(dir.path(), 1 << 20);
    disk.store(&key(1), &payload(1, 100)).unwrap();
    disk.store(&key(2), &payload(2, 100)).unwrap();
    fs::copy(disk.entry_path(&key(1)), disk.entry_path(&key(2))).unwrap();
    assert_eq!(disk.load(&key(2)).unwrap(), None, "the header names key 1");
    assert_eq!(disk.corrupt_entries(), 1);
}

#[test]
fn capacity_and_lru_eviction() {
    let dir = tempfile::tempdir().unwrap();
    let entry_bytes = 1000 + HEADER_BYTES;
    let disk = open(dir.path(), 3 * entry_bytes);
    for n in 1..=3 {
        assert!(disk.store(&key(n), &payload(n, 1000)).unwrap().is_empty());
    }
    disk.load(&key(1)).unwrap().unwrap();
    let evicted = disk.store(&key(4), &payload(4, 1000)).unwrap();
    assert_eq!(
        evicted.iter().map(|e| e.key).collect::<Vec<_>>(),
        vec![key(2)]
    );
    assert_eq!(
        &evicted[0].payload[..],
        &payload(2, 1000)[..],
        "victim bytes come back for demotion"
    );
    assert!(!disk.entry_path(&key(2)).exists());
    assert_eq!(disk.keys_lru_first(), vec![key(3), key(1), key(4)]);
    assert_eq!(disk.usage_bytes(), 3 * entry_bytes);

    let err = disk
        .store(&key(5), &payload(5, 3 * 1000 + 200))
        .unwrap_err();
    assert!(matches!(err, TierError::TooLarge { .. }), "{err}");
    assert_eq!(disk.len(), 3, "a refused entry evicts nothing");
    disk.check_invariants();
}

#[test]
fn temp_files_from_interrupted_writes_are_cleaned_on_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let disk = open(dir.path(), 1 << 20);
        disk.store(&key(1), &payload(1, 100)).unwrap();
    }
    // A write killed before fsync (partial) and one killed between fsync and rename (complete).
    fs::write(
        dir.path().join(format!("{}.4242.0.tmp", key(2))),
        &payload(2, 10)[..],
    )
    .unwrap();
    let complete = fs::read(dir.path().join(format!("{}.kv", key(1)))).unwrap();
    fs::write(dir.path().join(format!("{}.4242.1.tmp", key(1))), complete).unwrap();

    let disk = open(dir.path(), 1 << 20);
    let scan = disk.scan_report();
    assert_eq!(
        (
            scan.temp_files_removed,
            scan.entries,
            scan.corrupt_files_removed
        ),
        (2, 1, 0)
    );
    assert!(!disk.contains(&key(2)).unwrap());
    assert_eq!(
        disk.load(&key(1)).unwrap().as_deref(),
        Some(&payload(1, 100)[..])
    );
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn refuses_a_foreign_non_empty_directory() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("precious.doc"), b"user data").unwrap();
    let err = DiskTier::open(DiskTierConfig::new(dir.path(), 1 << 20))
        .err()
        .expect("must refuse");
    assert!(err.to_string().contains("refusing"), "{err}");
    assert!(dir.path().join("precious.doc").exists());
}

#[test]
fn index_rebuild_of_1000_entries_is_fast() {
    let dir = tempfile::tempdir().unwrap();
    {
        // Populated without fsync to keep the test short; the scan reads the same files.
        let mut config = DiskTierConfig::new(dir.path(), 1 << 30);
        config.sync_writes = false;
        let disk = DiskTier::open(config).unwrap();
        for n in 0..1000 {
            disk.store(&key(n), &payload(n, 4096)).unwrap();
        }
    }
    let disk = open(dir.path(), 1 << 30);
    let scan = disk.scan_report();
    assert_eq!(scan.entries, 1000);
    eprintln!(
        "disk tier: index rebuild scanned {} entries in {:.2} ms",
        scan.entries,
        scan.elapsed.as_secs_f64() * 1e3
    );
    assert!(scan.elapsed.as_secs_f64() < 5.0, "{:?}", scan.elapsed);
    assert_eq!(
        disk.load(&key(999)).unwrap().as_deref(),
        Some(&payload(999, 4096)[..])
    );
}

#[test]
fn a_second_tier_on_a_live_directory_is_refused_and_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let first = open(dir.path(), 1 << 20);
    first.store(&key(1), &payload(1, 100)).unwrap();
    // The first tier's write in progress: a second opener must not delete it.
    let in_progress = dir.path().join(format!("{}.4242.0.tmp", key(2)));
    fs::write(&in_progress, &payload(2, 10)[..]).unwrap();

    let err = DiskTier::open(DiskTierConfig::new(dir.path(), 1 << 20))
        .err()
        .expect("a second tier on a live directory must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains("in use by another disk tier")
            && msg.contains(&dir.path().display().to_string()),
        "{msg}"
    );
    assert!(in_progress.exists(), "the live tier's temp file survives");
    assert!(first.contains(&key(1)).unwrap());

    // The lock goes with the tier: once it is dropped the directory opens again.
    drop(first);
    let second = open(dir.path(), 1 << 20);
    assert_eq!(
        second.load(&key(1)).unwrap().as_deref(),
        Some(&payload(1, 100)[..])
    );
}
