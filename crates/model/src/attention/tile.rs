//! One task's work: a tile of one sequence's query tokens against one KV head, on the
//! AVX-512 kernel straight from the store, or block by block over f32 scratch copies with
//! an online softmax (the AVX2 kernel, or the portable one).

use super::{AttnSeq, AttnShape, Kernel, OutPtr, Task};
use crate::kernels::dot_f32;
#[cfg(target_arch = "x86_64")]
use crate::kernels::{attn, attn512, attn512q};
use crate::kv_store::KvStore;
#[cfg(target_arch = "x86_64")]
use crate::kv_store::LayerKv;

/// Computes one task's rows into `out`, and with `lse` each row's log-sum-exp into
/// `lse[row][head]` (the AVX-512 kernel only; the others leave it as it was).
///
/// # Safety
/// `out` must hold every row of `s`, `lse` (if given) `n_heads` floats per row, and no
/// other task may write this (tile, KV head).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend_task(
    kernel: Kernel,
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    s: &AttnSeq,
    t: &Task,
    q: &[f32],
    (out, lse): (OutPtr, Option<OutPtr>),
    first_visible: Option<&[usize]>,
) {
    debug_assert!(
        first_visible.is_none() || kernel != Kernel::Avx2,
        "windows run on the AVX-512 or the portable kernel"
    );
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Avx512 {
        // SAFETY: the caller's contract is this function's.
        unsafe { attend_task_avx512(store, layer, shape, s, t, q, (out, lse), first_visible) };
        return;
    }
    let tile = TileQuery {
        store,
        layer,
        shape,
        s,
        kvh: t.kv_head,
        t0: t.t0,
        t1: t.t1,
        q,
        first_visible,
    };
    SCRATCH.with_borrow_mut(|st| {
        tile.attend(kernel == Kernel::Avx2, st);
        let hd = shape.head_dim;
        let group = shape.n_heads / shape.n_kv_heads;
        for (ti, tok) in (t.t0..t.t1).enumerate() {
            for g in 0..group {
                let src = &st.acc[(ti * group + g) * hd..(ti * group + g + 1) * hd];
                let at = row_at(shape, s, t.kv_head, tok, g);
                // SAFETY: `out` holds every row of `s`; this task alone writes its head's
                // slice.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), out.0.add(at), hd) };
            }
        }
    });
}

thread_local! {
    /// Each thread's tile scratch, reused from task to task: a task's fresh buffers (about
    /// 160 KiB for 32 tokens × 6 heads of 128) were zeroed pages from the OS or a memset
    /// each time, 2.3 % of an 8K prefill's samples (perf, AVX2 host).
    static SCRATCH: std::cell::RefCell<TileState> = const {
        std::cell::RefCell::new(TileState {
            m: Vec::new(),
            l: Vec::new(),
            acc: Vec::new(),
            kbuf: Vec::new(),
            vbuf: Vec::new(),
            scores: Vec::new(),
            kt: Vec::new(),
        })
    };
}

/// The offset in `q` / `out` of query token `tok`'s head `g` of KV head `kvh`'s group.
fn row_at(shape: AttnShape, s: &AttnSeq, kvh: usize, tok: usize, g: usize) -> usize {
    lse_at(shape, s, kvh, tok, g) * shape.head_dim
}

/// The offset in `lse` (`[row][head]`) of query token `tok`'s head `g` of KV head `kvh`.
fn lse_at(shape: AttnShape, s: &AttnSeq, kvh: usize, tok: usize, g: usize) -> usize {
    let group = shape.n_heads / shape.n_kv_heads;
    (s.row_offset + tok) * shape.n_heads + kvh * group + g
}

/// From this many stored keys, a task's rows walk the keys range by range
/// (`ranged::attend_rows_ranged`) instead of each batch of rows walking all of them.
#[cfg(target_arch = "x86_64")]
const RANGED_MIN_KEYS: usize = 1024;

/// The AVX-512 kernel over one task: rows of (token, group head) handed over in batches
/// of `attn512::max_rows`, K/V read in place (f16 widened in registers, or quantised).
///
/// # Safety
/// As for `attend_task`; the CPU has AVX-512 (the caller chose `Kernel::Avx512`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_task_avx512(
    store: &KvStore,
    layer: usize,
    shape: AttnShape,
    s: &AttnSeq,
    t: &Task,
    q: &[f32],
    (out, lse): (OutPtr, Option<OutPtr>),
    first_visible: Option<&[usize]>,
) {
    let hd = shape.head_dim;
    let lse_of = |tok: usize, g: usize| {
        lse.map_or(std::ptr::null_mut(), |p| {
            p.0.add(lse_at(shape, s, t.kv_head, tok, g))
        })
    };
    let group = shape.n_heads / shape.n_kv_heads;
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
    let g = &store.geometry;
    let mut kv = attn512::HeadKv {
        k,
        v,
        f16,
        block_table: s.block_table,
        n_kv_heads: g.n_kv_heads,
        kv_head: t.kv_head,
        block_size: g.block_size_tokens,
        head_dim: hd,
        prefetch: true,
    };
    debug_assert!(
        quant.is_some() || store.head_offset(1, 0) == g.n_kv_heads * g.block_size_tokens * hd
    );
    let scale = 1.0 / (hd as f32).sqrt();
    // `kv` describes the store's layer and the rows point into `q` and this task's slices
    // of `out` (the caller's contract).
    let attend = |kv: &attn512::HeadKv, rows: &[attn512::Row]| match &quant {
        None => attn512::attend(kv, rows, scale),
        Some(layout) => attn512q::attend(kv, layout, rows, scale),
    };
    let max_rows = attn512::max_rows(hd);
    let n_rows = (t.t1 - t.t0) * group;
    if quant.is_none() && s.stored_start + t.t1 >= RANGED_MIN_KEYS && n_rows > max_rows {
        let rows: Vec<attn512::Row> = (t.t0..t.t1)
            .flat_map(|tok| (0..group).map(move |g| (tok, g)))
            .map(|(tok, g)| {
                let at = row_at(shape, s, t.kv_head, tok, g);
                attn512::Row {
                    q: q.as_ptr().add(at),
                    out: out.0.add(at),
                    first_visible: first_visible.map_or(0, |f| f[s.row_offset + tok]),
                    n_visible: s.stored_start + tok + 1,
                    lse: lse_of(tok, g),
                }
            })
            .collect();
        kv.prefetch = false;
        super::ranged::attend_rows_ranged(&kv, &rows, max_rows, scale);
        return;
    }
    let mut rows = [attn512::Row::EMPTY; 4];
    let mut n = 0;
    for tok in t.t0..t.t1 {
        for g in 0..group {
            let at = row_at(shape, s, t.kv_head, tok, g);
            rows[n] = attn512::Row {
                q: q.as_ptr().add(at),
                out: out.0.add(at),
                first_visible: first_visible.map_or(0, |f| f[s.row_offset + tok]),
                n_visible: s.stored_start + tok + 1,
                lse: lse_of(tok, g),
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
}

/// A tile of query tokens `t0..t1` of one sequence against KV head `kvh`.
pub(super) struct TileQuery<'a> {
    pub store: &'a KvStore,
    pub layer: usize,
    pub shape: AttnShape,
    pub s: &'a AttnSeq<'a>,
    pub kvh: usize,
    pub t0: usize,
    pub t1: usize,
    pub q: &'a [f32],
    /// Per batch row, the first stored index it sees (a sliding window); None: all.
    pub first_visible: Option<&'a [usize]>,
}

/// The online softmax's state per (token, group head) row, and the block scratch.
pub(super) struct TileState {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    scores: Vec<f32>,
    /// K transposed (`[d][slot]`, slots padded to 8) for the AVX2 kernel; empty otherwise.
    kt: Vec<f32>,
}

impl TileState {
    /// Sizes the scratch for a tile of `n_rows` rows and starts every row's softmax afresh
    /// (m = -inf, l = 0, acc = 0); the block buffers keep stale values, which every read
    /// overwrites first (the AVX2 kernel's padding lanes are masked out).
    fn reset(&mut self, n_rows: usize, hd: usize, bs: usize, simd: bool) {
        let refill = |v: &mut Vec<f32>, n: usize, x: f32| {
            v.clear();
            v.resize(n, x);
        };
        refill(&mut self.m, n_rows, f32::NEG_INFINITY);
        refill(&mut self.l, n_rows, 0.0);
        refill(&mut self.acc, n_rows * hd, 0.0);
        let grow = |v: &mut Vec<f32>, n: usize| {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        };
        let chunk = chunk_blocks(bs, simd) * bs;
        grow(&mut self.kbuf, bs * hd);
        grow(&mut self.vbuf, chunk * hd);
        grow(&mut self.scores, bs);
        if simd {
            grow(&mut self.kt, hd * chunk.next_multiple_of(8));
        }
    }
}

impl TileQuery<'_> {
    fn group(&self) -> usize {
        self.shape.n_heads / self.shape.n_kv_heads
    }

    fn q_row(&self, t: usize, h: usize) -> &[f32] {
        let (hd, q_dim) = (
            self.shape.head_dim,
            self.shape.n_heads * self.shape.head_dim,
        );
        let at = (self.s.row_offset + t) * q_dim + h * hd;
        &self.q[at..at + hd]
    }

    /// Computes the tile's outputs into `st.acc`: `(t1 - t0) × group` rows of `head_dim`,
    /// in (token, head) order. `st` is scratch: whatever it held is overwritten.
    pub fn attend(&self, simd: bool, st: &mut TileState) {
        let hd = self.shape.head_dim;
        let bs = self.store.geometry.block_size_tokens;
        let n_rows = (self.t1 - self.t0) * self.group();
        #[cfg(target_arch = "x86_64")]
        let simd = simd && attn::x86_supported(hd);
        #[cfg(not(target_arch = "x86_64"))]
        let simd = false;
        debug_assert!(
            self.first_visible.is_none() || !simd,
            "windows run on the portable kernel"
        );
        st.reset(n_rows, hd, bs, simd);
        let last_visible = self.s.stored_start + self.t1 - 1;
        let n_blocks = last_visible / bs + 1;
        debug_assert!(
            n_blocks <= self.s.block_table.len(),
            "block table shorter than stored tokens"
        );
        if simd {
            // The AVX2 kernel takes no window (`first_visible` is None): chunks start at block
            // 0, so a stored token falls in the same chunk whichever tile or step reads it.
            #[cfg(target_arch = "x86_64")]
            for b0 in (0..n_blocks).step_by(chunk_blocks(bs, true)) {
                let nb = chunk_blocks(bs, true).min(n_blocks - b0);
                self.chunk_avx2(st, b0, nb, n_blocks);
            }
        } else {
            for b in self.first_visible(self.t0) / bs..n_blocks {
                let n_valid = bs.min(last_visible + 1 - b * bs);
                self.block_portable(st, b, n_valid);
            }
        }
        for (a, &l) in st.acc.chunks_exact_mut(hd).zip(&st.l) {
            let inv = 1.0 / l;
            a.iter_mut().for_each(|x| *x *= inv);
        }
    }

    /// The first stored index query token `t` sees (0 without a window).
    fn first_visible(&self, t: usize) -> usize {
        self.first_visible.map_or(0, |f| f[self.s.row_offset + t])
    }

    /// Blocks `b0..b0 + nb` side by side through the AVX2 kernel, `attn::ROWS` rows at a
    /// time: one online-softmax step per row for the whole chunk.
    #[cfg(target_arch = "x86_64")]
    fn chunk_avx2(&self, st: &mut TileState, b0: usize, nb: usize, n_blocks: usize) {
        let (hd, group) = (self.shape.head_dim, self.group());
        let bs = self.store.geometry.block_size_tokens;
        let last_visible = self.s.stored_start + self.t1 - 1;
        let (slot0, n_valid) = (b0 * bs, (nb * bs).min(last_visible + 1 - b0 * bs));
        let sp = (nb * bs).next_multiple_of(8);
        self.load_chunk_avx2(st, b0, nb, sp, n_blocks);
        let blk = attn::BlockF32 {
            kt: &st.kt,
            v: &st.vbuf,
            slots_padded: sp,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let mut rows = Vec::with_capacity(attn::ROWS);
        let states =
            st.m.iter_mut()
                .zip(st.l.iter_mut())
                .zip(st.acc.chunks_mut(hd));
        for (r, ((m, l), a)) in states.enumerate() {
            let t = self.t0 + r / group;
            let visible_end = self.s.stored_start + t + 1;
            if visible_end <= slot0 {
                continue;
            }
            rows.push(attn::RowState {
                q: self.q_row(t, self.kvh * group + r % group),
                n_visible: n_valid.min(visible_end - slot0),
                m,
                l,
                acc: a,
            });
            if rows.len() == attn::ROWS {
                // SAFETY: x86_supported(hd) was checked; kt/v hold this chunk.
                unsafe { attn::update_x86(&mut rows, &blk, hd, scale) };
                rows.clear();
            }
        }
        if !rows.is_empty() {
            // SAFETY: as above, x86_supported(hd) was checked; kt/v hold this chunk.
            unsafe { attn::update_x86(&mut rows, &blk, hd, scale) };
        }
    }

    /// Blocks `b0..b0 + nb`'s K (transposed, `kt[d * sp + slot]`: one vector load then gives
    /// a dimension of 8 keys) and V (`vbuf[slot][d]`) as f32 into the scratch, block `i`'s
    /// slots at `i * bs` of the chunk. An f16 block whose size is a multiple of 8 is already
    /// laid out so (`[d][slot]`) and is widened row by row.
    #[cfg(target_arch = "x86_64")]
    fn load_chunk_avx2(
        &self,
        st: &mut TileState,
        b0: usize,
        nb: usize,
        sp: usize,
        n_blocks: usize,
    ) {
        let (store, layer, kvh, hd) = (self.store, self.layer, self.kvh, self.shape.head_dim);
        let bs = store.geometry.block_size_tokens;
        let last_visible = self.s.stored_start + self.t1 - 1;
        let f16 = match store.layer(layer) {
            LayerKv::F16 { k, v } if bs.is_multiple_of(8) && is_x86_feature_detected!("f16c") => {
                Some((k, v))
            }
            _ => None,
        };
        for i in 0..nb {
            let (b, col) = (b0 + i, i * bs);
            let block = self.s.block_table[b];
            let n_valid = bs.min(last_visible + 1 - b * bs);
            let vdst = &mut st.vbuf[col * hd..(col + n_valid) * hd];
            let Some((k, v)) = f16 else {
                store.read_v(layer, block, kvh, vdst);
                store.read_k_transposed(layer, block, kvh, sp, &mut st.kt[col..]);
                continue;
            };
            // Blocks are scattered, which defeats the hardware prefetcher on a decode step's
            // one pass over them from DRAM: ask for the block a chunk ahead (about one DRAM
            // latency of work), as `attn512` does.
            if let Some(&ahead) = self.s.block_table[..n_blocks].get(b + nb.max(2)) {
                let at = store.head_offset(ahead, kvh);
                attn::prefetch(&k[at..at + hd * bs]);
                attn::prefetch(&v[at..at + hd * bs]);
            }
            let off = store.head_offset(block, kvh);
            // SAFETY: F16C was detected and bs is a multiple of 8; kt holds hd rows of sp ≥
            // nb × bs floats and vbuf nb × bs rows of hd.
            unsafe {
                attn::f16_rows_to_f32_x86(&k[off..off + hd * bs], hd, bs, &mut st.kt[col..], sp);
                attn::f16_to_f32_x86(&v[off..off + n_valid * hd], vdst);
            }
        }
    }

    /// One block through the portable kernel: scalar scores, then the online softmax.
    fn block_portable(&self, st: &mut TileState, b: usize, n_valid: usize) {
        let (hd, group) = (self.shape.head_dim, self.group());
        let bs = self.store.geometry.block_size_tokens;
        let block = self.s.block_table[b];
        self.store
            .read_v(self.layer, block, self.kvh, &mut st.vbuf[..n_valid * hd]);
        self.store
            .read_k(self.layer, block, self.kvh, &mut st.kbuf[..n_valid * hd]);
        let scale = 1.0 / (hd as f32).sqrt();
        for t in self.t0..self.t1 {
            let visible_end = self.s.stored_start + t + 1; // exclusive
            if visible_end <= b * bs {
                continue;
            }
            let n_vis = n_valid.min(visible_end - b * bs);
            let j0 = self.first_visible(t).saturating_sub(b * bs);
            if j0 >= n_vis {
                continue;
            }
            for g in 0..group {
                let qrow = self.q_row(t, self.kvh * group + g);
                let mut block_max = f32::NEG_INFINITY;
                for j in j0..n_vis {
                    let sc = dot_f32(qrow, &st.kbuf[j * hd..(j + 1) * hd]) * scale;
                    st.scores[j] = sc;
                    block_max = block_max.max(sc);
                }
                let r = (t - self.t0) * group + g;
                online_softmax_update(st, r, hd, j0..n_vis, block_max);
            }
        }
    }
}

/// Slots per chunk the AVX2 kernel takes at once: its online softmax (running maximum,
/// rescaling, sums) and its p·V accumulators' loads and stores happen once per chunk, and
/// once per 16-slot block they were about a quarter of an 8K prefill's attention (perf,
/// AVX2 host). 64 slots of K and V in f32 are 32 KiB each, read from L2.
const CHUNK_SLOTS: usize = 64;

/// Blocks per chunk: as many whole blocks as fit [`CHUNK_SLOTS`] (at least one); the
/// portable kernel takes one block at a time.
fn chunk_blocks(block_size_tokens: usize, simd: bool) -> usize {
    if simd {
        (CHUNK_SLOTS / block_size_tokens).max(1)
    } else {
        1
    }
}

/// Folds keys `js` of the block in scratch (scores in `st.scores`) into row `r`'s state.
fn online_softmax_update(
    st: &mut TileState,
    r: usize,
    hd: usize,
    js: std::ops::Range<usize>,
    block_max: f32,
) {
    let m_new = st.m[r].max(block_max);
    let correction = (st.m[r] - m_new).exp();
    let a = &mut st.acc[r * hd..(r + 1) * hd];
    if correction != 1.0 {
        a.iter_mut().for_each(|x| *x *= correction);
    }
    let mut sum = st.l[r] * correction;
    for j in js {
        let p = (st.scores[j] - m_new).exp();
        sum += p;
        for (x, &vv) in a.iter_mut().zip(&st.vbuf[j * hd..(j + 1) * hd]) {
            *x += p * vv;
        }
    }
    st.l[r] = sum;
    st.m[r] = m_new;
}
