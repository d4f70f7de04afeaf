//! State-machine property tests: each tier (RAM, disk, Redis) runs random sequences of
//! store / load / contains / delete (and, for disk, reopen) next to a reference model, an
//! exact LRU map of key → payload size. After every step:
//! - usage never exceeds the capacity and equals the model's;
//! - `contains` answers for every key of the key space as the model does, so an
//!   acknowledged store stays readable until it is reported evicted (or deleted);
//! - RAM and disk report exactly the victims the model evicts, in LRU order, with their
//!   bytes (a victim that vanished unreported, or a reported one that was not stored, fails).
//!   Redis is the last tier and evicts on the server without reporting (nothing below it to
//!   demote to), so there the model's victims must simply be gone, and nothing else.
//!
//! Every load returns exactly the stored bytes; at the end every entry the model holds is
//! loaded and compared.

mod common;

use std::path::Path;

use common::{key, payload, unique_prefix, RedisServer};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, RedisTier, RedisTierConfig, Tier};
use proptest::prelude::*;

/// Keys 0..KEY_SPACE: small, so that stores hit present keys and loads hit stored ones.
const KEY_SPACE: u64 = 10;
/// The disk tier counts its 64-byte entry header against the capacity.
const DISK_HEADER_BYTES: u64 = 64;

#[derive(Clone, Debug)]
enum Op {
    Store(u64),
    Load(u64),
    Contains(u64),
    Delete(u64),
    /// Disk only (treated as `Contains` elsewhere): drop the tier and open the directory again.
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEY_SPACE).prop_map(Op::Store),
        3 => (0..KEY_SPACE).prop_map(Op::Load),
        1 => (0..KEY_SPACE).prop_map(Op::Contains),
        1 => (0..KEY_SPACE).prop_map(Op::Delete),
        1 => Just(Op::Reopen),
    ]
}

/// Payload length per key: keys name content, so a key's bytes never change.
fn sizes() -> impl Strategy<Value = Vec<usize>> {
    proptest::collection::vec(1..400usize, KEY_SPACE as usize)
}

/// Exact LRU over (key, charged bytes); front = least recently used.
struct LruModel {
    capacity_bytes: u64,
    entries: Vec<(u64, u64)>,
}

impl LruModel {
    fn usage_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.1).sum()
    }

    fn position(&self, k: u64) -> Option<usize> {
        self.entries.iter().position(|e| e.0 == k)
    }

    fn touch(&mut self, k: u64) -> bool {
        match self.position(k) {
            Some(i) => {
                let e = self.entries.remove(i);
                self.entries.push(e);
                true
            }
            None => false,
        }
    }

    /// The victims, least recently used first.
    fn store(&mut self, k: u64, charged_bytes: u64) -> Vec<u64> {
        if self.touch(k) {
            return Vec::new();
        }
        let mut victims = Vec::new();
        while self.usage_bytes() + charged_bytes > self.capacity_bytes {
            victims.push(self.entries.remove(0).0);
        }
        self.entries.push((k, charged_bytes));
        victims
    }

    fn delete(&mut self, k: u64) -> bool {
        self.position(k).map(|i| self.entries.remove(i)).is_some()
    }
}

struct Harness<'a> {
    sizes: &'a [usize],
    /// Bytes a tier charges per entry beyond the payload.
    overhead_bytes: u64,
    /// Whether `store` returns its victims (RAM, disk) or evicts silently (Redis).
    reports_victims: bool,
}

impl Harness<'_> {
    fn payload(&self, k: u64) -> pk_tiers::Payload {
        payload(k, self.sizes[k as usize])
    }

    /// Runs `ops` against the tier `open()` returns (called again on `Reopen`).
    fn run(
        &self,
        capacity_bytes: u64,
        ops: &[Op],
        mut open: impl FnMut() -> Box<dyn Tier>,
        reopen_supported: bool,
    ) -> Result<(), TestCaseError> {
        let mut model = LruModel {
            capacity_bytes,
            entries: Vec::new(),
        };
        let mut tier = Some(open());
        let all_keys: Vec<_> = (0..KEY_SPACE).map(key).collect();
        for (step, op) in ops.iter().enumerate() {
            let t = tier.as_ref().unwrap();
            match *op {
                Op::Store(k) => {
                    let charged = self.sizes[k as usize] as u64 + self.overhead_bytes;
                    let expected = model.store(k, charged);
                    let victims = t.store(&key(k), &self.payload(k)).unwrap();
                    if self.reports_victims {
                        let got: Vec<_> = victims.iter().map(|v| v.key).collect();
                        let want: Vec<_> = expected.iter().map(|&v| key(v)).collect();
                        prop_assert_eq!(got, want, "step {}: victims of storing {}", step, k);
                        for (v, &n) in victims.iter().zip(&expected) {
                            prop_assert_eq!(
                                &v.payload[..],
                                &self.payload(n)[..],
                                "victim {} bytes",
                                n
                            );
                        }
                    } else {
                        prop_assert!(victims.is_empty());
                    }
                }
                Op::Load(k) => {
                    let got = t.load(&key(k)).unwrap();
                    if model.touch(k) {
                        prop_assert_eq!(
                            got.as_deref(),
                            Some(&self.payload(k)[..]),
                            "step {}: load {}",
                            step,
                            k
                        );
                    } else {
                        prop_assert!(
                            got.is_none(),
                            "step {}: {} was never stored or is gone",
                            step,
                            k
                        );
                    }
                }
                Op::Contains(k) => {
                    prop_assert_eq!(t.contains(&key(k)).unwrap(), model.position(k).is_some());
                }
                Op::Delete(k) => {
                    prop_assert_eq!(
                        t.delete(&key(k)).unwrap(),
                        model.delete(k),
                        "step {}: delete {}",
                        step,
                        k
                    );
                }
                Op::Reopen if reopen_supported => {
                    // The old handle is dropped first, as a restarted process would.
                    drop(tier.take());
                    tier = Some(open());
                }
                Op::Reopen => {}
            }
            let t = tier.as_ref().unwrap();
            prop_assert!(
                t.usage_bytes() <= capacity_bytes,
                "step {}: over capacity",
                step
            );
            prop_assert_eq!(
                t.usage_bytes(),
                model.usage_bytes(),
                "step {}: usage after {:?}",
                step,
                op
            );
            let present = t.contains_many(&all_keys).unwrap();
            let expected: Vec<bool> = (0..KEY_SPACE)
                .map(|k| model.position(k).is_some())
                .collect();
            prop_assert_eq!(present, expected, "step {}: contents after {:?}", step, op);
        }
        // Everything still acknowledged is readable, byte for byte.
        let t = tier.as_ref().unwrap();
        for &(k, _) in &model.entries.clone() {
            let got = t.load(&key(k)).unwrap();
            prop_assert_eq!(
                got.as_deref(),
                Some(&self.payload(k)[..]),
                "final load {}",
                k
            );
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn ram_tier_against_an_lru_model(sizes in sizes(), capacity_bytes in 400..1500u64, ops in proptest::collection::vec(op(), 1..60)) {
        let h = Harness { sizes: &sizes, overhead_bytes: 0, reports_victims: true };
        h.run(capacity_bytes, &ops, || Box::new(RamTier::new(capacity_bytes)), false)?;
    }
}

fn open_disk(dir: &Path, capacity_bytes: u64, drop_page_cache: bool) -> Box<dyn Tier> {
    let mut config = DiskTierConfig::new(dir, capacity_bytes);
    // fsync per write would make each case take seconds; durability is the crash test's
    // business, and a reopen after a clean drop needs no fsync.
    config.sync_writes = false;
    config.drop_page_cache = drop_page_cache;
    let tier = DiskTier::open(config).unwrap();
    assert_eq!(tier.scan_report().corrupt_files_removed, 0);
    assert_eq!(tier.scan_report().temp_files_removed, 0);
    Box::new(tier)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Reopening rebuilds the index from the files: same contents, same usage, and the same
    /// LRU order (from mtimes), which the victims of later stores check.
    #[test]
    fn disk_tier_against_an_lru_model_with_reopens(
        sizes in sizes(),
        capacity_bytes in 900..2500u64,
        drop_page_cache in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let h = Harness { sizes: &sizes, overhead_bytes: DISK_HEADER_BYTES, reports_victims: true };
        h.run(capacity_bytes, &ops, || open_disk(dir.path(), capacity_bytes, drop_page_cache), true)?;
        let leftovers = std::fs::read_dir(dir.path()).unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        prop_assert_eq!(leftovers, 0, "no temporary files after clean operations");
    }
}

/// Redis: one server for all cases (see `common` for which); each case gets a fresh key
/// prefix, so cases cannot see each other's entries.
#[test]
fn redis_tier_against_an_lru_model() {
    let server = RedisServer::shared_or_private();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(64));
    let strategy = (
        sizes(),
        400..1500u64,
        proptest::collection::vec(op(), 1..60),
    );
    runner
        .run(&strategy, |(sizes, capacity_bytes, ops)| {
            let mut config = RedisTierConfig::new(&server.url);
            config.key_prefix = unique_prefix("state_machine");
            config.capacity_bytes = capacity_bytes;
            let h = Harness {
                sizes: &sizes,
                overhead_bytes: 0,
                reports_victims: false,
            };
            let cleanup = RedisTier::open(config.clone()).unwrap();
            let result = h.run(
                capacity_bytes,
                &ops,
                || Box::new(RedisTier::open(config.clone()).unwrap()),
                false,
            );
            // Leave nothing behind in a shared server.
            for k in 0..KEY_SPACE {
                cleanup.delete(&key(k)).unwrap();
            }
            result
        })
        .unwrap();
}
