//! `ContextStore` on real tiers (RAM, disk directory) with synthetic KV: placement keeps
//! the RAM capacity, loads return what was stored (through the codec), and a corrupted
//! placed copy is detected and served from the master instead.

mod common;

use std::sync::Arc;

use common::kv;
use pk_evicpress::{copy_key, ContextStore, Policy, Ranking};
use pk_tiers::{ChunkKey, DiskTier, DiskTierConfig, Payload, RamTier, Tier};

fn store(
    ram: Arc<dyn Tier>,
    dir: &std::path::Path,
    ram_bytes: u64,
    policy: Policy,
) -> Arc<ContextStore> {
    store_with_grid(ram, dir, ram_bytes, policy, "q8,q4,knorm-0.5")
}

fn store_with_grid(
    ram: Arc<dyn Tier>,
    dir: &std::path::Path,
    ram_bytes: u64,
    policy: Policy,
    grid: &str,
) -> Arc<ContextStore> {
    let disk: Arc<dyn Tier> = Arc::new(DiskTier::open(DiskTierConfig::new(dir, 1 << 30)).unwrap());
    let cfg = common::ram_disk_config((ram, disk), [ram_bytes, u64::MAX], grid, policy);
    ContextStore::new(cfg).unwrap()
}

#[test]
fn placement_respects_ram_and_loads_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let full_bytes =
        pk_codec::compressed_bytes_estimate(&pk_codec::Method::None, &kv(0, 256).shape()) as u64;
    let ram_bytes = full_bytes * 2;
    let s = store(
        Arc::new(RamTier::new(ram_bytes * 4)),
        dir.path(),
        ram_bytes,
        Policy::Evicpress {
            alpha: 1.0,
            ranking: Ranking::AbsoluteDrop,
        },
    );
    for i in 0..6u8 {
        assert!(s.offer(ChunkKey([i; 32]), kv(i as u32, 256)));
    }
    s.flush();
    assert_eq!(s.len(), 6);
    assert!(s.usage_bytes()[0] <= ram_bytes, "{:?}", s.usage_bytes());
    // With a disk a thousand times slower, RAM is used, compressed to fit more contexts.
    let in_ram = s.explain().iter().filter(|r| r.tier == "ram").count();
    assert!(in_ram > 2, "{in_ram} contexts in RAM");
    for i in 0..6u8 {
        let (got, report) = s.load(&ChunkKey([i; 32]), Some(&[1, 2, 3])).unwrap();
        assert_eq!(got.n_original_tokens, 256);
        if report.config == "none-0" {
            let want = kv(i as u32, 256);
            let max_err = got
                .k
                .iter()
                .zip(&want.k)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(max_err < 1e-3, "f16 round trip error {max_err}");
        }
    }
    s.flush();
    assert!(s.stats().placement_decisions >= 12);
}

#[test]
fn a_corrupted_copy_falls_back_to_the_master() {
    let dir = tempfile::tempdir().unwrap();
    let ram = Arc::new(RamTier::new(1 << 30));
    let s = store(ram.clone(), dir.path(), 1 << 29, Policy::Lru);
    let key = ChunkKey([9; 32]);
    s.offer(key, kv(9, 128));
    s.flush();
    assert_eq!(s.placement_of(&key), Some((0, 0)));
    // Flip the placed copy's bytes in RAM: its checksum no longer matches.
    let copy = copy_key(&key, 0);
    let mut bytes = ram.load(&copy).unwrap().unwrap().to_vec();
    bytes[100] ^= 0xFF;
    ram.delete(&copy).unwrap();
    ram.store(&copy, &Payload::from(bytes)).unwrap();
    let (got, report) = s.load(&key, None).unwrap();
    assert!(report.fell_back_to_master && report.tier == "disk");
    assert_eq!(got.n_tokens(), 128);
    assert_eq!(s.stats().fallbacks_to_master, 1);
}

#[test]
fn served_quality_drift_asks_for_a_reprofile() {
    let dir = tempfile::tempdir().unwrap();
    let s = store(
        Arc::new(RamTier::new(1 << 30)),
        dir.path(),
        1 << 29,
        Policy::Lru,
    );
    let key = ChunkKey([5; 32]);
    s.offer(key, kv(5, 64));
    s.flush();
    s.load(&key, Some(&[7, 8])).unwrap();
    assert_eq!(
        s.profiling_candidates(4).len(),
        1,
        "never profiled, with a query seen"
    );
    s.set_profile(&key, vec![1.0, 0.9, 0.8, 0.5]).unwrap();
    assert!(s.profiling_candidates(4).is_empty());
    s.record_served_quality(&key, 0.5);
    assert_eq!(s.stats().reprofiles_requested, 1);
    assert_eq!(s.profiling_candidates(4).len(), 1);
    s.set_profile(&key, vec![1.0, 0.9, 0.8, 0.5]).unwrap();
    // A profile ages out after enough hits, to be redone with the queries served since.
    for _ in 0..pk_evicpress::store::REFRESH_PROFILE_AFTER_HITS {
        assert!(s.profiling_candidates(4).is_empty());
        s.load(&key, Some(&[9])).unwrap();
    }
    assert_eq!(s.profiling_candidates(4).len(), 1);
}

#[test]
fn a_restart_adopts_the_profile_and_frequency_saved_beside_the_master() {
    let dir = tempfile::tempdir().unwrap();
    let key = ChunkKey([21; 32]);
    let profile = vec![1.0, 0.93, 0.71, 0.42];
    {
        let s = store(
            Arc::new(RamTier::new(1 << 30)),
            dir.path(),
            1 << 29,
            Policy::Evicpress {
                alpha: 1.0,
                ranking: Ranking::AbsoluteDrop,
            },
        );
        s.offer(key, kv(21, 128));
        s.flush();
        s.set_profile(&key, profile.clone()).unwrap();
        for q in 0..3u32 {
            s.load(&key, Some(&[q, q + 1])).unwrap();
        }
        s.flush();
        // Hits are saved with the next profile (or every 16 hits): a second profile.
        s.set_profile(&key, profile.clone()).unwrap();
        s.flush();
        assert!(s.stats().meta_saved >= 2);
    }
    // A new process on the same disk: the master is adopted with what was learnt.
    let s = store(
        Arc::new(RamTier::new(1 << 30)),
        dir.path(),
        1 << 29,
        Policy::Evicpress {
            alpha: 1.0,
            ranking: Ranking::AbsoluteDrop,
        },
    );
    assert_eq!(s.longest_stored(&[key]), Some(0));
    s.flush();
    assert_eq!(s.stats().meta_restored, 1);
    let row = s.explain().into_iter().find(|r| r.n_tokens == 128).unwrap();
    assert_eq!(row.quality_source, pk_evicpress::QualitySource::Profiled);
    assert_eq!(row.hits, 3);
    // Three accesses and the insert, barely decayed, plus the adoption itself.
    assert!(
        row.frequency > 4.0 && row.frequency <= 5.0,
        "{}",
        row.frequency
    );
    let q8 = row
        .options
        .iter()
        .find(|o| o.config.starts_with("q8"))
        .unwrap();
    assert_eq!(q8.quality, 0.93);
    assert_eq!(
        s.profiling_candidates(1).len(),
        0,
        "a restored profile needs no new one"
    );

    // A store with another grid does not trust the entry: the context starts over. (One
    // disk tier per directory: the first store goes first.)
    drop(s);
    let other = store_with_grid(
        Arc::new(RamTier::new(1 << 30)),
        dir.path(),
        1 << 29,
        Policy::Lru,
        "q8,q2",
    );
    assert_eq!(other.longest_stored(&[key]), Some(0));
    other.flush();
    assert_eq!(other.stats().meta_restored, 0);
    assert_eq!(
        other.explain()[0].quality_source,
        pk_evicpress::QualitySource::Prior
    );
}

#[test]
fn snapkv_configurations_need_the_scores_offered_with_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let n = 128;
    // A ranking no KV-only score would give: keep the even tokens.
    let scores: Vec<f32> = (0..n).map(|t| if t % 2 == 0 { 1.0 } else { 0.0 }).collect();
    let (with, without) = (ChunkKey([31; 32]), ChunkKey([32; 32]));
    {
        let s = store_with_grid(
            Arc::new(RamTier::new(1 << 30)),
            dir.path(),
            1 << 29,
            Policy::Evicpress {
                alpha: 1.0,
                ranking: Ranking::AbsoluteDrop,
            },
            "q8,snapkv-0.4",
        );
        assert!(s.offer_with_snapkv(with, kv(31, n), Some(scores.clone())));
        // Scores of the wrong length are as good as none.
        assert!(s.offer_with_snapkv(without, kv(32, n), Some(vec![1.0; n - 1])));
        s.flush();
        assert!(s.is_available(&with, 2) && !s.is_available(&without, 2));
        assert!(
            s.is_available(&without, 1),
            "other configurations stay available"
        );

        // Dropping 40 % by these scores keeps the protected ends and the best-scored middle.
        let full = s.load_master(&with).unwrap();
        let dropped = s.compress(&with, &full, 2).unwrap();
        let kept = &dropped.positions;
        assert_eq!(
            kept.len(),
            pk_codec::drop::n_kept_tokens(n, &pk_codec::DropSpec::new(0.4))
        );
        let middle: Vec<u32> = kept
            .iter()
            .copied()
            .filter(|&p| (16..n as u32 - 16).contains(&p))
            .collect();
        assert!(
            middle.iter().all(|p| p % 2 == 0),
            "kept an odd (low-scored) token: {middle:?}"
        );
        assert!(
            s.compress(&without, &full, 2).is_err(),
            "no scores, no SnapKV copy"
        );

        // Placement never picks an unavailable configuration, even when told it is lossless.
        s.set_profile(&without, vec![1.0, 0.5, 1.0]).unwrap();
        s.set_profile(&with, vec![1.0, 0.5, 1.0]).unwrap();
        s.flush();
        let row = |k: &ChunkKey| {
            s.explain()
                .into_iter()
                .find(|r| r.key == k.to_hex())
                .unwrap()
        };
        let snap = |r: &pk_evicpress::ContextReport| {
            r.options
                .iter()
                .find(|o| o.config.starts_with("snapkv"))
                .unwrap()
                .quality
        };
        assert_eq!(snap(&row(&without)), f32::NEG_INFINITY);
        assert_eq!(snap(&row(&with)), 1.0);
        assert!(!row(&without).config.starts_with("snapkv"));
    }
    // After a restart the scores come back with the meta entry saved beside the master.
    let s = store_with_grid(
        Arc::new(RamTier::new(1 << 30)),
        dir.path(),
        1 << 29,
        Policy::Lru,
        "q8,snapkv-0.4",
    );
    assert_eq!(s.longest_stored(&[with]), Some(0));
    assert_eq!(s.longest_stored(&[without]), Some(0));
    s.flush();
    assert!(s.is_available(&with, 2));
    assert!(!s.is_available(&without, 2));
    let full = s.load_master(&with).unwrap();
    let middle: Vec<u32> = s
        .compress(&with, &full, 2)
        .unwrap()
        .positions
        .into_iter()
        .filter(|&p| (16..n as u32 - 16).contains(&p))
        .collect();
    assert!(middle.iter().all(|p| p % 2 == 0));
}

#[test]
fn the_worker_computes_snapkv_scores_from_the_window_queries() {
    let dir = tempfile::tempdir().unwrap();
    let s = store_with_grid(
        Arc::new(RamTier::new(1 << 30)),
        dir.path(),
        1 << 29,
        Policy::Lru,
        "q8,snapkv-0.5",
    );
    assert!(s.wants_snapkv());
    let (n, c) = (96, kv(41, 96));
    // Queries of the last 8 tokens, 4 query heads (a GQA group of 2 per KV head).
    let n_heads = 4;
    let data: Vec<f32> = (0..2 * 8 * n_heads * 16)
        .map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0)
        .collect();
    let window = pk_evicpress::WindowQueries {
        n_heads,
        positions: (n - 8..n).collect(),
        data,
    };
    let want = pk_evicpress::snapkv_scores(&c, &window).unwrap();
    let key = ChunkKey([41; 32]);
    assert!(s.offer_with_window(key, c.clone(), window));
    s.flush();
    assert!(s.is_available(&key, 2));
    // The copy drops exactly what dropping by those scores drops.
    let got = s.compress(&key, &c, 2).unwrap();
    let want_kept = pk_codec::drop::select_kept_tokens(&want, &pk_codec::DropSpec::new(0.5));
    assert_eq!(
        got.positions,
        want_kept.iter().map(|&t| t as u32).collect::<Vec<_>>()
    );
    // A grid without SnapKV ignores the queries.
    let plain = store_with_grid(
        Arc::new(RamTier::new(1 << 30)),
        tempfile::tempdir().unwrap().path(),
        1 << 29,
        Policy::Lru,
        "q8",
    );
    assert!(!plain.wants_snapkv());
}

#[test]
fn kvzip_configurations_drop_by_the_scores_the_engine_supplied() {
    let dir = tempfile::tempdir().unwrap();
    let n = 128;
    // KVzip's ranking: keep every third token. SnapKV's (in the same grid): the even ones.
    let kvzip: Vec<f32> = (0..n).map(|t| if t % 3 == 0 { 0.9 } else { 0.1 }).collect();
    let snapkv: Vec<f32> = (0..n).map(|t| if t % 2 == 0 { 1.0 } else { 0.0 }).collect();
    let (with, without) = (ChunkKey([51; 32]), ChunkKey([52; 32]));
    let grid = "q8,snapkv-0.5,kvzip-0.6";
    let middle_of = |s: &pk_evicpress::ContextStore, key: &ChunkKey, config: usize| {
        let full = s.load_master(key).unwrap();
        let kept = s.compress(key, &full, config).unwrap().positions;
        assert_eq!(
            kept.len(),
            pk_codec::drop::n_kept_tokens(n, &pk_codec::DropSpec::new(0.6))
        );
        kept.into_iter()
            .filter(|&p| (16..n as u32 - 16).contains(&p))
            .collect::<Vec<u32>>()
    };
    {
        let s = store_with_grid(
            Arc::new(RamTier::new(1 << 30)),
            dir.path(),
            1 << 29,
            Policy::Lru,
            grid,
        );
        assert!(s.wants_kvzip() && s.wants_snapkv());
        assert!(s.offer_with_scores(with, kv(51, n), Some(snapkv), Some(kvzip.clone())));
        assert!(s.offer_with_scores(without, kv(52, n), None, Some(vec![1.0; n + 1])));
        s.flush();
        assert_eq!(s.kvzip_scores_of(&with).unwrap(), kvzip);
        assert!(s.is_available(&with, 3) && !s.is_available(&without, 3));
        assert!(s
            .compress(&without, &s.load_master(&without).unwrap(), 3)
            .is_err());
        let middle = middle_of(&s, &with, 3);
        assert!(middle.iter().all(|p| p % 3 == 0), "{middle:?}");
    }
    // The scores come back after a restart with the meta entry beside the master.
    let s = store_with_grid(
        Arc::new(RamTier::new(1 << 30)),
        dir.path(),
        1 << 29,
        Policy::Lru,
        grid,
    );
    assert_eq!(s.longest_stored(&[with]), Some(0));
    s.flush();
    assert!(s.is_available(&with, 3));
    let middle = middle_of(&s, &with, 3);
    assert!(middle.iter().all(|p| p % 3 == 0), "{middle:?}");
    // A grid that does not drop by KVzip keeps no KVzip scores.
    let plain = store_with_grid(
        Arc::new(RamTier::new(1 << 30)),
        tempfile::tempdir().unwrap().path(),
        1 << 29,
        Policy::Lru,
        "q8",
    );
    assert!(!plain.wants_kvzip());
    assert!(plain.offer_with_scores(with, kv(51, n), None, Some(kvzip)));
    plain.flush();
    assert!(plain.kvzip_scores_of(&with).is_none());
}

/// A RAM tier whose reads can be slowed down, timed by a real `BandwidthMeter` (the RAM
/// tier's own loads are zero-copy, so its meter holds a calibrated memcpy rate instead).
struct SlowTier {
    inner: RamTier,
    read_bytes_per_s: std::sync::Mutex<Option<f64>>,
    meter: pk_tiers::BandwidthMeter,
}

impl Tier for SlowTier {
    fn name(&self) -> &str {
        "ram"
    }
    fn store(
        &self,
        key: &ChunkKey,
        payload: &Payload,
    ) -> Result<Vec<pk_tiers::Evicted>, pk_tiers::TierError> {
        self.inner.store(key, payload)
    }
    fn load(&self, key: &ChunkKey) -> Result<Option<Payload>, pk_tiers::TierError> {
        let t0 = std::time::Instant::now();
        let got = self.inner.load(key)?;
        if let (Some(p), Some(rate)) = (&got, *self.read_bytes_per_s.lock().unwrap()) {
            std::thread::sleep(std::time::Duration::from_secs_f64(p.len() as f64 / rate));
        }
        if let Some(p) = &got {
            self.meter.record_read(p.len() as u64, t0.elapsed());
        }
        Ok(got)
    }
    fn contains(&self, key: &ChunkKey) -> Result<bool, pk_tiers::TierError> {
        self.inner.contains(key)
    }
    fn delete(&self, key: &ChunkKey) -> Result<bool, pk_tiers::TierError> {
        self.inner.delete(key)
    }
    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }
    fn usage_bytes(&self) -> u64 {
        self.inner.usage_bytes()
    }
    fn bandwidth(&self) -> pk_tiers::BandwidthEstimate {
        self.meter.estimate()
    }
}

/// The delay model is measured, not assumed: calibration probes set each tier's bandwidth
/// from its meter (provenance `calibrated`), and when the RAM tier slows down to 200 kB/s
/// the next load shows it (provenance `observed`) and the context is re-placed in a
/// smaller configuration or another tier.
#[test]
fn a_slowed_tier_changes_placement() {
    let dir = tempfile::tempdir().unwrap();
    let ram = Arc::new(SlowTier {
        inner: RamTier::new(64 << 20),
        read_bytes_per_s: std::sync::Mutex::new(None),
        meter: pk_tiers::BandwidthMeter::default(),
    });
    let s = store(
        ram.clone(),
        dir.path(),
        32 << 20,
        Policy::Evicpress {
            alpha: 1.0,
            ranking: Ranking::AbsoluteDrop,
        },
    );
    let before_calibration = s.delay_report();
    assert_eq!(before_calibration.provenance.tiers[0].source, "prior");
    let calibrated = s.calibrate_tiers(256 << 10).unwrap();
    assert!(
        calibrated.iter().all(|c| c.skipped.is_none()),
        "{calibrated:?}"
    );
    let report = s.delay_report();
    assert_eq!(report.provenance.tiers[0].source, "calibrated");
    assert_eq!(report.provenance.tiers[1].source, "calibrated");
    assert!(report.model.tiers[0].read_bytes_per_s > 1e8, "{report:?}");
    let key = ChunkKey([42; 32]);
    assert!(s.offer(key, kv(42, 256)));
    s.flush();
    let fast = s.placement_of(&key).unwrap();
    assert_eq!(
        fast,
        (0, 0),
        "a fast RAM tier holds the context uncompressed"
    );

    *ram.read_bytes_per_s.lock().unwrap() = Some(2e5);
    s.load(&key, Some(&[1, 2, 3])).unwrap();
    s.flush();
    let report = s.delay_report();
    assert_eq!(report.provenance.tiers[0].source, "observed");
    assert!(report.model.tiers[0].read_bytes_per_s < 1e7, "{report:?}");
    let slow = s.placement_of(&key).unwrap();
    assert_ne!(slow, fast, "placement ignored a tier 1000x slower");
}

/// A master that fails the codec's check cannot be served or fallen back on: the context
/// is forgotten and both copies deleted, so that it is stored again once recomputed
/// (kept, every later hit would fail on it).
#[test]
fn an_unusable_master_is_forgotten_and_stored_again() {
    let ram = Arc::new(RamTier::new(1 << 30));
    let last = Arc::new(RamTier::named("last", 1 << 30));
    let cfg = common::ram_disk_config(
        (ram.clone() as Arc<dyn Tier>, last.clone() as Arc<dyn Tier>),
        [1 << 29, u64::MAX],
        "q8,q4,knorm-0.5",
        Policy::Lru,
    );
    let s = ContextStore::new(cfg).unwrap();
    let key = ChunkKey([4; 32]);
    s.offer(key, kv(4, 128));
    s.flush();
    assert_eq!(s.placement_of(&key), Some((0, 0)));
    let copy = copy_key(&key, 0);
    for tier in [&ram, &last] {
        let mut bytes = tier.load(&copy).unwrap().unwrap().to_vec();
        bytes[100] ^= 0xFF;
        tier.delete(&copy).unwrap();
        tier.store(&copy, &Payload::from(bytes)).unwrap();
    }
    assert!(s.load(&key, None).is_err(), "neither copy is usable");
    assert!(!s.contains(&key), "the context is forgotten");
    assert_eq!(s.stats().unreadable_dropped, 1);
    assert!(ram.load(&copy).unwrap().is_none() && last.load(&copy).unwrap().is_none());
    assert!(s.offer(key, kv(4, 128)), "stored again");
    s.flush();
    let (got, _) = s.load(&key, None).unwrap();
    assert_eq!(got.n_tokens(), 128);
}
