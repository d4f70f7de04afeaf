//! Grouped-query attention that reads K/V through block tables, without gathering.
//!
//! For each sequence, KV head and tile of query tokens, the kernel walks the block table,
//! converts one block of K and V for that KV head to f32 once, and uses it for every query
//! token of the tile and every query head of the GQA group, keeping an online softmax
//! (running max, running sum, running weighted value) per query row. Nothing is copied
//! per step beyond one block of scratch, and evicted blocks need no special case: the
//! kernel sees only the compacted block table and the number of stored tokens.

use std::cell::RefCell;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod ranged;
mod tile;
use tile::attend_task;

#[cfg(target_arch = "x86_64")]
use crate::kernels::{attn, attn512};
use crate::kv_store::{KvStore, LayerKv};

/// One sequence's share of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// Physical block ids, in stored-token order.
    pub block_table: &'a [u32],
    /// Stored index of the first query token's own K/V; query i sees stored tokens
    /// `0..=stored_start + i` (causal within the new tokens, everything before them).
    pub stored_start: usize,
    pub n_queries: usize,
    /// Row of this sequence's first query in the batched `q` / `out` matrices.
    pub row_offset: usize,
    /// Per (layer, KV head), the first stored index that head sees
    /// (`SeqForward::head_first_keys`); empty: every head sees from index 0.
    pub head_first_keys: &'a [u32],
}

/// Which implementation computes a tile. All three agree within 1e-4 (tests below), and
/// each is batch-invariant on its own; the choice depends only on the CPU and head size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Portable: converts each block to f32 scratch, scalar online softmax.
    Scalar,
    /// AVX2 + FMA over f32 scratch copies of each block (`kernels::attn`).
    Avx2,
    /// AVX-512 straight from the store, f16 widened in registers (`kernels::attn512`).
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU runs for this head size.
    ///
    /// The SIMD kernels sum in a different order from the scalar one, which moves SmolLM2's
    /// first-step log-probabilities by up to a few tenths of a nat (chaotic through the 8-bit
    /// activation rounding); golden_logits' bounds were re-measured with `Avx512`.
    pub fn best(head_dim: usize) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if attn512::supported(head_dim) {
                return Kernel::Avx512;
            }
            if attn::x86_supported(head_dim) {
                return Kernel::Avx2;
            }
        }
        let _ = head_dim;
        Kernel::Scalar
    }
}

/// Query tokens per task: one pass over a KV head's blocks serves this many tokens × group
/// heads, and a prefill of 2048 tokens makes 64 tasks per KV head, plenty to balance.
const QUERY_TILE_TOKENS: usize = 32;

/// Below this many (query row × visible key) products an attention call runs on the calling
/// thread: ≈ 0.1 ms of work, well above what waking a pool thread costs, so two threads are
/// never slower than one (a decode step at a short context stays single-threaded).
const MIN_PARALLEL_ROW_KEYS: usize = 32 * 1024;

#[derive(Clone, Copy)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// One unit of parallel work: a tile of one sequence's query tokens against one KV head.
#[derive(Clone, Copy)]
struct Task {
    seq: usize,
    kv_head: usize,
    t0: usize,
    t1: usize,
}

thread_local! {
    /// The task list, reused so that a decode step does not allocate.
    static TASKS: RefCell<Vec<Task>> = const { RefCell::new(Vec::new()) };
}

/// The output pointer shared by tasks that write disjoint (row, head) slices.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the pointer is only written through in `attend_task`, and each task writes only its
// own (rows, KV head's heads) slice of `out`, which `attention_impl` borrows mutably for as
// long as any task runs.
unsafe impl Send for OutPtr {}
// SAFETY: as for `Send`: tasks that share the pointer write disjoint slices of `out`.
unsafe impl Sync for OutPtr {}

/// `out[row][h*hd..]` = softmax(q·Kᵀ/√d)·V for every query row of every sequence.
pub fn paged_attention(
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
) {
    paged_attention_with(
        Kernel::best(shape.head_dim),
        store,
        layer,
        shape,
        seqs,
        q,
        out,
    )
}

/// [`paged_attention`] with a chosen kernel (tests and benchmarks compare them).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with(
    kernel: Kernel,
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
) {
    attention_impl(kernel, store, layer, shape, seqs, q, (out, None), None)
}

/// [`paged_attention`], also writing each row's log-sum-exp of its scaled scores into
/// `lse[row][head]` (`ln Σ_j exp(q·k_j/√d)`) where the AVX-512 kernel computes the row;
/// other kernels leave `lse` as it was (callers fill it with NaN to tell).
pub fn paged_attention_lse(
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
) {
    let kernel = Kernel::best(shape.head_dim);
    attention_impl(kernel, store, layer, shape, seqs, q, (out, Some(lse)), None)
}

/// [`paged_attention`] over a sliding window (Gemma 3's local layers): query row r (of the
/// batch) sees stored tokens `first_visible[r] ..= stored_start + i`, where the caller has
/// turned the window, which is over positions, into the first stored index inside it (the
/// two differ once tokens were evicted; see `Llama::forward`). The AVX-512 kernel takes a
/// range of keys; quantised K/V and CPUs without it take the portable kernel.
pub fn paged_attention_window(
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
    first_visible: &[usize],
) {
    paged_attention_window_with(
        Kernel::best(shape.head_dim),
        store,
        layer,
        shape,
        seqs,
        q,
        out,
        first_visible,
    )
}

/// [`paged_attention_window`] with a chosen kernel (tests compare them).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_window_with(
    kernel: Kernel,
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    out: &mut [f32],
    first_visible: &[usize],
) {
    for s in seqs {
        for i in 0..s.n_queries {
            assert!(
                first_visible[s.row_offset + i] <= s.stored_start + i,
                "a window must hold the query's own token"
            );
        }
    }
    let quant = matches!(store.layer(layer), LayerKv::Quant { .. });
    let kernel = if kernel == Kernel::Avx512 && !quant {
        Kernel::Avx512
    } else {
        Kernel::Scalar
    };
    attention_impl(
        kernel,
        store,
        layer,
        shape,
        seqs,
        q,
        (out, None),
        Some(first_visible),
    )
}

#[allow(clippy::too_many_arguments)]
fn attention_impl(
    kernel: Kernel,
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    q: &[f32],
    (out, lse): (&mut [f32], Option<&mut [f32]>),
    first_visible: Option<&[usize]>,
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
    assert!(
        lse.as_ref()
            .is_none_or(|l| l.len() >= n_rows * shape.n_heads),
        "lse shorter than the rows"
    );
    for s in seqs {
        if s.n_queries > 0 {
            let last = s.stored_start + s.n_queries - 1;
            assert!(
                last / store.geometry.block_size_tokens < s.block_table.len(),
                "block table shorter than stored tokens"
            );
        }
    }
    let kernel = match kernel {
        Kernel::Avx512 if !cfg!(target_arch = "x86_64") => Kernel::Scalar,
        k => k,
    };
    let head_visible = head_first_visible(store, layer, shape, seqs, first_visible);
    // Per-head bounds take the kernels that take a range of keys, as windows do.
    let quant = matches!(store.layer(layer), LayerKv::Quant { .. });
    let kernel = match (&head_visible, kernel) {
        (Some(_), Kernel::Avx512) if !quant => Kernel::Avx512,
        (Some(_), _) => Kernel::Scalar,
        (None, k) => k,
    };
    let group = shape.n_heads / shape.n_kv_heads;
    let row_keys: usize = seqs
        .iter()
        .map(|s| s.n_queries * group * shape.n_kv_heads * (s.stored_start + s.n_queries))
        .sum();
    let ptr = OutPtr(out.as_mut_ptr());
    let lse_ptr = lse.map(|l| OutPtr(l.as_mut_ptr()));
    TASKS.with_borrow_mut(|tasks| {
        tasks.clear();
        for (si, s) in seqs.iter().enumerate() {
            for kv_head in 0..shape.n_kv_heads {
                for t0 in (0..s.n_queries).step_by(QUERY_TILE_TOKENS) {
                    tasks.push(Task {
                        seq: si,
                        kv_head,
                        t0,
                        t1: (t0 + QUERY_TILE_TOKENS).min(s.n_queries),
                    });
                }
            }
        }
        // SAFETY: in both branches below, tasks write disjoint (row, head) slices of `out`,
        // whose length was checked above; block tables were checked to cover every visible
        // key.
        let run = |t: &Task| unsafe {
            let visible = match &head_visible {
                Some(per_head) => Some(per_head[t.kv_head].as_slice()),
                None => first_visible,
            };
            attend_task(
                kernel,
                store,
                layer,
                shape,
                &seqs[t.seq],
                t,
                q,
                (ptr, lse_ptr),
                visible,
            )
        };
        if rayon::current_num_threads() > 1 && tasks.len() > 1 && row_keys >= MIN_PARALLEL_ROW_KEYS
        {
            tasks.par_iter().for_each(run);
        } else {
            tasks.iter().for_each(run);
        }
    });
}

/// Each row's first visible stored index per KV head, where some sequence's heads start
/// at their own index (`AttnSeq::head_first_keys`, after a ragged eviction): the later of
/// the row's window bound and its head's first key. `None` when no sequence has any, so
/// that the common case allocates nothing.
fn head_first_visible(
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq],
    first_visible: Option<&[usize]>,
) -> Option<Vec<Vec<usize>>> {
    if seqs.iter().all(|s| s.head_first_keys.is_empty()) {
        return None;
    }
    let n_rows: usize = seqs
        .iter()
        .map(|s| s.row_offset + s.n_queries)
        .max()
        .unwrap_or(0);
    let n_kv = shape.n_kv_heads;
    assert_eq!(store.geometry.n_kv_heads, n_kv, "the store's KV heads");
    let per_head = (0..n_kv)
        .map(|h| {
            let mut rows = vec![0usize; n_rows];
            for s in seqs {
                let first_key = s
                    .head_first_keys
                    .get(layer * n_kv + h)
                    .map_or(0, |&k| k as usize);
                for i in 0..s.n_queries {
                    let r = s.row_offset + i;
                    let window = first_visible.map_or(0, |f| f[r]);
                    rows[r] = window.max(first_key);
                    assert!(
                        rows[r] <= s.stored_start + i,
                        "a head's first key must come before the query's own token"
                    );
                }
            }
            rows
        })
        .collect();
    Some(per_head)
}

/// One sequence's rows against one KV head with the AVX2 kernel, written into `out`: the
/// task `paged_attention` would run for them (`kernels::split_attn` spreads these over the
/// decode pool).
///
/// # Safety
/// `out` must hold every row of `s`, and no other caller may write this (sequence, KV head)
/// at the same time.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn attend_seq_kv_head(
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    s: &AttnSeq,
    kv_head: usize,
    q: &[f32],
    out: *mut f32,
) {
    if s.n_queries == 0 {
        return;
    }
    assert!(
        (s.stored_start + s.n_queries - 1) / store.geometry.block_size_tokens < s.block_table.len(),
        "block table shorter than stored tokens"
    );
    let t = Task {
        seq: 0,
        kv_head,
        t0: 0,
        t1: s.n_queries,
    };
    attend_task(
        Kernel::Avx2,
        store,
        layer,
        shape,
        s,
        &t,
        q,
        (OutPtr(out), None),
        None,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::dot_f32;
    use crate::kv_store::{KvDtype, KvGeometry};
    use rand::{Rng, SeedableRng};

    /// Naive attention over contiguous K/V, the reference for the paged kernel.
    fn naive(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], hd: usize) -> Vec<f32> {
        let scale = 1.0 / (hd as f32).sqrt();
        let mut s: Vec<f32> = k.iter().map(|kk| dot_f32(q, kk) * scale).collect();
        crate::kernels::softmax_in_place(&mut s);
        let mut out = vec![0f32; hd];
        for (p, vv) in s.iter().zip(v) {
            for (o, x) in out.iter_mut().zip(vv) {
                *o += p * x;
            }
        }
        out
    }

    /// Every kernel this CPU can run for head size `hd`.
    fn kernels(hd: usize) -> Vec<Kernel> {
        let mut ks = vec![Kernel::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if attn::x86_supported(hd) {
                ks.push(Kernel::Avx2);
            }
            if attn512::supported(hd) {
                ks.push(Kernel::Avx512);
            }
        }
        ks
    }

    #[test]
    fn paged_matches_naive_with_scrambled_blocks() {
        for (n_heads, n_kv, hd, bs, n_tokens, n_q) in [
            (4, 2, 8, 4, 40, 37),
            (9, 3, 64, 16, 37, 37),
            (9, 3, 64, 1, 37, 37),
            (9, 3, 64, 64, 37, 37),
            (9, 3, 64, 8, 70, 3),
            (8, 2, 128, 16, 150, 150),
            // Blocks of 12: the AVX2 kernel's chunk of five blocks is 60 slots, padded.
            (8, 2, 128, 12, 150, 150),
            (8, 2, 128, 128, 150, 2),
            (4, 1, 256, 16, 70, 70),
            (4, 1, 256, 16, 70, 1),
            // Past `tile::RANGED_MIN_KEYS` stored keys: the ranged walk (`ranged`).
            (8, 2, 128, 16, 1300, 40),
            (9, 3, 64, 32, 1100, 9),
            (4, 1, 256, 16, 1030, 5),
        ] {
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8, KvDtype::Q4] {
                if dtype.quant_bits().is_some() && hd % 32 != 0 {
                    continue;
                }
                check_paged(dtype, n_heads, n_kv, hd, bs, n_tokens, n_q);
            }
        }
    }

    /// `paged_attention_lse` gives each row's log-sum-exp of its scaled scores where the
    /// AVX-512 kernel runs it (f16 and f32 stores, short and ranged walks) and the same
    /// outputs as `paged_attention`; elsewhere it leaves the NaN the caller wrote.
    #[test]
    fn lse_is_the_log_sum_exp_of_each_rows_scores() {
        for (n_heads, n_kv, hd, bs, n_tokens, n_q) in [
            (9, 3, 64, 16, 37, 37),
            (8, 2, 128, 16, 1300, 40),
            (9, 3, 64, 16, 1100, 9),
        ] {
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
                let case = Case::new(5, dtype, (n_heads, n_kv, hd), bs, n_tokens, n_q);
                let (store, ks, q, start) = (&case.store, &case.ks, &case.q, case.start);
                let (seq, shape) = (case.seq(), case.shape);
                let (mut out, mut want_out) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                let mut lse = vec![f32::NAN; n_q * n_heads];
                paged_attention_lse(store, 0, shape, &[seq], q, &mut out, &mut lse);
                paged_attention(store, 0, shape, &[seq], q, &mut want_out);
                assert_eq!(out, want_out, "{dtype:?}: outputs");
                let computed = Kernel::best(hd) == Kernel::Avx512 && dtype.quant_bits().is_none();
                if !computed {
                    assert!(lse.iter().all(|x| x.is_nan()), "{dtype:?}: written");
                    eprintln!("lse_is_…: {dtype:?} head_dim {hd}: no AVX-512 kernel here");
                    continue;
                }
                let scale = 1.0 / (hd as f32).sqrt();
                for i in 0..n_q {
                    for h in 0..n_heads {
                        let kvh = h / (n_heads / n_kv);
                        let qrow = &q[(i * n_heads + h) * hd..(i * n_heads + h + 1) * hd];
                        let s: Vec<f64> = ks[kvh][..start + i + 1]
                            .iter()
                            .map(|k| (dot_f32(qrow, k) * scale) as f64)
                            .collect();
                        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let want = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                        let got = lse[i * n_heads + h] as f64;
                        assert!(
                            (got - want).abs() < 1e-4,
                            "{dtype:?} {i} {h}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// A sliding window: each query row attends to exactly its last `w` stored tokens,
    /// across block boundaries, for windows shorter and longer than the context, and for
    /// head_dim 256 (Gemma 3).
    #[test]
    fn windowed_attention_matches_naive_over_the_last_tokens() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (n_heads, n_kv, hd, bs, n_tokens, n_q, w) in [
            (4usize, 1usize, 256usize, 4usize, 23usize, 23usize, 5usize),
            (4, 1, 256, 16, 90, 90, 37),
            (4, 2, 64, 16, 130, 40, 50),
            (4, 2, 128, 32, 100, 100, 17),
            (4, 2, 128, 16, 1200, 40, 300),
            (4, 2, 64, 16, 1100, 20, 700),
            (4, 2, 8, 4, 40, 9, 7),
            (4, 2, 8, 16, 40, 40, 16),
            (2, 1, 8, 4, 12, 12, 100),
        ] {
            let num_blocks = n_tokens.div_ceil(bs) + 1;
            let g = KvGeometry {
                n_layers: 1,
                n_kv_heads: n_kv,
                head_dim: hd,
                block_size_tokens: bs,
                num_blocks,
            };
            let mut store = KvStore::new(g, KvDtype::F32);
            let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
            let mut ks = vec![vec![vec![0f32; hd]; n_tokens]; n_kv];
            let mut vs = ks.clone();
            for t in 0..n_tokens {
                let k: Vec<f32> = (0..n_kv * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let v: Vec<f32> = (0..n_kv * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
                store.write_token(0, table[t / bs], t % bs, &k, &v);
                for h in 0..n_kv {
                    ks[h][t] = k[h * hd..(h + 1) * hd].to_vec();
                    vs[h][t] = v[h * hd..(h + 1) * hd].to_vec();
                }
            }
            let q_dim = n_heads * hd;
            let q: Vec<f32> = (0..n_q * q_dim).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let shape = AttnShape {
                n_heads,
                n_kv_heads: n_kv,
                head_dim: hd,
            };
            let seq = AttnSeq {
                block_table: &table,
                stored_start: n_tokens - n_q,
                n_queries: n_q,
                row_offset: 0,
                head_first_keys: &[],
            };
            let first: Vec<usize> = (0..n_q)
                .map(|i| (n_tokens - n_q + i + 1).saturating_sub(w))
                .collect();
            for kernel in kernels(hd) {
                let mut out = vec![0f32; n_q * q_dim];
                paged_attention_window_with(kernel, &store, 0, shape, &[seq], &q, &mut out, &first);
                for i in 0..n_q {
                    let end = n_tokens - n_q + i + 1;
                    let lo = end.saturating_sub(w);
                    for h in 0..n_heads {
                        let kvh = h / (n_heads / n_kv);
                        let want = naive(
                            &q[i * q_dim + h * hd..i * q_dim + (h + 1) * hd],
                            &ks[kvh][lo..end],
                            &vs[kvh][lo..end],
                            hd,
                        );
                        let got = &out[i * q_dim + h * hd..i * q_dim + (h + 1) * hd];
                        for (a, b) in got.iter().zip(&want) {
                            assert!(
                                (a - b).abs() < 1e-4,
                                "{kernel:?} hd {hd} w {w} row {i} head {h}: {a} vs {b}"
                            );
                        }
                    }
                    // The row alone (a decode step) has the same bits as in the batch.
                    let one = AttnSeq {
                        stored_start: end - 1,
                        n_queries: 1,
                        ..seq
                    };
                    let mut o1 = vec![0f32; q_dim];
                    paged_attention_window_with(
                        kernel,
                        &store,
                        0,
                        shape,
                        &[one],
                        &q[i * q_dim..(i + 1) * q_dim],
                        &mut o1,
                        &first[i..i + 1],
                    );
                    assert_eq!(
                        o1,
                        out[i * q_dim..(i + 1) * q_dim],
                        "{kernel:?} row {i} alone vs batched"
                    );
                }
            }
        }
    }

    /// After a ragged eviction each KV head starts at its own stored index: every kernel
    /// matches naive attention over that head's keys from its first key on, a row alone
    /// (a decode step) has the batch's bits, and the decode pool's split path leaves such
    /// sequences to this one.
    #[test]
    fn head_first_keys_hide_each_heads_leading_slots() {
        for (n_heads, n_kv, hd, bs, n_tokens, n_q, firsts) in [
            (
                4usize,
                2usize,
                64usize,
                16usize,
                100usize,
                20usize,
                vec![0u32, 37],
            ),
            (9, 3, 64, 8, 70, 1, vec![5, 0, 60]),
            (8, 2, 128, 16, 1300, 24, vec![900, 12]),
            (4, 1, 256, 16, 1030, 3, vec![1000]),
        ] {
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
                let mut rng = rand::rngs::StdRng::seed_from_u64(5);
                let (store, table, ks, vs) = filled_store(&mut rng, dtype, n_kv, hd, bs, n_tokens);
                let start = n_tokens - n_q;
                let q: Vec<f32> = (0..n_q * n_heads * hd)
                    .map(|_| rng.gen_range(-2.0..2.0))
                    .collect();
                let seq = AttnSeq {
                    block_table: &table,
                    stored_start: start,
                    n_queries: n_q,
                    row_offset: 0,
                    head_first_keys: &firsts,
                };
                let shape = AttnShape {
                    n_heads,
                    n_kv_heads: n_kv,
                    head_dim: hd,
                };
                let q_dim = n_heads * hd;
                let mut out = vec![0f32; q.len()];
                for kernel in kernels(hd) {
                    paged_attention_with(kernel, &store, 0, shape, &[seq], &q, &mut out);
                    for i in 0..n_q {
                        for h in 0..n_heads {
                            let kvh = h / (n_heads / n_kv);
                            let lo = firsts[kvh] as usize;
                            let row = i * q_dim + h * hd..i * q_dim + (h + 1) * hd;
                            let end = start + i + 1;
                            let want =
                                naive(&q[row.clone()], &ks[kvh][lo..end], &vs[kvh][lo..end], hd);
                            for (a, b) in want.iter().zip(&out[row]) {
                                assert!(
                                    (a - b).abs() < 1e-4,
                                    "{dtype:?} {kernel:?} row {i} head {h}: {a} vs {b}"
                                );
                            }
                        }
                    }
                    let what = format!("{dtype:?} {kernel:?} ragged");
                    assert_rows_alone_match(kernel, &store, shape, &seq, &q, &out, &what);
                }
                let mut split_out = vec![0f32; q.len()];
                assert!(!crate::kernels::split_attention(
                    &store,
                    0,
                    shape,
                    &[seq],
                    &q,
                    &mut split_out
                ));
            }
        }
    }

    /// Checks every kernel against naive attention, then that each query row has the same
    /// bits computed alone (as in a decode step) as in the whole batch (as in prefill).
    fn check_paged(
        dtype: KvDtype,
        n_heads: usize,
        n_kv: usize,
        hd: usize,
        bs: usize,
        n_tokens: usize,
        n_q: usize,
    ) {
        let case = Case::new(7, dtype, (n_heads, n_kv, hd), bs, n_tokens, n_q);
        let (store, ks, vs, q, start) = (&case.store, &case.ks, &case.vs, &case.q, case.start);
        let (seq, shape) = (case.seq(), case.shape);
        let mut out = vec![0f32; q.len()];
        for kernel in kernels(hd) {
            paged_attention_with(kernel, store, 0, shape, &[seq], q, &mut out);
            for i in 0..n_q {
                for h in 0..n_heads {
                    let kvh = h / (n_heads / n_kv);
                    let qrow = &q[(i * n_heads + h) * hd..(i * n_heads + h + 1) * hd];
                    let want = naive(
                        qrow,
                        &ks[kvh][..start + i + 1],
                        &vs[kvh][..start + i + 1],
                        hd,
                    );
                    let got = &out[(i * n_heads + h) * hd..(i * n_heads + h + 1) * hd];
                    for (a, b) in want.iter().zip(got) {
                        assert!(
                            (a - b).abs() < 1e-4,
                            "{dtype:?} {kernel:?} bs {bs} token {i} head {h}: {a} vs {b}"
                        );
                    }
                }
            }
            let what = format!("{dtype:?} {kernel:?} bs {bs}");
            assert_rows_alone_match(kernel, store, shape, &seq, q, &out, &what);
        }
    }

    /// A one-layer store of `n_tokens` random tokens and random queries for its last `n_q`
    /// tokens ("new" queries, causal among themselves), from one seed.
    struct Case {
        store: KvStore,
        table: Vec<u32>,
        ks: Vec<Vec<Vec<f32>>>,
        vs: Vec<Vec<Vec<f32>>>,
        q: Vec<f32>,
        start: usize,
        shape: AttnShape,
    }

    impl Case {
        fn new(
            seed: u64,
            dtype: KvDtype,
            (n_heads, n_kv, hd): (usize, usize, usize),
            bs: usize,
            n_tokens: usize,
            n_q: usize,
        ) -> Case {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let (store, table, ks, vs) = filled_store(&mut rng, dtype, n_kv, hd, bs, n_tokens);
            let q: Vec<f32> = (0..n_q * n_heads * hd)
                .map(|_| rng.gen_range(-2.0..2.0))
                .collect();
            let shape = AttnShape {
                n_heads,
                n_kv_heads: n_kv,
                head_dim: hd,
            };
            let start = n_tokens - n_q;
            Case {
                store,
                table,
                ks,
                vs,
                q,
                start,
                shape,
            }
        }

        fn seq(&self) -> AttnSeq<'_> {
            AttnSeq {
                block_table: &self.table,
                stored_start: self.start,
                n_queries: self.q.len() / (self.shape.n_heads * self.shape.head_dim),
                row_offset: 0,
                head_first_keys: &[],
            }
        }
    }

    /// Each query row of `seq`, computed alone (as in a decode step), has the same bits as
    /// in the batch's `out`.
    fn assert_rows_alone_match(
        kernel: Kernel,
        store: &KvStore,
        shape: AttnShape,
        seq: &AttnSeq,
        q: &[f32],
        out: &[f32],
        what: &str,
    ) {
        let q_dim = shape.n_heads * shape.head_dim;
        for i in 0..seq.n_queries {
            let alone = AttnSeq {
                stored_start: seq.stored_start + i,
                n_queries: 1,
                ..*seq
            };
            let mut one = vec![0f32; q_dim];
            let qi = &q[i * q_dim..(i + 1) * q_dim];
            paged_attention_with(kernel, store, 0, shape, &[alone], qi, &mut one);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&one),
                bits(&out[i * q_dim..(i + 1) * q_dim]),
                "{what}: token {i} alone differs"
            );
        }
    }

    /// K/V per (KV head, token) as one layer's store holds them, after writing `n_tokens`
    /// random tokens through a shuffled block table, which it returns.
    #[allow(clippy::type_complexity)]
    fn filled_store(
        rng: &mut rand::rngs::StdRng,
        dtype: KvDtype,
        n_kv: usize,
        hd: usize,
        bs: usize,
        n_tokens: usize,
    ) -> (KvStore, Vec<u32>, Vec<Vec<Vec<f32>>>, Vec<Vec<Vec<f32>>>) {
        let num_blocks = n_tokens.div_ceil(bs) + 3;
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: n_kv,
            head_dim: hd,
            block_size_tokens: bs,
            num_blocks,
        };
        let mut store = KvStore::new(g, dtype);
        // Values exactly representable in the store, so the reference sees what it holds.
        let value = |rng: &mut rand::rngs::StdRng| {
            let x: f32 = rng.gen_range(-1.0..1.0);
            if dtype == KvDtype::F16 {
                half::f16::from_f32(x).to_f32()
            } else {
                x
            }
        };
        let mut table: Vec<u32> = (0..num_blocks as u32).collect();
        table.reverse();
        table.swap(0, 2);
        let mut ks = vec![vec![vec![0f32; hd]; n_tokens]; n_kv];
        let mut vs = ks.clone();
        for t in 0..n_tokens {
            let k: Vec<f32> = (0..n_kv * hd).map(|_| value(rng)).collect();
            let v: Vec<f32> = (0..n_kv * hd).map(|_| value(rng)).collect();
            store.write_token(0, table[t / bs], t % bs, &k, &v);
            for h in 0..n_kv {
                ks[h][t] = k[h * hd..(h + 1) * hd].to_vec();
                vs[h][t] = v[h * hd..(h + 1) * hd].to_vec();
            }
        }
        // The reference attends over what the store holds: quantised K/V dequantised by
        // the store's scalar code (exact for f16/f32, whose values were made representable).
        let mut buf = vec![0f32; bs * hd];
        for h in 0..n_kv {
            for t in 0..n_tokens {
                store.read_k(0, table[t / bs], h, &mut buf[..(t % bs + 1) * hd]);
                ks[h][t].copy_from_slice(&buf[(t % bs) * hd..(t % bs + 1) * hd]);
                store.read_v(0, table[t / bs], h, &mut buf[..(t % bs + 1) * hd]);
                vs[h][t].copy_from_slice(&buf[(t % bs) * hd..(t % bs + 1) * hd]);
            }
        }
        (store, table, ks, vs)
    }
}
