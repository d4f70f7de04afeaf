//! Decode attention spread over the decode pool (`pool`), one (sequence, KV head) per chunk.
//!
//! `attention::paged_attention` runs a decode step's attention on the calling thread below
//! ≈ 3,600 tokens of context (rayon's hand-off would cost more than it saves), yet at 512
//! tokens it is about a quarter of a 1-thread step, and during it a second thread has
//! nothing to do. The pool's regions cost a few microseconds, so here each KV head of each
//! sequence is a chunk. Every chunk calls the same AVX-512 kernels with the same rows as
//! `attention.rs`'s tasks do (all query heads of the GQA group of each token, in order,
//! `max_rows` at a time), and by `attn512`'s NOTE 1 a row's bits depend on nothing else, so
//! the results equal `paged_attention`'s bit for bit (tested below) whichever thread runs
//! a chunk and however many threads there are. On CPUs without AVX-512 a chunk is the AVX2
//! kernel's task for those rows (`split_avx2`), equal to `paged_attention`'s likewise.

use crate::attention::{AttnSeq, AttnShape, Kernel};
use crate::kv_store::{KvStore, LayerKv};

use super::pool;
#[cfg(target_arch = "x86_64")]
use super::{attn512, attn512q};

/// Up to this many query rows in a call, attention is split here (decode steps); larger
/// calls (prefill, big batches) keep `paged_attention`'s own tiling and rayon.
pub const MAX_SPLIT_ROWS: usize = pool::DECODE_MAX_TOKENS;

/// Computes what `paged_attention(store, layer, shape, seqs, q, out)` computes, with the
/// (sequence, KV head) pairs spread over the decode pool, and returns `true`; or returns
/// `false` without touching `out` when this path does not apply (no SIMD kernel for this
/// head size, too many rows, or a single pair) and the caller should use `paged_attention`.
pub fn split_attention(
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let pool = pool::global();
        let rows: usize = seqs.iter().map(|s| s.n_queries).sum();
        let pairs = seqs.len() * shape.n_kv_heads;
        // At one active thread the chunks run inline here too (the same work as
        // `paged_attention`'s serial path), so the pool's thread count alone decides.
        let kernel = Kernel::best(shape.head_dim);
        // Heads with their own first key take `paged_attention`'s ranged kernels.
        let ragged = seqs.iter().any(|s| !s.head_first_keys.is_empty());
        if rows > MAX_SPLIT_ROWS || pairs < 2 || kernel == Kernel::Scalar || ragged {
            return false;
        }
        if kernel == Kernel::Avx2 {
            split_avx2(pool, store, layer, shape, seqs, q, out);
        } else {
            split_with(pool, store, layer, shape, seqs, q, out);
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (store, layer, shape, seqs, q, out);
        false
    }
}

/// The AVX2 kernel's version of [`split_with`]: each (sequence, KV head) chunk computes
/// exactly what one of `paged_attention`'s tasks computes for those rows (the same
/// `attend_tile` call; a row's bits depend on nothing else), on whichever pool thread
/// takes it. Without it a decode step's attention ran on one thread below 32K row-keys.
#[cfg(target_arch = "x86_64")]
fn split_avx2(
    pool: &pool::Pool,
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
) {
    let q_dim = shape.n_heads * shape.head_dim;
    let n_rows: usize = seqs
        .iter()
        .map(|s| s.row_offset + s.n_queries)
        .max()
        .unwrap_or(0);
    assert!(
        q.len() >= n_rows * q_dim && out.len() >= n_rows * q_dim,
        "q/out shorter than the rows"
    );
    #[derive(Clone, Copy)]
    struct Out(*mut f32);
    // SAFETY: each chunk writes only its own (rows of one sequence) × (heads of one KV head)
    // of `out`, which this function borrows mutably for as long as any chunk runs.
    unsafe impl Send for Out {}
    // SAFETY: as for `Send`: chunks write disjoint slices.
    unsafe impl Sync for Out {}
    let ptr = Out(out.as_mut_ptr());
    let nkv = shape.n_kv_heads;
    let chunk = |i: usize| {
        // Captures the whole `Out` (which is `Sync`), not its raw-pointer field.
        #[allow(clippy::redundant_locals)]
        let ptr = ptr;
        // SAFETY: `out` holds every row (checked above); this chunk is the only writer of
        // its (sequence, KV head); `attend_seq_kv_head` checks the block table.
        unsafe {
            crate::attention::attend_seq_kv_head(
                store,
                layer,
                shape,
                &seqs[i / nkv],
                i % nkv,
                q,
                ptr.0,
            )
        };
    };
    pool.run(seqs.len() * nkv, &chunk);
}

#[cfg(target_arch = "x86_64")]
fn split_with(
    pool: &pool::Pool,
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
) {
    let (hd, nkv) = (shape.head_dim, shape.n_kv_heads);
    let group = shape.n_heads / nkv;
    let q_dim = shape.n_heads * hd;
    let g = &store.geometry;
    // The same bounds `paged_attention` checks: every row fits in q/out, and every block
    // table covers its visible keys.
    let n_rows: usize = seqs
        .iter()
        .map(|s| s.row_offset + s.n_queries)
        .max()
        .unwrap_or(0);
    assert!(
        q.len() >= n_rows * q_dim && out.len() >= n_rows * q_dim,
        "q/out shorter than the rows"
    );
    for s in seqs {
        if s.n_queries > 0 {
            assert!(
                (s.stored_start + s.n_queries - 1) / g.block_size_tokens < s.block_table.len(),
                "block table shorter than stored tokens"
            );
        }
    }
    let (k, v, f16, quant) = match store.layer(layer) {
        LayerKv::F16 { k, v } => (k.as_ptr() as *const u8, v.as_ptr() as *const u8, true, None),
        LayerKv::F32 { k, v } => (
            k.as_ptr() as *const u8,
            v.as_ptr() as *const u8,
            false,
            None,
        ),
        LayerKv::Quant { k, v, layout } => (k.as_ptr(), v.as_ptr(), false, Some(layout)),
    };
    #[derive(Clone, Copy)]
    struct Ptrs(*const u8, *const u8, *mut f32);
    // SAFETY: K and V are only read, from the store that this function borrows for as long as
    // any chunk runs; `out` is borrowed mutably as long, and each chunk writes only its own
    // (rows of one sequence) × (heads of one KV head).
    unsafe impl Send for Ptrs {}
    // SAFETY: as for `Send`: chunks that share the pointers read K/V and write disjoint
    // slices of `out`.
    unsafe impl Sync for Ptrs {}
    let ptrs = Ptrs(k, v, out.as_mut_ptr());
    let scale = 1.0 / (hd as f32).sqrt();
    let max_rows = attn512::max_rows(hd);
    let chunk = |i: usize| {
        // Captures the whole `Ptrs` (which is `Sync`), not its raw-pointer fields one by one.
        #[allow(clippy::redundant_locals)]
        let ptrs = ptrs;
        let (s, kv_head) = (&seqs[i / nkv], i % nkv);
        let mut kv = attn512::HeadKv {
            k: ptrs.0,
            v: ptrs.1,
            f16,
            block_table: s.block_table,
            n_kv_heads: g.n_kv_heads,
            kv_head,
            block_size: g.block_size_tokens,
            head_dim: hd,
            prefetch: true,
        };
        let at = |tok: usize, gi: usize| (s.row_offset + tok) * q_dim + (kv_head * group + gi) * hd;
        let mut rows = [attn512::Row::EMPTY; 4];
        let mut n = 0;
        // SAFETY: `Kernel::best` chose AVX-512 for this head size; rows point into q/out,
        // whose lengths were checked above; the block table covers every row's visible keys;
        // each chunk writes only its own (rows of one sequence) × (heads of one KV head).
        let attend = |kv: &attn512::HeadKv, rows: &[attn512::Row]| unsafe {
            match &quant {
                None => attn512::attend(kv, rows, scale),
                Some(layout) => attn512q::attend(kv, layout, rows, scale),
            }
        };
        for tok in 0..s.n_queries {
            for gi in 0..group {
                // SAFETY: in bounds of q/out (checked above).
                rows[n] = unsafe {
                    attn512::Row {
                        q: q.as_ptr().add(at(tok, gi)),
                        out: ptrs.2.add(at(tok, gi)),
                        first_visible: 0,
                        n_visible: s.stored_start + tok + 1,
                        lse: std::ptr::null_mut(),
                    }
                };
                n += 1;
                if n == max_rows {
                    attend(&kv, &rows[..n]);
                    kv.prefetch = false;
                    n = 0;
                }
            }
        }
        if n > 0 {
            attend(&kv, &rows[..n]);
        }
    };
    pool.run(seqs.len() * nkv, &chunk);
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::attention::paged_attention;
    use crate::kv_store::{KvDtype, KvGeometry};
    use rand::{Rng, SeedableRng};

    /// Bit-identical to `paged_attention` for one-token and few-token sequences in a batch,
    /// over f16, f32 and quantised stores, at 2 and 3 threads, with the kernel this CPU runs
    /// (AVX-512 or AVX2).
    #[test]
    fn equals_paged_attention_bit_for_bit() {
        let shape = AttnShape {
            n_heads: 9,
            n_kv_heads: 3,
            head_dim: 64,
        };
        let kernel = Kernel::best(shape.head_dim);
        if kernel == Kernel::Scalar {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8, KvDtype::Q4] {
            let g = KvGeometry {
                n_layers: 1,
                n_kv_heads: 3,
                head_dim: 64,
                block_size_tokens: 16,
                num_blocks: 40,
            };
            let mut store = KvStore::new(g, dtype);
            let kvd = 3 * 64;
            for b in 0..40u32 {
                for slot in 0..16 {
                    let kk: Vec<f32> = (0..kvd).map(|_| rng.gen_range(-2.0..2.0)).collect();
                    let vv: Vec<f32> = (0..kvd).map(|_| rng.gen_range(-2.0..2.0)).collect();
                    store.write_token(0, b, slot, &kk, &vv);
                }
            }
            let t1: Vec<u32> = (0..20).rev().collect();
            let t2: Vec<u32> = (20..40).collect();
            let seqs = [
                AttnSeq {
                    block_table: &t1,
                    stored_start: 300,
                    n_queries: 1,
                    row_offset: 0,
                    head_first_keys: &[],
                },
                AttnSeq {
                    block_table: &t2,
                    stored_start: 17,
                    n_queries: 3,
                    row_offset: 1,
                    head_first_keys: &[],
                },
            ];
            let q: Vec<f32> = (0..4 * 9 * 64).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut want = vec![0f32; q.len()];
            paged_attention(&store, 0, shape, &seqs, &q, &mut want);
            for threads in [2, 3] {
                let pool = pool::Pool::new(threads);
                for single in [&seqs[..1], &seqs[..]] {
                    let mut got = vec![f32::NAN; q.len()];
                    if kernel == Kernel::Avx2 {
                        split_avx2(&pool, &store, 0, shape, single, &q, &mut got);
                    } else {
                        split_with(&pool, &store, 0, shape, single, &q, &mut got);
                    }
                    let rows: usize = single.iter().map(|s| s.n_queries).sum();
                    let n = rows * 9 * 64;
                    assert_eq!(
                        got[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want[..n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{dtype:?} threads {threads}"
                    );
                }
            }
        }
    }
}
