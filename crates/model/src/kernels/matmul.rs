//! Matrix multiplication of quantised weights by f32 activations.
//!
//! `out[t][r] = Σ_c W[r][c] · x[t][c]` for a weight matrix W stored row-major in one of
//! the GGML block formats (each row a whole number of blocks). The reference path
//! dequantises one weight row at a time into a small buffer and reuses it for every
//! token of the batch, so a batch of n tokens reads the weights once.

use std::cell::Cell;

use pk_gguf::{dequantize, GgmlType};
use rayon::prelude::*;

use super::ops::dot_f32;
use super::pack::{self, Packed, GROUP_ROWS};
use super::q8::{self, Q8Acts};
#[cfg(target_arch = "x86_64")]
use super::x86;

/// A weight matrix in a GGML block format: `rows` output features of `cols` inputs each.
///
/// Formats with an integer SIMD kernel (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, and Q6S, the 6-bit
/// format Q6_K is converted to at load) are repacked at load into row groups ([`Packed`]) and the
/// GGUF copy is dropped; rows are restored exactly on demand (for Q6S, in its own block
/// encoding, which no file holds). Q6S runs directly rather than as Q8_0 because decode is
/// bound by the bytes it reads: 7 bits a weight instead of 8.5, and no requantisation.
#[derive(Clone)]
pub struct QMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    storage: Storage,
}

#[derive(Clone)]
enum Storage {
    Gguf(Vec<u8>),
    Packed(Packed),
}

/// `ty`'s packed layout of `data` (rows × cols), or `None` for a format without one.
fn pack(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Packed> {
    let row_bytes = ty
        .row_bytes(cols)
        .expect("row length is a whole number of blocks");
    assert_eq!(data.len(), rows * row_bytes, "weight data size");
    Packed::new(ty, rows, cols, data)
}

impl QMatrix {
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> QMatrix {
        let storage = match pack(ty, rows, cols, &data) {
            Some(p) => Storage::Packed(p),
            None => Storage::Gguf(data),
        };
        QMatrix {
            ty,
            rows,
            cols,
            storage,
        }
    }

    /// As [`QMatrix::new`] from borrowed bytes (a model file's): a format with a packed
    /// layout is packed straight from them, and only the others are copied. Copying every
    /// matrix first kept the freed copies resident in the allocator's heap: Qwen2.5-Coder-1.5B
    /// peaked at 1,528 MB in `bench perf` with them, 1,264 MB without.
    pub fn from_bytes(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> QMatrix {
        let storage = match pack(ty, rows, cols, data) {
            Some(p) => Storage::Packed(p),
            None => Storage::Gguf(data.to_vec()),
        };
        QMatrix {
            ty,
            rows,
            cols,
            storage,
        }
    }

    /// The bytes this matrix keeps (packed or as in the file): what a one-token product
    /// reads, where it reads them.
    pub fn stored_data(&self) -> &[u8] {
        match &self.storage {
            Storage::Packed(p) => p.data(),
            Storage::Gguf(d) => d,
        }
    }

    /// [`Self::stored_data`]'s length.
    pub fn stored_bytes(&self) -> usize {
        self.stored_data().len()
    }

    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols).unwrap()
    }

    /// Writes row `r` in its GGUF encoding into `out` (`row_bytes()` long).
    pub fn row_gguf(&self, r: usize, out: &mut [u8]) {
        match &self.storage {
            Storage::Gguf(d) => out.copy_from_slice(&d[r * out.len()..(r + 1) * out.len()]),
            Storage::Packed(p) => p.row_gguf(r, out),
        }
    }

    /// Dequantises row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match &self.storage {
            Storage::Gguf(d) => {
                let rb = self.row_bytes();
                dequantize(self.ty, &d[r * rb..(r + 1) * rb], out)
            }
            Storage::Packed(p) => {
                let mut buf = vec![0u8; self.row_bytes()];
                p.row_gguf(r, &mut buf);
                dequantize(self.ty, &buf, out)
            }
        }
    }
}

/// Moves the packed matrices among `mats` into one huge-page arena, in the given order (see
/// `hugebuf`: decode streams weights about 1.5× faster from huge pages), and returns its
/// size in bytes. Matrices without a packed layout keep their own buffers.
pub fn place_in_arena(mats: &mut [&mut QMatrix]) -> usize {
    let mut packed: Vec<&mut Packed> = mats
        .iter_mut()
        .filter_map(|m| match &mut m.storage {
            Storage::Packed(p) => Some(p),
            Storage::Gguf(_) => None,
        })
        .collect();
    pack::place_in_arena(&mut packed)
}

/// Rows per parallel work item of the reference paths.
const ROWS_PER_TASK: usize = 64;

/// Smallest work item of the SIMD path, in (8-row group × block × token) units of 256
/// multiply-adds (≈ 1 µs at 2048 units): big enough that rayon's hand-off (a few µs when
/// a worker must be woken) is amortised, small enough to balance two threads.
const MIN_TASK_UNITS: usize = 2048;

/// Up to this many tokens a matmul runs on the decode pool (`pool`), whose regions cost
/// far less to start and finish than rayon's; larger batches and prefill keep rayon.
const POOL_MAX_TOKENS: usize = super::pool::DECODE_MAX_TOKENS;

/// The smallest chunk of a pool region, in the units of `MIN_TASK_UNITS` (≈ 4 µs when the
/// weights stream from DRAM as in decode): the last chunks of a region shrink to this, so
/// that a late helper still finds work and the threads finish close together.
const POOL_MIN_CHUNK_UNITS: usize = 512;

/// Most chunks of one pool region (the split below makes about 10 for the largest
/// matrices, so this only bounds the stack array).
const POOL_MAX_REGION_CHUNKS: usize = 64;

/// The part of a region's row groups left to the guided tail of [`front_loaded_chunk_ends`]:
/// one sixteenth.
const POOL_TAIL_DIV: usize = 16;

/// Splits `n_groups` row groups into chunks for `threads` threads: first `threads` equal
/// chunks that together hold all but the last [`POOL_TAIL_DIV`]th, then a guided tail
/// (each chunk `1 / (2 · threads)` of what is left, at least `min_groups`) that balances
/// the threads at the region's end; where the equal chunks would be below `min_groups`,
/// the whole region is guided.
///
/// Why front-loaded: every chunk starts a new stream whose first lines nobody fetched ahead,
/// and with the whole region guided (chunks of a quarter, a sixth, … of what is left) two
/// threads leapfrog each other through a matrix in about ten streams each. Alternating in one
/// process on Qwen2.5-Coder-1.5B (AMX host, 2026-12-06, docs/results/benchmarks-history.md),
/// two-thread decode reached 80.4 % of the DRAM bound guided, 82.6 % in two exact halves, 83.1
/// % front-loaded; the thread that takes the second equal chunk ends where the tail starts, so
/// it goes on in the same stream. Before the guided split, fixed chunks of ≈ 2 µs held two
/// threads to 54 % of the bound (docs/results/benchmarks-history.md, "Issue 39 on an Intel Xeon
/// with AMX"). Writes the chunk ends into `ends` and returns how many there are.
fn front_loaded_chunk_ends(
    n_groups: usize,
    min_groups: usize,
    threads: usize,
    ends: &mut [usize; POOL_MAX_REGION_CHUNKS],
) -> usize {
    let equal = (n_groups - n_groups / POOL_TAIL_DIV) / threads;
    if equal < min_groups.max(1) || threads >= POOL_MAX_REGION_CHUNKS {
        return guided_chunk_ends(n_groups, min_groups, threads, 0, 0, ends);
    }
    for (i, end) in ends.iter_mut().take(threads).enumerate() {
        *end = equal * (i + 1);
    }
    guided_chunk_ends(
        n_groups,
        min_groups,
        threads,
        equal * threads,
        threads,
        ends,
    )
}

/// Guided chunks of `start..n_groups` written from `ends[n]` on: each takes `1 / (2 ·
/// threads)` of what is left, but at least `min_groups`, the last one everything left when
/// `ends` is full. Returns how many chunk ends `ends` holds.
fn guided_chunk_ends(
    n_groups: usize,
    min_groups: usize,
    threads: usize,
    mut start: usize,
    mut n: usize,
    ends: &mut [usize; POOL_MAX_REGION_CHUNKS],
) -> usize {
    while start < n_groups {
        let left = n_groups - start;
        let size = if n + 1 == POOL_MAX_REGION_CHUNKS {
            left
        } else {
            (left / (2 * threads)).max(min_groups).min(left)
        };
        start += size;
        ends[n] = start;
        n += 1;
    }
    n
}

thread_local! {
    /// Quantised activations, reused across calls so that decode does not allocate.
    static ACTS: Cell<Q8Acts> = Cell::new(Q8Acts::default());
}

/// The output pointer shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the pointer is only written through in `run_groups`, where each task writes only
// its own row groups of the output, which the caller borrows mutably until every task ends.
unsafe impl Send for OutPtr {}
// SAFETY: as for `Send`: tasks that share the pointer write disjoint rows of the output.
unsafe impl Sync for OutPtr {}

/// The integer matmul kernel this host runs: `amx` (AMX tiles for batches of 16 tokens or
/// more, AVX-512 VNNI below), `avx512-vnni`, `avx2` or `scalar`; `PK_AMX=0` turns AMX off.
pub fn matmul_isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    match x86::detect() {
        Some(x86::Isa::Amx) => return "amx",
        Some(x86::Isa::Avx512Vnni) => return "avx512-vnni",
        Some(x86::Isa::Avx2) => return "avx2",
        None => {}
    }
    "scalar"
}

/// `out[t * w.rows + r] = dot(W[r], x[t * w.cols ..])` for t in 0..n_tokens.
///
/// Formats with 32-element blocks take llama.cpp's path: activations quantised to 8-bit
/// blocks once per call, then integer dot products (SIMD when the CPU has AVX2, bit-exact
/// with the scalar reference); other formats dequantise.
pub fn matmul(w: &QMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let Storage::Packed(p) = &w.storage else {
        return matmul_reference(w, x, n_tokens, out);
    };
    assert_eq!(x.len(), n_tokens * w.cols);
    assert_eq!(out.len(), n_tokens * w.rows);
    let mut acts = ACTS.take();
    quantize_for(&mut acts, [w.ty].into_iter(), x);
    #[cfg(target_arch = "x86_64")]
    if let Some(isa) = x86::detect() {
        gemm_packed(isa, p, &acts, n_tokens, out);
        ACTS.set(acts);
        return;
    }
    matmul_q8_scalar(w, &acts, n_tokens, out);
    ACTS.set(acts);
}

/// Several matrices of the same input width applied to the same activations, e.g. a
/// layer's Q, K and V, or its gate and up projections: `outs[i] = matmul(ws[i], x)`, with
/// the same bits as separate calls. The activations are quantised once instead of once per
/// matrix, and all matrices' row groups form one parallel region instead of one each.
pub fn matmul_multi(ws: &[&QMatrix], x: &[f32], n_tokens: usize, outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len());
    let packed: Option<Vec<&Packed>> = ws
        .iter()
        .map(|w| {
            if let Storage::Packed(p) = &w.storage {
                Some(p)
            } else {
                None
            }
        })
        .collect();
    #[cfg(target_arch = "x86_64")]
    if let (Some(isa), Some(packed)) = (x86::detect(), packed) {
        for ((w, o), p) in ws.iter().zip(outs.iter()).zip(&packed) {
            assert_eq!(x.len(), n_tokens * w.cols);
            assert_eq!(o.len(), n_tokens * p.rows);
        }
        let mut acts = ACTS.take();
        quantize_for(&mut acts, ws.iter().map(|w| w.ty), x);
        let jobs: Vec<(&Packed, OutPtr)> = packed
            .iter()
            .zip(outs.iter_mut())
            .map(|(p, o)| (*p, OutPtr(o.as_mut_ptr())))
            .collect();
        gemm_jobs(isa, &jobs, &acts, n_tokens);
        ACTS.set(acts);
        return;
    }
    let _ = packed;
    for (w, o) in ws.iter().zip(outs.iter_mut()) {
        matmul(w, x, n_tokens, o);
    }
}

/// Quantises `x` into the representations the kernels of matrices of `types` read: the
/// 32-element blocks (`Q8Acts::quantize`) for any format but the K-quants, the K
/// representation (`Q8Acts::quantize_k`) for the K-quants. Every kernel of Q4_K and Q6_K
/// (VNNI, AVX2, AMX, scalar) reads only the second, so a Q4_K_M model's decode skips the
/// first: it ran on the calling thread alone before every matrix-vector product, while the
/// other decode thread waited.
fn quantize_for(acts: &mut Q8Acts, mut types: impl Iterator<Item = GgmlType> + Clone, x: &[f32]) {
    let is_k = |ty: GgmlType| matches!(ty, GgmlType::Q4K | GgmlType::Q6K);
    if !types.clone().all(is_k) {
        acts.quantize(x);
    }
    if types.any(is_k) {
        acts.quantize_k(x);
    }
}

/// Splits the row groups into tasks and runs the SIMD kernel on each, writing straight
/// into `out` (each task owns whole rows of every token, so writes never overlap).
#[cfg(target_arch = "x86_64")]
fn gemm_packed(isa: x86::Isa, p: &Packed, acts: &Q8Acts, n_tokens: usize, out: &mut [f32]) {
    gemm_jobs(isa, &[(p, OutPtr(out.as_mut_ptr()))], acts, n_tokens);
}

/// Runs every row group of every job (a matrix and its `n_tokens × rows` output), split
/// into contiguous ranges of the concatenated groups, so tasks balance across matrices.
#[cfg(target_arch = "x86_64")]
fn gemm_jobs(isa: x86::Isa, jobs: &[(&Packed, OutPtr)], acts: &Q8Acts, n_tokens: usize) {
    let groups: Vec<usize> = jobs
        .iter()
        .map(|(p, _)| p.rows.div_ceil(GROUP_ROWS))
        .collect();
    let n_groups: usize = groups.iter().sum();
    let units: usize = jobs
        .iter()
        .zip(&groups)
        .map(|((p, _), g)| g * p.blocks_per_row * n_tokens)
        .sum();
    // Decode-sized calls belong to the pool whatever its thread count (at 1 it runs the
    // chunks inline), so that its thread count alone decides how decode is spread.
    let pool = super::pool::global();
    if n_tokens <= POOL_MAX_TOKENS {
        let threads = pool.active_threads();
        let mut ends = [0usize; POOL_MAX_REGION_CHUNKS];
        let n_chunks = if threads > 1 {
            let units_per_group = (units / n_groups.max(1)).max(1);
            let min_groups = POOL_MIN_CHUNK_UNITS.div_ceil(units_per_group);
            front_loaded_chunk_ends(n_groups, min_groups, threads, &mut ends)
        } else {
            ends[0] = n_groups;
            1
        };
        let run = |chunk: usize| {
            let g0 = if chunk == 0 { 0 } else { ends[chunk - 1] };
            run_groups(isa, jobs, &groups, acts, n_tokens, g0, ends[chunk])
        };
        pool.run(n_chunks, &run);
        return;
    }
    let threads = rayon::current_num_threads();
    let n_tasks = if threads == 1 {
        1
    } else {
        (units / MIN_TASK_UNITS).clamp(1, n_groups)
    };
    let mut groups_per_task = n_groups.div_ceil(n_tasks);
    // The AMX kernel computes groups in pairs; a task boundary inside a pair would leave
    // half of a tile product unused.
    if isa == x86::Isa::Amx {
        groups_per_task += groups_per_task % 2;
    }
    let run = |task: usize| {
        run_groups(
            isa,
            jobs,
            &groups,
            acts,
            n_tokens,
            task * groups_per_task,
            ((task + 1) * groups_per_task).min(n_groups),
        )
    };
    if n_tasks == 1 {
        run(0);
    } else {
        (0..n_groups.div_ceil(groups_per_task))
            .into_par_iter()
            .for_each(run);
    }
}

/// Computes global row groups `g0..g1` of the concatenated jobs, mapping each to (job, group
/// within it).
#[cfg(target_arch = "x86_64")]
fn run_groups(
    isa: x86::Isa,
    jobs: &[(&Packed, OutPtr)],
    groups: &[usize],
    acts: &Q8Acts,
    n_tokens: usize,
    g0: usize,
    g1: usize,
) {
    let mut base = 0;
    for ((p, ptr), &ng) in jobs.iter().zip(groups) {
        let (lo, hi) = (g0.max(base), g1.min(base + ng));
        if isa == x86::Isa::Amx
            && n_tokens >= super::amx::TILE_TOKENS
            && super::amx::supports(p.ty)
            && lo < hi
        {
            // SAFETY: as below; `detect` returned Amx only where `amx::available` holds, and
            // every packed format is supported.
            unsafe {
                super::amx::gemm_groups(p, (lo - base, hi - base), acts, n_tokens, ptr.0, p.rows)
            };
            base += ng;
            continue;
        }
        if lo < hi {
            // SAFETY: `detect` checked the ISA; `acts` holds n_tokens tokens; group g of this
            // job writes only rows 8g..8g+8 of each token of its own output, which no other
            // task owns (callers hand out disjoint ranges), and the output holds n_tokens × rows
            // floats.
            unsafe {
                x86::gemm_groups(
                    isa,
                    p,
                    (lo - base, hi - base),
                    acts,
                    0,
                    n_tokens,
                    ptr.0,
                    p.rows,
                )
            };
        }
        base += ng;
    }
}

/// The scalar integer path over quantised activations: the reference for the SIMD kernels.
pub fn matmul_q8_scalar(w: &QMatrix, acts: &Q8Acts, n_tokens: usize, out: &mut [f32]) {
    let dot: fn(&[u8], &Q8Acts, usize) -> f32 = match w.ty {
        GgmlType::Q4_0 => q8::dot_q4_0,
        GgmlType::Q4_1 => q8::dot_q4_1,
        GgmlType::Q5_0 => q8::dot_q5_0,
        GgmlType::Q8_0 => q8::dot_q8_0,
        GgmlType::Q6S => q8::dot_q6s,
        GgmlType::Q4K => super::q8k::dot_q4k,
        GgmlType::Q6K => super::q8k::dot_q6k,
        ty => panic!("no 8-bit activation path for {ty:?}"),
    };
    let blocks_per_row = w.cols / q8::QK;
    let n_tasks = w.rows.div_ceil(ROWS_PER_TASK);
    let tiles: Vec<Vec<f32>> = (0..n_tasks)
        .into_par_iter()
        .map(|task| {
            let r0 = task * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(w.rows);
            let mut row = vec![0u8; w.row_bytes()];
            let mut tile = vec![0f32; (r1 - r0) * n_tokens];
            for r in r0..r1 {
                w.row_gguf(r, &mut row);
                for t in 0..n_tokens {
                    tile[(r - r0) * n_tokens + t] = dot(&row, acts, t * blocks_per_row);
                }
            }
            tile
        })
        .collect();
    scatter(&tiles, w.rows, n_tokens, out);
}

/// Writes row-major `[rows_in_task × n_tokens]` tiles into the token-major output.
fn scatter(tiles: &[Vec<f32>], rows: usize, n_tokens: usize, out: &mut [f32]) {
    for (task, tile) in tiles.iter().enumerate() {
        let r0 = task * ROWS_PER_TASK;
        let nr = tile.len() / n_tokens.max(1);
        for i in 0..nr {
            for t in 0..n_tokens {
                out[t * rows + r0 + i] = tile[i * n_tokens + t];
            }
        }
    }
}

/// The portable reference: dequantise a row, dot it with every token.
pub fn matmul_reference(w: &QMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    assert_eq!(x.len(), n_tokens * w.cols);
    assert_eq!(out.len(), n_tokens * w.rows);
    let n_tasks = w.rows.div_ceil(ROWS_PER_TASK);
    // Each task computes a [rows_in_task × n_tokens] tile (transposed), then the tiles are
    // scattered into the token-major output; the scatter is O(output) and cheap.
    let tiles: Vec<Vec<f32>> = (0..n_tasks)
        .into_par_iter()
        .map(|task| {
            let r0 = task * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(w.rows);
            let mut row = vec![0f32; w.cols];
            let mut tile = vec![0f32; (r1 - r0) * n_tokens];
            for r in r0..r1 {
                w.dequantize_row(r, &mut row);
                for t in 0..n_tokens {
                    tile[(r - r0) * n_tokens + t] = dot_f32(&row, &x[t * w.cols..(t + 1) * w.cols]);
                }
            }
            tile
        })
        .collect();
    scatter(&tiles, w.rows, n_tokens, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn chunks_cover_every_group_once_front_loaded() {
        for (n_groups, min_groups, threads) in [
            (1, 1, 2),
            (7, 11, 2),
            (192, 11, 2),
            (256, 2, 2),
            (2240, 11, 2),
            (100_000, 1, 2),
            (2240, 4, 3),
            (30, 11, 2),
        ] {
            let mut ends = [0usize; POOL_MAX_REGION_CHUNKS];
            let n = front_loaded_chunk_ends(n_groups, min_groups, threads, &mut ends);
            assert!((1..=POOL_MAX_REGION_CHUNKS).contains(&n));
            assert_eq!(
                ends[n - 1],
                n_groups,
                "the chunks must end at the last group"
            );
            let sizes: Vec<usize> = (0..n)
                .map(|i| ends[i] - if i == 0 { 0 } else { ends[i - 1] })
                .collect();
            assert!(sizes.iter().all(|&s| s > 0), "{sizes:?}");
            let equal = (n_groups - n_groups / POOL_TAIL_DIV) / threads;
            // The guided part (all of it when the equal chunks would be too short): every
            // chunk but a capped last one at most as long as the one before it.
            let guided_from = if equal >= min_groups { threads } else { 0 };
            if guided_from > 0 {
                assert!(sizes[..threads].iter().all(|&s| s == equal), "{sizes:?}");
                assert!(
                    n_groups - equal * threads <= n_groups / POOL_TAIL_DIV + threads,
                    "{sizes:?}"
                );
            } else if n_groups >= 2 * threads * min_groups {
                assert_eq!(sizes[0], n_groups / (2 * threads), "{sizes:?}");
            }
            if n < POOL_MAX_REGION_CHUNKS && n > guided_from {
                let tail = &sizes[guided_from..];
                assert!(tail.windows(2).all(|w| w[1] <= w[0]), "{sizes:?}");
            }
        }
    }

    /// Random weights with valid f16 scales (both of Q6S's; Q4_1's min negative; Q4_K's
    /// super-block `d` and `dmin`, under random 6-bit sub-block scales and mins).
    fn random_weights(rng: &mut impl Rng, ty: GgmlType, rows: usize, cols: usize) -> QMatrix {
        let mut data = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
        rng.fill(&mut data[..]);
        let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for blk in data.chunks_exact_mut(ty.block_bytes()) {
            blk[0..2].copy_from_slice(&h(rng.gen_range(0.001..0.02)));
            if ty == GgmlType::Q4_1 {
                blk[2..4].copy_from_slice(&h(rng.gen_range(-0.1..0.0)));
            }
            if ty == GgmlType::Q6S {
                blk[2..4].copy_from_slice(&h(rng.gen_range(0.001..0.02)));
            }
            if ty == GgmlType::Q4K {
                blk[0..2].copy_from_slice(&h(rng.gen_range(0.0001..0.001)));
                blk[2..4].copy_from_slice(&h(rng.gen_range(0.0001..0.002)));
            }
            if ty == GgmlType::Q6K {
                blk[208..210].copy_from_slice(&h(rng.gen_range(0.0001..0.001)));
            }
        }
        QMatrix::new(ty, rows, cols, data)
    }

    /// Columns for a test matrix of `ty`: `cols`, or the next multiple of Q4_K's 256-value
    /// super-block.
    fn cols_for(ty: GgmlType, cols: usize) -> usize {
        if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
            cols.next_multiple_of(256)
        } else {
            cols
        }
    }

    /// The SIMD kernels equal the scalar integer reference bit for bit, for every packed
    /// format, both instruction sets, a partial last row group and token counts on both
    /// sides of the register tile; and a token's row does not depend on its batch.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_matches_scalar_reference_exactly() {
        let Some(best) = x86::detect() else { return };
        let isas = match best {
            x86::Isa::Avx2 => vec![best],
            x86::Isa::Avx512Vnni => vec![x86::Isa::Avx2, best],
            x86::Isa::Amx => vec![x86::Isa::Avx2, x86::Isa::Avx512Vnni, best],
        };
        // Says which kernels this host checked: each runs only where the CPU has it.
        eprintln!("simd_matches_scalar_reference_exactly: {isas:?}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q6S,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            // Three super-blocks a row for the K-quants, so that a row has a super-block
            // whose float update is neither its first nor its last.
            let (rows, cols) = (19, if cols_for(ty, 1) > 1 { 768 } else { 128 });
            let w = random_weights(&mut rng, ty, rows, cols);
            let Storage::Packed(p) = &w.storage else {
                panic!("{ty:?} is not packed")
            };
            for n in [1, 3, 4, 6, 9, 16, 37, 150] {
                let mut x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
                x[cols / 2] = -250.0;
                let mut acts = Q8Acts::default();
                acts.quantize(&x);
                if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
                    acts.quantize_k(&x);
                }
                let mut want = vec![0f32; n * rows];
                matmul_q8_scalar(&w, &acts, n, &mut want);
                for &isa in &isas {
                    let mut got = vec![f32::NAN; n * rows];
                    gemm_packed(isa, p, &acts, n, &mut got);
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{ty:?} {isa:?} n={n}"
                    );
                }
                // Together with another matrix through `matmul_multi`: the same bits.
                let w2 = random_weights(&mut rng, GgmlType::Q4_1, 24, cols);
                let (mut got, mut got2, mut want2) = (
                    vec![f32::NAN; n * rows],
                    vec![f32::NAN; n * 24],
                    vec![0f32; n * 24],
                );
                matmul_multi(&[&w2, &w], &x, n, &mut [&mut got2, &mut got]);
                matmul_q8_scalar(&w2, &acts, n, &mut want2);
                assert_eq!(got, want, "{ty:?} multi n={n}");
                assert_eq!(got2, want2, "{ty:?} multi n={n}");
                // Token by token through the public entry point: the same bits.
                for t in 0..n {
                    let mut one = vec![0f32; rows];
                    matmul(&w, &x[t * cols..(t + 1) * cols], 1, &mut one);
                    assert_eq!(
                        one,
                        want[t * rows..(t + 1) * rows],
                        "{ty:?} token {t} alone"
                    );
                }
            }
        }
    }

    /// The AMX kernel over a row width whose activations span more than one of its token
    /// chunks (8,960 columns: 112 tokens a chunk), with a 16-token tail and an unpaired last
    /// row group: the reference's bits. Runs where the host has AMX and says so otherwise.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn amx_matches_reference_across_token_chunks() {
        if x86::detect() != Some(x86::Isa::Amx) {
            eprintln!(
                "amx_matches_reference_across_token_chunks: no AMX here ({})",
                matmul_isa()
            );
            return;
        }
        every_packed_format_matches_reference(x86::Isa::Amx, 11, (40, 8960, 150));
    }

    /// For every packed format: `rows × cols` random weights times `n` random tokens through
    /// `isa`'s kernel give the scalar reference's bits.
    #[cfg(target_arch = "x86_64")]
    fn every_packed_format_matches_reference(
        isa: x86::Isa,
        seed: u64,
        (rows, cols, n): (usize, usize, usize),
    ) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q6S,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let w = random_weights(&mut rng, ty, rows, cols);
            let Storage::Packed(p) = &w.storage else {
                panic!("{ty:?} is not packed")
            };
            let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut acts = Q8Acts::default();
            acts.quantize(&x);
            if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
                acts.quantize_k(&x);
            }
            let mut want = vec![0f32; n * rows];
            matmul_q8_scalar(&w, &acts, n, &mut want);
            let mut got = vec![f32::NAN; n * rows];
            gemm_packed(isa, p, &acts, n, &mut got);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{ty:?} {isa:?}");
        }
    }

    /// The AVX2 and VNNI kernels over more tokens than one pass over the row groups takes
    /// (2,304 columns: 32 tokens a pass at four a tile, `x86::pass_tokens`), the last short and
    /// ending in a tail below the register tile: the reference's bits for every token.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn token_passes_keep_the_reference_bits() {
        let Some(best) = x86::detect() else {
            eprintln!("token_passes_keep_the_reference_bits: no AVX2/FMA/F16C here, skipped");
            return;
        };
        let isa = if best == x86::Isa::Amx {
            x86::Isa::Avx512Vnni
        } else {
            best
        };
        eprintln!("token_passes_keep_the_reference_bits: {isa:?}");
        let (rows, cols, n) = (9, 2304, 70);
        // Two whole passes and a short third: what this test is for.
        assert_eq!(x86::pass_tokens(cols / 32, 4), 32);
        every_packed_format_matches_reference(isa, 17, (rows, cols, n));
    }

    /// The largest quants against activations of ±127 in every element: the AVX2 kernel's
    /// 16-bit partial sums (x86.rs, NOTE 3) stay exact, so it still equals the reference.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn extreme_quants_keep_the_16_bit_sums_exact() {
        if x86::detect().is_none() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let formats = [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q6S,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ];
        for (ty, byte) in formats
            .into_iter()
            .flat_map(|t| [(t, 0xffu8), (t, 0x00), (t, 0x80)])
        {
            let (rows, cols, n) = (16, cols_for(ty, 64), 5);
            // Every quant byte set to `byte`, with valid scales (the first 2 or 4 bytes).
            let mut data = vec![byte; rows * ty.row_bytes(cols).unwrap()];
            let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
            for blk in data.chunks_exact_mut(ty.block_bytes()) {
                if ty == GgmlType::Q6K {
                    blk[208..210].copy_from_slice(&h(rng.gen_range(0.001..0.02)));
                    continue;
                }
                blk[0..2].copy_from_slice(&h(rng.gen_range(0.001..0.02)));
                if ty == GgmlType::Q4_1 || ty == GgmlType::Q6S || ty == GgmlType::Q4K {
                    blk[2..4].copy_from_slice(&h(rng.gen_range(0.001..0.02)));
                }
            }
            let w = QMatrix::new(ty, rows, cols, data);
            let Storage::Packed(p) = &w.storage else {
                panic!("{ty:?} is not packed")
            };
            for sign in [1.0f32, -1.0] {
                let x = vec![sign; n * cols];
                let mut acts = Q8Acts::default();
                acts.quantize(&x);
                if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
                    acts.quantize_k(&x);
                }
                let mut want = vec![0f32; n * rows];
                matmul_q8_scalar(&w, &acts, n, &mut want);
                let mut got = vec![f32::NAN; n * rows];
                gemm_packed(x86::Isa::Avx2, p, &acts, n, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{ty:?} byte {byte:#x} sign {sign}");
            }
        }
    }

    /// The 8-bit activation path agrees with exact dequantise-and-dot up to the activation
    /// rounding (half a step of amax/127 per element), including rows with one large outlier
    /// like SmolLM2's attention-sink token.
    #[test]
    fn q8_path_matches_reference_within_activation_rounding() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for ty in [
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q6S,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let (rows, cols, n) = (70, cols_for(ty, 96), 5);
            let w = random_weights(&mut rng, ty, rows, cols);
            let mut x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            x[2 * cols + 7] = 300.0;
            let (mut got, mut want) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            matmul(&w, &x, n, &mut got);
            matmul_reference(&w, &x, n, &mut want);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                for t in 0..n {
                    // |Σ w·δx| ≤ Σ|w|·(step/2), step = block amax/127 (plus f16 rounding of d and s).
                    let xt = &x[t * cols..(t + 1) * cols];
                    // K-quants' activations have one scale per 256 elements (`q8k`).
                    let block = if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) {
                        256
                    } else {
                        32
                    };
                    let tol: f32 = row
                        .chunks(block)
                        .zip(xt.chunks(block))
                        .map(|(wb, xb)| {
                            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                            wb.iter().map(|v| v.abs()).sum::<f32>() * amax / 127.0 * 0.51
                                + 2e-3 * amax
                        })
                        .sum::<f32>()
                        + 1e-4;
                    let (g, e) = (got[t * rows + r], want[t * rows + r]);
                    assert!(
                        (g - e).abs() <= tol,
                        "{ty:?} row {r} token {t}: {g} vs {e} (tol {tol})"
                    );
                }
            }
        }
    }
}
