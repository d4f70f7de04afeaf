//! The local-disk tier: one file per chunk in a directory, under a byte capacity, LRU by
//! access time. The format is in `disk_format.rs`.
//!
//! NOTE 1 (durability): a write goes to `<key>.<pid>.<n>.tmp`, is fsynced, renamed to
//! `<key>.kv`, and the directory is fsynced. A crash leaves either no entry or a complete
//! one, plus perhaps a `.tmp` file that the next open deletes.
//! NOTE 2 (restart): the index is not persisted; `open` rebuilds it by reading each file's
//! 64-byte header (about 1,000 entries in a few milliseconds; see `DiskScanReport`). Recency
//! survives restarts as the file's mtime, which `load` refreshes.
//! NOTE 3 (corruption): a bad header or length is caught by the scan, a bad payload by the
//! checksum on load. Either way the file is deleted, `corrupt_entries` counts it, and the
//! caller sees a miss: corrupted bytes are never served.
//! NOTE 4 (safety): the tier deletes files it does not recognise, so it only ever opens a
//! directory it created (marked by a `PAGEKEEPER_TIER` file) or an empty one.
//! NOTE 5 (locking): the index mutex is never held across payload I/O; only renames and
//! index updates happen under it, so a victim is renamed away before its file is read, and a
//! concurrent store of the same key cannot lose its new file.
//! NOTE 6 (page cache): with `drop_page_cache` the tier asks the kernel to drop an entry's
//! pages (`posix_fadvise(POSIX_FADV_DONTNEED)`) after writing it (once synced: dirty pages
//! cannot be dropped) and after reading it, so that reads come from the device. Benchmarks
//! use it to measure cold reads, and EVICPRESS to model an SSD tier that DRAM cannot cover.
//! NOTE 7 (one owner): the index lives in one process's memory, so two tiers on one
//! directory would each fill it to capacity, evict each other's files, and delete each
//! other's in-progress `.tmp` files at open. `open` therefore takes an exclusive advisory
//! lock (`flock`) on the `PAGEKEEPER_TIER` marker, held for the tier's lifetime, before it
//! touches anything, and refuses the directory if another tier holds it. The kernel drops
//! the lock when the holder exits, however it exits, so a crash leaves nothing to clean up.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::disk_format::{Corruption, EntryHeader, HEADER_LEN};
use crate::lru::Lru;
use crate::tier::{BandwidthEstimate, BandwidthMeter, Evicted, Payload, Tier};
use crate::{ChunkKey, TierError};

const MARKER_FILE: &str = "PAGEKEEPER_TIER";
const MARKER_CONTENTS: &[u8] = b"pagekeeper disk tier, format 1\n";
const ENTRY_SUFFIX: &str = ".kv";
const TEMP_SUFFIX: &str = ".tmp";

#[derive(Clone, Debug)]
pub struct DiskTierConfig {
    pub dir: PathBuf,
    /// Counts whole files, headers included.
    pub capacity_bytes: u64,
    pub name: String,
    /// fsync each entry and the directory (default). Turning it off risks losing recent
    /// entries in a power cut, never serving bad bytes: checksums still catch torn files.
    pub sync_writes: bool,
    /// Drop each entry from the OS page cache after writing and after reading it (NOTE 6).
    /// Implies syncing each entry's data, since dirty pages cannot be dropped. Default false.
    pub drop_page_cache: bool,
}

impl DiskTierConfig {
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> DiskTierConfig {
        DiskTierConfig {
            dir: dir.into(),
            capacity_bytes,
            name: "disk".to_owned(),
            sync_writes: true,
            drop_page_cache: false,
        }
    }
}

/// What `open` found in the directory.
#[derive(Clone, Debug, Default)]
pub struct DiskScanReport {
    pub entries: usize,
    pub entry_bytes: u64,
    pub temp_files_removed: usize,
    pub corrupt_files_removed: usize,
    /// Entries dropped because the capacity shrank since the last run.
    pub over_capacity_removed: usize,
    pub elapsed: Duration,
}

pub struct DiskTier {
    name: String,
    dir: PathBuf,
    capacity_bytes: u64,
    index: Mutex<Lru<()>>,
    corrupt_entries: AtomicU64,
    temp_counter: AtomicU64,
    meter: BandwidthMeter,
    scan: DiskScanReport,
    sync_writes: bool,
    drop_page_cache: bool,
    /// The marker file, locked for as long as this tier exists (NOTE 7).
    _dir_lock: File,
}

impl DiskTier {
    pub fn open(config: DiskTierConfig) -> Result<DiskTier, TierError> {
        let started = Instant::now();
        let DiskTierConfig {
            dir,
            capacity_bytes,
            name,
            sync_writes,
            drop_page_cache,
        } = config;
        let io_err = |path: &Path, source| TierError::Io {
            tier: name.clone(),
            path: path.to_owned(),
            source,
        };
        fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        let dir_lock = claim_dir(&dir, &name)?;
        let mut tier = DiskTier {
            name: name.clone(),
            dir,
            capacity_bytes,
            index: Mutex::new(Lru::new()),
            corrupt_entries: AtomicU64::new(0),
            temp_counter: AtomicU64::new(0),
            meter: BandwidthMeter::default(),
            scan: DiskScanReport::default(),
            sync_writes,
            drop_page_cache,
            _dir_lock: dir_lock,
        };
        tier.scan = tier.rebuild_index().map_err(|e| io_err(&tier.dir, e))?;
        tier.scan.elapsed = started.elapsed();
        metrics::gauge!("pagekeeper:tier_entries_found_on_open", "tier" => tier.name.clone())
            .set(tier.scan.entries as f64);
        tracing::info!(tier = %tier.name, entries = tier.scan.entries, bytes = tier.scan.entry_bytes,
            corrupt = tier.scan.corrupt_files_removed, temp = tier.scan.temp_files_removed,
            elapsed_ms = tier.scan.elapsed.as_secs_f64() * 1e3, "disk tier index rebuilt");
        Ok(tier)
    }

    pub fn scan_report(&self) -> &DiskScanReport {
        &self.scan
    }

    /// Entries found corrupted (at open or on load) and deleted since this tier was opened.
    pub fn corrupt_entries(&self) -> u64 {
        self.corrupt_entries.load(Ordering::Relaxed)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds `key` (whether or not it exists).
    pub fn entry_path(&self, key: &ChunkKey) -> PathBuf {
        self.dir.join(format!("{key}{ENTRY_SUFFIX}"))
    }

    pub fn keys_lru_first(&self) -> Vec<ChunkKey> {
        self.index.lock().unwrap().keys_lru_first()
    }

    pub fn len(&self) -> usize {
        self.index.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn check_invariants(&self) {
        let index = self.index.lock().unwrap();
        index.check_invariants();
        assert!(index.usage_bytes() <= self.capacity_bytes);
    }

    fn rebuild_index(&self) -> io::Result<DiskScanReport> {
        let mut report = DiskScanReport::default();
        let mut found: Vec<(SystemTime, ChunkKey, u64)> = Vec::new();
        for dirent in fs::read_dir(&self.dir)? {
            let dirent = dirent?;
            let file_name = dirent.file_name();
            let file_name = file_name.to_string_lossy();
            if file_name == MARKER_FILE || !dirent.file_type()?.is_file() {
                continue;
            }
            let path = dirent.path();
            if file_name.ends_with(TEMP_SUFFIX) {
                // An interrupted write (or eviction): never renamed, so never an entry.
                remove_if_exists(&path)?;
                report.temp_files_removed += 1;
                continue;
            }
            match scan_entry(&path, &file_name, self.drop_page_cache) {
                Ok((key, file_len, mtime)) => found.push((mtime, key, file_len)),
                Err(why) => {
                    tracing::warn!(tier = %self.name, path = %path.display(), %why, "removing unusable file");
                    remove_if_exists(&path)?;
                    report.corrupt_files_removed += 1;
                }
            }
        }
        self.note_corrupt(report.corrupt_files_removed as u64);
        metrics::counter!("pagekeeper:tier_temp_files_removed_total", "tier" => self.name.clone())
            .increment(report.temp_files_removed as u64);
        // Oldest access first, so the rebuilt LRU order matches the one before the restart.
        found.sort();
        let mut index = self.index.lock().unwrap();
        for (_, key, file_len) in found {
            index.insert(key, file_len, ());
        }
        while index.usage_bytes() > self.capacity_bytes {
            let (key, _, ()) = index.pop_lru().unwrap();
            remove_if_exists(&self.entry_path(&key))?;
            report.over_capacity_removed += 1;
        }
        report.entries = index.len();
        report.entry_bytes = index.usage_bytes();
        drop(index);
        fsync_dir(&self.dir)?;
        Ok(report)
    }

    fn temp_path(&self, key: &ChunkKey) -> PathBuf {
        let n = self.temp_counter.fetch_add(1, Ordering::Relaxed);
        self.dir
            .join(format!("{key}.{}.{n}{TEMP_SUFFIX}", std::process::id()))
    }

    fn io_error(&self, path: &Path, source: io::Error) -> TierError {
        TierError::Io {
            tier: self.name.clone(),
            path: path.to_owned(),
            source,
        }
    }

    /// Reads and verifies one entry. `Ok(None)`: the file is gone. `Err(why)`: corrupt.
    fn read_verified(
        &self,
        path: &Path,
        key: &ChunkKey,
        touch: bool,
    ) -> io::Result<Result<Payload, Corruption>> {
        let mut file = OpenOptions::new().read(true).write(touch).open(path)?;
        let file_len = file.metadata()?.len();
        let mut header_bytes = [0u8; HEADER_LEN];
        if let Err(e) = file.read_exact(&mut header_bytes) {
            return if e.kind() == io::ErrorKind::UnexpectedEof {
                Ok(Err(Corruption::TruncatedHeader))
            } else {
                Err(e)
            };
        }
        let header = match EntryHeader::decode(&header_bytes) {
            Ok(h) => h,
            Err(why) => return Ok(Err(Corruption::BadHeader(why))),
        };
        if header.key != *key {
            return Ok(Err(Corruption::OtherKey));
        }
        if header.file_len() != file_len {
            return Ok(Err(Corruption::Length {
                file_bytes: file_len,
                header_bytes: header.file_len(),
            }));
        }
        // Read straight into the shared buffer: one allocation, no extra copy.
        let mut payload: Payload = Arc::from(vec![0u8; header.payload_len as usize]);
        file.read_exact(Arc::get_mut(&mut payload).unwrap())?;
        if self.drop_page_cache {
            drop_cached_pages(&file);
        }
        if crc32c::crc32c(&payload) != header.payload_crc32c {
            return Ok(Err(Corruption::Checksum));
        }
        if touch {
            // Recency that survives restarts (NOTE 2). Best effort: a failure costs LRU order only.
            let _ = file.set_modified(SystemTime::now());
        }
        Ok(Ok(payload))
    }

    /// Counts entries found corrupted, here and as a metric (label `tier`), so that a
    /// restarted server reports what its scan dropped.
    fn note_corrupt(&self, n: u64) {
        self.corrupt_entries.fetch_add(n, Ordering::Relaxed);
        metrics::counter!("pagekeeper:tier_corrupt_entries_total", "tier" => self.name.clone())
            .increment(n);
    }

    fn drop_corrupt(&self, key: &ChunkKey, path: &Path, why: &Corruption) {
        tracing::warn!(tier = %self.name, %key, %why, "corrupt entry deleted");
        self.index.lock().unwrap().remove(key);
        let _ = remove_if_exists(path);
        self.note_corrupt(1);
    }

    fn write_temp(&self, path: &Path, key: &ChunkKey, payload: &[u8]) -> io::Result<()> {
        let mut file = File::create(path)?;
        file.write_all(&EntryHeader::for_payload(*key, payload).encode())?;
        file.write_all(payload)?;
        // An exact mtime: the kernel's own is jiffy-coarse, which would tie the LRU order
        // rebuilt after a restart.
        file.set_modified(SystemTime::now())?;
        if self.sync_writes {
            file.sync_all()?;
        } else if self.drop_page_cache {
            file.sync_data()?;
        }
        if self.drop_page_cache {
            drop_cached_pages(&file);
        }
        Ok(())
    }

    /// Reads the payloads of entries already renamed away from their `.kv` names, then deletes
    /// them. Corrupt victims are counted and dropped (demoting bad bytes would serve them).
    fn collect_victims(&self, victims: Vec<(ChunkKey, PathBuf)>) -> Vec<Evicted> {
        let mut evicted = Vec::with_capacity(victims.len());
        for (key, path) in victims {
            match self.read_verified(&path, &key, false) {
                Ok(Ok(payload)) => evicted.push(Evicted { key, payload }),
                Ok(Err(why)) => {
                    tracing::warn!(tier = %self.name, %key, %why, "corrupt victim dropped");
                    self.note_corrupt(1);
                }
                Err(e) => tracing::warn!(tier = %self.name, %key, error = %e, "victim unreadable"),
            }
            let _ = remove_if_exists(&path);
        }
        evicted
    }
}

impl Tier for DiskTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn store(&self, key: &ChunkKey, payload: &Payload) -> Result<Vec<Evicted>, TierError> {
        let started = Instant::now();
        let file_len = (HEADER_LEN + payload.len()) as u64;
        if file_len > self.capacity_bytes {
            return Err(TierError::TooLarge {
                tier: self.name.clone(),
                size_bytes: file_len,
                limit_bytes: self.capacity_bytes,
            });
        }
        if self.index.lock().unwrap().touch(key).is_some() {
            // Recency must survive a restart (NOTE 2) as a load's does. Best effort: a failure
            // costs LRU order only.
            if let Ok(file) = OpenOptions::new().write(true).open(self.entry_path(key)) {
                let _ = file.set_modified(SystemTime::now());
            }
            return Ok(Vec::new());
        }
        let temp = self.temp_path(key);
        if let Err(e) = self.write_temp(&temp, key, payload) {
            let _ = remove_if_exists(&temp);
            return Err(self.io_error(&temp, e));
        }
        let final_path = self.entry_path(key);
        let mut victims = Vec::new();
        {
            let mut index = self.index.lock().unwrap();
            if index.touch(key).is_some() {
                // Another thread stored the same key meanwhile; its file is as good as ours.
                drop(index);
                let _ = remove_if_exists(&temp);
                return Ok(Vec::new());
            }
            while index.usage_bytes() + file_len > self.capacity_bytes {
                let (victim, _, ()) = index.pop_lru().expect("usage > 0 means an entry exists");
                let parked = self.temp_path(&victim);
                match fs::rename(self.entry_path(&victim), &parked) {
                    Ok(()) => victims.push((victim, parked)),
                    Err(e) => {
                        tracing::warn!(tier = %self.name, key = %victim, error = %e, "victim file missing")
                    }
                }
            }
            if let Err(e) = fs::rename(&temp, &final_path) {
                drop(index);
                let _ = remove_if_exists(&temp);
                let evicted = self.collect_victims(victims);
                tracing::warn!(tier = %self.name, lost = evicted.len(), "store failed after evicting");
                return Err(self.io_error(&final_path, e));
            }
            index.insert(*key, file_len, ());
        }
        if self.sync_writes {
            fsync_dir(&self.dir).map_err(|e| self.io_error(&self.dir, e))?;
        }
        self.meter.record_write(file_len, started.elapsed());
        Ok(self.collect_victims(victims))
    }

    fn load(&self, key: &ChunkKey) -> Result<Option<Payload>, TierError> {
        let started = Instant::now();
        if !self.index.lock().unwrap().contains(key) {
            self.meter.record_access(started.elapsed());
            return Ok(None);
        }
        let path = self.entry_path(key);
        match self.read_verified(&path, key, true) {
            Ok(Ok(payload)) => {
                self.index.lock().unwrap().touch(key);
                self.meter
                    .record_read(payload.len() as u64, started.elapsed());
                Ok(Some(payload))
            }
            Ok(Err(why)) => {
                self.drop_corrupt(key, &path, &why);
                Ok(None)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Evicted between the index check and the open: an ordinary miss. If the
                // index still lists it, someone deleted the file behind our back.
                if self.index.lock().unwrap().remove(key).is_some() {
                    self.note_corrupt(1);
                }
                Ok(None)
            }
            Err(e) => Err(self.io_error(&path, e)),
        }
    }

    fn contains(&self, key: &ChunkKey) -> Result<bool, TierError> {
        Ok(self.index.lock().unwrap().contains(key))
    }

    fn delete(&self, key: &ChunkKey) -> Result<bool, TierError> {
        let mut index = self.index.lock().unwrap();
        if index.remove(key).is_none() {
            return Ok(false);
        }
        let path = self.entry_path(key);
        // Under the lock, so a concurrent store of the same key cannot be deleted by mistake.
        remove_if_exists(&path).map_err(|e| self.io_error(&path, e))?;
        Ok(true)
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn usage_bytes(&self) -> u64 {
        self.index.lock().unwrap().usage_bytes()
    }

    fn bandwidth(&self) -> BandwidthEstimate {
        self.meter.estimate()
    }
}

/// Validates a `<hex>.kv` file from its name, header and length only.
fn scan_entry(
    path: &Path,
    file_name: &str,
    drop_page_cache: bool,
) -> Result<(ChunkKey, u64, SystemTime), Corruption> {
    let key = file_name
        .strip_suffix(ENTRY_SUFFIX)
        .and_then(ChunkKey::from_hex)
        .ok_or(Corruption::NotAnEntry)?;
    let mut file = File::open(path)?;
    let meta = file.metadata()?;
    let mut header_bytes = [0u8; HEADER_LEN];
    file.read_exact(&mut header_bytes)
        .map_err(|_| Corruption::TruncatedHeader)?;
    if drop_page_cache {
        // Readahead may have pulled in much of the payload along with the header.
        drop_cached_pages(&file);
    }
    let header = EntryHeader::decode(&header_bytes).map_err(Corruption::BadHeader)?;
    if header.key != key {
        return Err(Corruption::OtherKey);
    }
    if header.file_len() != meta.len() {
        return Err(Corruption::Length {
            file_bytes: meta.len(),
            header_bytes: header.file_len(),
        });
    }
    Ok((
        key,
        meta.len(),
        meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
    ))
}

/// Refuses a non-empty directory that this tier did not create (NOTE 4), and one that another
/// tier holds (NOTE 7). Returns the locked marker file.
fn claim_dir(dir: &Path, tier: &str) -> Result<File, TierError> {
    let io_err = |path: &Path, source| TierError::Io {
        tier: tier.to_owned(),
        path: path.to_owned(),
        source,
    };
    let marker = dir.join(MARKER_FILE);
    if marker.exists() {
        return lock_dir(dir, &marker, tier);
    }
    let non_empty = fs::read_dir(dir)
        .map_err(|e| io_err(dir, e))?
        .next()
        .is_some();
    if non_empty {
        return Err(TierError::Invalid {
            tier: tier.to_owned(),
            reason: format!(
                "{} is not empty and has no {MARKER_FILE} file; refusing to use it, because the disk tier deletes files it does not recognise",
                dir.display()
            ),
        });
    }
    fs::write(&marker, MARKER_CONTENTS).map_err(|e| io_err(&marker, e))?;
    fsync_dir(dir).map_err(|e| io_err(dir, e))?;
    lock_dir(dir, &marker, tier)
}

/// Takes the exclusive lock on `marker` without waiting (NOTE 7).
fn lock_dir(dir: &Path, marker: &Path, tier: &str) -> Result<File, TierError> {
    let io_err = |source| TierError::Io {
        tier: tier.to_owned(),
        path: marker.to_owned(),
        source,
    };
    let file = File::open(marker).map_err(io_err)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(TierError::Invalid {
            tier: tier.to_owned(),
            reason: format!(
                "{} is in use by another disk tier (its {MARKER_FILE} file is locked, by this or another process); two tiers on one directory would evict each other's files, so give each its own directory",
                dir.display()
            ),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io_err(e)),
    }
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Asks the kernel to evict `file`'s clean pages from the page cache (NOTE 6). Advice only:
/// a failure (or a filesystem that ignores it) costs benchmark accuracy, never correctness.
fn drop_cached_pages(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is open for the duration of the call; offset 0 and length 0
        // mean the whole file.
        #[allow(unsafe_code)]
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            tracing::debug!(rc, "posix_fadvise(DONTNEED) failed");
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// Makes renames and unlinks in `dir` durable.
fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}
