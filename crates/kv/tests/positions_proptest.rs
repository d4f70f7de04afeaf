//! Property test of NOTE 13: a block table keeps each stored token's RoPE position in step
//! with every change of its tokens. Random appends, block evictions, compactions (whole
//! table and per unit), truncations, forks and placed contexts run on a `KvCacheManager`;
//! after every step each live sequence's `position_of` must equal a reference model that is
//! just the list of positions, and `check_invariants` must hold.

use proptest::prelude::*;

use pk_kv::{KvCacheManager, SeqId};

const BLOCK: u32 = 4;

#[derive(Clone, Debug)]
enum Op {
    /// A new sequence; with `placed`, a context of `len` tokens standing for `len + gap`
    /// (every `stride`-th position kept, as a compressed context is placed).
    Add {
        len: u8,
        placed: Option<(u8, u8)>,
    },
    Append {
        seq: u8,
        n: u8,
    },
    RemoveBlock {
        seq: u8,
        index: u8,
    },
    /// Keep the stored tokens whose bit in `mask` (cycled) is set.
    Compact {
        seq: u8,
        mask: u32,
    },
    /// Two units keeping the same number of tokens: unit 0 by `mask`, unit 1 the last ones.
    CompactUnits {
        seq: u8,
        mask: u32,
    },
    Truncate {
        seq: u8,
        keep: u8,
    },
    Fork {
        seq: u8,
    },
    Free {
        seq: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1u8..24, proptest::option::of((0u8..10, 1u8..4)))
            .prop_map(|(len, placed)| Op::Add { len, placed }),
        4 => (any::<u8>(), 1u8..9).prop_map(|(seq, n)| Op::Append { seq, n }),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(seq, index)| Op::RemoveBlock { seq, index }),
        1 => (any::<u8>(), any::<u32>()).prop_map(|(seq, mask)| Op::Compact { seq, mask }),
        1 => (any::<u8>(), any::<u32>()).prop_map(|(seq, mask)| Op::CompactUnits { seq, mask }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(seq, keep)| Op::Truncate { seq, keep }),
        1 => any::<u8>().prop_map(|seq| Op::Fork { seq }),
        1 => any::<u8>().prop_map(|seq| Op::Free { seq }),
    ]
}

/// The reference: per live sequence, its stored tokens' positions and its next position.
struct Model {
    seqs: Vec<(SeqId, Vec<u64>, u64)>,
    next_id: u64,
}

impl Model {
    fn pick(&self, seq: u8) -> Option<usize> {
        (!self.seqs.is_empty()).then(|| seq as usize % self.seqs.len())
    }

    fn new_id(&mut self) -> SeqId {
        self.next_id += 1;
        SeqId(self.next_id)
    }
}

fn kept_by(mask: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .filter(|i| mask >> (i % 32) & 1 == 1)
        .collect()
}

fn apply(kv: &mut KvCacheManager, m: &mut Model, op: Op) {
    match op {
        Op::Add { len, placed } => {
            let seq = m.new_id();
            kv.add_sequence(seq, &kv.get_computed_prefix(&[], b""));
            if kv.allocate_slots(seq, len as u32).is_none() {
                kv.free(seq);
                return;
            }
            let (positions, next) = match placed {
                None => ((0..len as u64).collect(), len as u64),
                Some((gap, stride)) => {
                    let p: Vec<u64> = (0..len as u64).map(|i| i * stride as u64).collect();
                    let next = p.last().map_or(0, |&x| x + 1) + gap as u64;
                    kv.set_positions(seq, p.iter().map(|&x| x as u32).collect(), next);
                    (p, next)
                }
            };
            m.seqs.push((seq, positions, next));
        }
        Op::Append { seq, n } => {
            let Some(i) = m.pick(seq) else { return };
            let (id, p, next) = &mut m.seqs[i];
            if kv.allocate_slots(*id, n as u32).is_some() {
                p.extend(*next..*next + n as u64);
                *next += n as u64;
            }
        }
        Op::RemoveBlock { seq, index } => {
            let Some(i) = m.pick(seq) else { return };
            let (id, p, _) = &mut m.seqs[i];
            let full = kv.block_table(*id).unwrap().num_full_blocks();
            if full == 0 {
                return;
            }
            let index = index as usize % full;
            kv.remove_block(*id, index);
            let b = BLOCK as usize;
            p.drain(index * b..(index + 1) * b);
        }
        Op::Compact { seq, mask } => {
            let Some(i) = m.pick(seq) else { return };
            let (id, p, _) = &mut m.seqs[i];
            let keep = kept_by(mask, p.len());
            if kv.compact(*id, &keep).is_some() {
                *p = keep.iter().map(|&k| p[k as usize]).collect();
            }
        }
        Op::CompactUnits { seq, mask } => {
            let Some(i) = m.pick(seq) else { return };
            let (id, p, _) = &mut m.seqs[i];
            let unit0 = kept_by(mask, p.len());
            let n = p.len() as u32;
            let unit1: Vec<u32> = (n - unit0.len() as u32..n).collect();
            if kv.compact_units(*id, &[unit0.clone(), unit1]).is_some() {
                *p = unit0.iter().map(|&k| p[k as usize]).collect();
            }
        }
        Op::Truncate { seq, keep } => {
            let Some(i) = m.pick(seq) else { return };
            let (id, p, _) = &mut m.seqs[i];
            let keep = keep as usize % (p.len() + 1);
            if kv.truncate(*id, keep as u32).is_some() {
                p.truncate(keep);
            }
        }
        Op::Fork { seq } => {
            let Some(i) = m.pick(seq) else { return };
            let child = m.new_id();
            if kv.fork(m.seqs[i].0, child).is_some() {
                let (_, p, next) = m.seqs[i].clone();
                m.seqs.push((child, p, next));
            }
        }
        Op::Free { seq } => {
            let Some(i) = m.pick(seq) else { return };
            kv.free(m.seqs.remove(i).0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn stored_positions_follow_every_change(ops in proptest::collection::vec(op(), 1..60)) {
        let mut kv = KvCacheManager::new(48, BLOCK);
        let mut m = Model { seqs: Vec::new(), next_id: 0 };
        for op in ops {
            apply(&mut kv, &mut m, op.clone());
            kv.check_invariants();
            for (id, p, next) in &m.seqs {
                let t = kv.block_table(*id).unwrap();
                prop_assert_eq!(t.num_stored_tokens() as usize, p.len(), "after {:?}", op);
                prop_assert_eq!(t.next_position(), *next, "after {:?}", op);
                let got: Vec<u64> = (0..p.len() as u32).map(|i| t.position_of(i)).collect();
                prop_assert_eq!(&got, p, "after {:?}", op);
                // The list is kept exactly when positions differ from stored indices.
                let identity = *next == p.len() as u64;
                prop_assert_eq!(t.positions().is_none(), identity, "after {:?}", op);
            }
        }
        for (id, ..) in m.seqs.drain(..) {
            kv.free(id);
        }
        prop_assert_eq!(kv.pool().num_free_blocks(), kv.pool().num_blocks());
    }
}
