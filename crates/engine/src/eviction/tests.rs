//! Eviction over a real `KvStore`: per-head selection through prefill and decode, and the
//! prefetched view.

use super::*;
use pk_model::backend::BlockOpsOnly;
use pk_model::{KvDtype, KvStore};

/// The K/V (f32, so exact) of token `t` in (layer, head): distinct per unit, so a
/// per-head policy (KNorm here) keeps different tokens in every (layer, head).
fn kv_of(layer: usize, h: usize, t: usize, k: &mut [f32], v: &mut [f32]) {
    let norm = 1.0 + ((t * 7919 + layer * 104_729 + h * 1_299_709) % 997) as f32 / 50.0;
    for (d, (k, v)) in k.iter_mut().zip(v.iter_mut()).enumerate() {
        *k = norm * if d == t % 8 { 1.0 } else { 0.1 };
        *v = (t * 1000 + layer * 10 + h) as f32 + d as f32 / 100.0;
    }
}

/// Writes token `t`'s K/V (every layer and head) at stored index `stored` of `table`.
fn write_token_at(store: &mut KvStore, table: &[u32], stored: usize, t: usize) {
    for layer in 0..2 {
        let (mut k, mut v) = (vec![0f32; 16], vec![0f32; 16]);
        for h in 0..2 {
            kv_of(
                layer,
                h,
                t,
                &mut k[h * 8..(h + 1) * 8],
                &mut v[h * 8..(h + 1) * 8],
            );
        }
        store.write_token(layer, table[stored / 4], stored % 4, &k, &v);
    }
}

/// Each (layer, head, tokens) holds exactly `tokens`, in order, in the sequence's slots.
/// A (layer, KV head), the tokens its own policy keeps, and that policy.
type UnitExpectation = (usize, usize, Vec<u32>, Box<dyn EvictionPolicy>);

fn assert_units_hold(
    store: &KvStore,
    kv: &KvCacheManager,
    seq: SeqId,
    expected: &[UnitExpectation],
) {
    let table = table_of(kv, seq);
    let n = kv.block_table(seq).unwrap().num_stored_tokens() as usize;
    let mut row = vec![0f32; 4 * 8];
    for (layer, h, tokens, _) in expected {
        assert_eq!(tokens.len(), n);
        for (i, &t) in tokens.iter().enumerate() {
            store.read_v(*layer, table[i / 4], *h, &mut row);
            let (mut k, mut v) = (vec![0f32; 8], vec![0f32; 8]);
            kv_of(*layer, *h, t as usize, &mut k, &mut v);
            assert_eq!(
                &row[(i % 4) * 8..(i % 4 + 1) * 8],
                &v[..],
                "layer {layer} head {h} slot {i}: token {t}"
            );
        }
    }
}

/// The donor's (cached, shared) blocks still hold the first 8 prompt tokens, in every
/// unit.
fn assert_donor_intact(store: &KvStore, donor_blocks: &[u32], bs: usize) {
    let mut row = vec![0f32; 4 * 8];
    for (t, (layer, h)) in (0..8).flat_map(|t| [(0, 0), (0, 1), (1, 0), (1, 1)].map(|u| (t, u))) {
        let (mut k, mut v) = (vec![0f32; 8], vec![0f32; 8]);
        kv_of(layer, h, t, &mut k, &mut v);
        store.read_v(layer, donor_blocks[t / bs], h, &mut row);
        assert_eq!(
            &row[(t % bs) * 8..(t % bs + 1) * 8],
            &v[..],
            "donor token {t} layer {layer} head {h}"
        );
    }
}

/// A donor caches the first 8 tokens of a prompt `0..n_prompt` (token t's K/V is
/// `kv_of(.., t, ..)`); `seq` adopts those blocks shared and computes the rest.
fn adopt_shared_prefix(
    store: &mut KvStore,
    kv: &mut KvCacheManager,
    donor: SeqId,
    seq: SeqId,
    n_prompt: usize,
) {
    // A donor caches the first 8 prompt tokens' blocks: the sequence adopts them shared.
    let prompt: Vec<u32> = (0..n_prompt as u32).collect();
    let empty = kv.get_computed_prefix(&[], b"");
    kv.add_sequence(donor, &empty);
    kv.allocate_slots(donor, 8).unwrap();
    (0..8).for_each(|t| write_token_at(store, &table_of(kv, donor), t, t));
    kv.cache_full_blocks(donor, &prompt[..8]);
    let prefix = kv.get_computed_prefix(&prompt, b"");
    assert_eq!(kv.add_sequence(seq, &prefix), 8);
    kv.allocate_slots(seq, (n_prompt - 8) as u32).unwrap();
    (8..n_prompt).for_each(|t| write_token_at(store, &table_of(kv, seq), t, t));
}

/// At `head` granularity every (layer, KV head) keeps exactly the tokens its own policy
/// instance chose over its own K/V, after prefill and after decode evictions; the table
/// holds the budget; shared blocks from the prefix cache are never written.
#[test]
fn each_head_keeps_its_own_tokens_through_prefill_and_decode() {
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 8,
        block_size_tokens: 4,
        num_blocks: 32,
    };
    let (bs, budget, n_prompt) = (4usize, 16u32, 40usize);
    let spec: PolicySpec = "knorm".parse().unwrap();
    let units = pk_kv::selection_units(KvGranularity::Head, 2, 2, |_| false);
    let mut ev = SeqEviction::new(spec, budget, KvGranularity::Head, units);
    let (mut store, mut kv) = (KvStore::new(g, KvDtype::F32), KvCacheManager::new(32, 4));
    let (donor, seq) = (SeqId(9), SeqId(1));
    adopt_shared_prefix(&mut store, &mut kv, donor, seq, n_prompt);
    let donor_blocks = table_of(&kv, donor);
    // What each (layer, head)'s own policy keeps, from a dense copy of its K/V alone.
    let mut expected: Vec<UnitExpectation> = [(0, 0), (0, 1), (1, 0), (1, 1)]
        .into_iter()
        .map(|(layer, h)| {
            let dense = pk_kv::DenseKv::from_fn(1, 1, 8, n_prompt, |_, _, t, k, v| {
                kv_of(layer, h, t, k, v)
            });
            let mut policy = spec.build();
            let keep = policy.select_prefill(&dense, None, budget, 4);
            (layer, h, keep, policy)
        })
        .collect();
    let mut stats = EvictionStats::default();
    assert!(after_prefill(
        &mut ev, &mut kv, &mut store, seq, None, &mut stats
    ));
    assert!(
        expected.iter().any(|e| e.2 != expected[0].2),
        "the test needs heads that choose differently"
    );
    assert_units_hold(&store, &kv, seq, &expected);
    assert_eq!(
        stats.pruned_prompt_tokens,
        (n_prompt - budget as usize) as u64
    );
    // Decode: fill a block; each unit evicts its own lowest-scored block.
    for t in n_prompt..n_prompt + bs {
        kv.allocate_slots(seq, 1).unwrap();
        let stored = kv.block_table(seq).unwrap().num_stored_tokens() as usize - 1;
        write_token_at(&mut store, &table_of(&kv, seq), stored, t);
        after_decode(&mut ev, &mut kv, &mut store, seq, 2, &mut stats);
    }
    for (layer, h, tokens, policy) in expected.iter_mut() {
        tokens.extend((n_prompt..n_prompt + bs).map(|t| t as u32));
        let dense = pk_kv::DenseKv::from_fn(1, 1, 8, tokens.len(), |_, _, i, k, v| {
            kv_of(*layer, *h, tokens[i] as usize, k, v)
        });
        policy.on_block_filled(&dense, None, tokens.len() / bs - 1);
        let victim = policy.choose_victim(tokens.len() / bs).unwrap();
        policy.on_block_removed(victim);
        tokens.drain(victim * bs..(victim + 1) * bs);
    }
    assert_eq!(stats.evicted_blocks, 1);
    assert_units_hold(&store, &kv, seq, &expected);
    // The table's positions follow unit 0's tokens (token t sits at position t here).
    let table = kv.block_table(seq).unwrap();
    assert_eq!(table.positions(), Some(&expected[0].2[..]));
    assert_donor_intact(&store, &donor_blocks, bs);
    kv.check_invariants();
}

/// A prefetched view reads what the block-at-a-time view reads, token by token, in any
/// order; on a host store it is the block-at-a-time view itself.
#[test]
fn prefetched_view_reads_what_block_reads_do() {
    let g = KvGeometry {
        n_layers: 2,
        n_kv_heads: 3,
        head_dim: 8,
        block_size_tokens: 4,
        num_blocks: 8,
    };
    let table = [6u32, 2, 5, 0];
    let n = 14;
    let len = g.n_layers * g.n_kv_heads * n * g.head_dim;
    let k: Vec<f32> = (0..len).map(|i| (i % 97) as f32 / 8.0).collect();
    let v: Vec<f32> = (0..len).map(|i| -((i % 89) as f32) / 4.0).collect();
    let mut pool = BlockOpsOnly(KvStore::new(g, KvDtype::F16));
    pool.write_tokens(&table, 0, &k, &v);
    let (plain, pre) = (
        StoreView::new(&pool, &table, n),
        StoreView::prefetched(&pool, &table, n),
    );
    assert!(pre.prefetched.is_some());
    assert!(StoreView::prefetched(&pool.0, &table, n)
        .prefetched
        .is_none());
    let (mut a, mut b) = (vec![0f32; 8], vec![0f32; 8]);
    for token in (0..n).rev() {
        for layer in 0..2 {
            for h in 0..3 {
                plain.key(layer, h, token, &mut a);
                pre.key(layer, h, token, &mut b);
                assert_eq!(a, b);
                plain.value(layer, h, token, &mut a);
                pre.value(layer, h, token, &mut b);
                assert_eq!(a, b);
            }
        }
    }
}
