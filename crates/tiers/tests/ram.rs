//! RAM tier: capacity, exact LRU order, oversize refusal, and a state-machine property test
//! against a trivial reference model.

mod common;

use common::{key, payload};
use pk_tiers::{RamTier, Tier, TierError};
use proptest::prelude::*;

#[test]
fn capacity_is_enforced_and_victims_are_returned_in_lru_order() {
    let ram = RamTier::new(3000);
    for n in 1..=3 {
        assert!(ram.store(&key(n), &payload(n, 1000)).unwrap().is_empty());
    }
    assert_eq!(ram.usage_bytes(), 3000);
    // Touch 1, so 2 becomes the least recently used.
    assert_eq!(
        ram.load(&key(1)).unwrap().as_deref(),
        Some(&payload(1, 1000)[..])
    );
    assert_eq!(ram.keys_lru_first(), vec![key(2), key(3), key(1)]);

    let evicted = ram.store(&key(4), &payload(4, 1500)).unwrap();
    let evicted_keys: Vec<_> = evicted.iter().map(|e| e.key).collect();
    assert_eq!(
        evicted_keys,
        vec![key(2), key(3)],
        "oldest first, only as many as needed"
    );
    assert_eq!(
        &evicted[0].payload[..],
        &payload(2, 1000)[..],
        "victims carry their bytes for demotion"
    );
    assert_eq!(ram.keys_lru_first(), vec![key(1), key(4)]);
    assert_eq!(ram.usage_bytes(), 2500);
    ram.check_invariants();
}

#[test]
fn storing_a_present_key_only_refreshes_it() {
    let ram = RamTier::new(2000);
    ram.store(&key(1), &payload(1, 1000)).unwrap();
    ram.store(&key(2), &payload(2, 1000)).unwrap();
    assert!(ram.store(&key(1), &payload(1, 1000)).unwrap().is_empty());
    assert_eq!(ram.keys_lru_first(), vec![key(2), key(1)]);
    assert_eq!(ram.usage_bytes(), 2000);
}

#[test]
fn oversize_entry_is_refused_and_nothing_is_evicted() {
    let ram = RamTier::new(1000);
    ram.store(&key(1), &payload(1, 600)).unwrap();
    let err = ram.store(&key(2), &payload(2, 1001)).unwrap_err();
    assert!(
        matches!(
            err,
            TierError::TooLarge {
                size_bytes: 1001,
                limit_bytes: 1000,
                ..
            }
        ),
        "{err}"
    );
    assert!(ram.contains(&key(1)).unwrap());
    assert!(!ram.contains(&key(2)).unwrap());
}

#[test]
fn delete_and_bandwidth_prior() {
    let ram = RamTier::new(1000);
    ram.store(&key(1), &payload(1, 10)).unwrap();
    assert!(ram.delete(&key(1)).unwrap());
    assert!(!ram.delete(&key(1)).unwrap());
    assert_eq!(ram.usage_bytes(), 0);
    let bw = ram.bandwidth();
    assert!(
        bw.read_bytes_per_s.unwrap() > 1e8,
        "memcpy calibration: {bw:?}"
    );
}

#[derive(Clone, Debug)]
enum Op {
    Store(u64, usize),
    Load(u64),
    Delete(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..12u64, 1..400usize).prop_map(|(k, len)| Op::Store(k, len)),
        (0..12u64).prop_map(Op::Load),
        (0..12u64).prop_map(Op::Delete),
    ]
}

proptest! {
    /// Reference model: a Vec in LRU order (front = least recent).
    #[test]
    fn ram_tier_matches_a_reference_lru(ops in proptest::collection::vec(op(), 1..80)) {
        const CAPACITY_BYTES: u64 = 1000;
        let ram = RamTier::new(CAPACITY_BYTES);
        let mut model: Vec<(u64, usize)> = Vec::new();
        for op in ops {
            match op {
                Op::Store(k, len) => {
                    // Payload length is a function of the key: keys name content.
                    let len = len.min(300) + k as usize;
                    let evicted = ram.store(&key(k), &payload(k, len)).unwrap();
                    let mut expect_evicted = Vec::new();
                    if let Some(i) = model.iter().position(|e| e.0 == k) {
                        let e = model.remove(i);
                        model.push(e);
                    } else {
                        while model.iter().map(|e| e.1 as u64).sum::<u64>() + len as u64 > CAPACITY_BYTES {
                            expect_evicted.push(key(model.remove(0).0));
                        }
                        model.push((k, len));
                    }
                    prop_assert_eq!(evicted.iter().map(|e| e.key).collect::<Vec<_>>(), expect_evicted);
                }
                Op::Load(k) => {
                    let got = ram.load(&key(k)).unwrap();
                    match model.iter().position(|e| e.0 == k) {
                        Some(i) => {
                            let e = model.remove(i);
                            prop_assert_eq!(got.as_deref(), Some(&payload(k, e.1)[..]));
                            model.push(e);
                        }
                        None => prop_assert!(got.is_none()),
                    }
                }
                Op::Delete(k) => {
                    let present = model.iter().position(|e| e.0 == k).map(|i| model.remove(i)).is_some();
                    prop_assert_eq!(ram.delete(&key(k)).unwrap(), present);
                }
            }
            ram.check_invariants();
            prop_assert_eq!(ram.keys_lru_first(), model.iter().map(|e| key(e.0)).collect::<Vec<_>>());
        }
    }
}
