//! Bulk KV transfers between host memory and the device pool: restoring a stored context or
//! a tier's chunk (`KvBlocks::write_tokens`) and reading one out for the tiers
//! (`KvBlocks::read_tokens`).
//!
//! A token range is cut into pieces that fit a staging buffer (whole layers together while
//! they fit, else token ranges of one layer). Each piece moves as one DMA between a pinned
//! host buffer and a device staging buffer, plus one kernel launch that scatters it into the
//! blocks of the sequence's table (`kv_scatter`) or gathers it from them (`kv_gather`), so
//! a 1,536-token context of the default model is about 30 copies and 30 launches instead of
//! one pageable copy per (layer, KV head, block, K or V), about 17,000.
//!
//! Everything here runs on a second stream, the copy stream, with two staging slots: while
//! the DMA engine moves piece i, the host converts piece i + 1 between f32 and f16, and the
//! compute stream is free. A write returns as soon as its last piece is enqueued; the
//! compute stream then waits for the copy stream with an event (on the device, not on the
//! host), so the next forward pass is ordered after the restore while the host goes on
//! scheduling. A read waits for its own pieces only. Before either, the copy stream waits
//! for the compute stream's pending work, so a range is never read before the forward pass
//! that writes it, nor overwritten under one that reads it.
//!
//! Limits: the two slots' pinned and device buffers (`staging_bytes` each, 8 MiB by
//! default) are all the memory a transfer uses, whatever the range's size, and bound the
//! bytes in flight; block tables are staged in a pinned buffer sized for the pool's block
//! count, the longest table a sequence can have.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use half::f16;
use half::slice::HalfFloatSliceExt;
use pk_model::{block_runs, token_range_len, KvGeometry};
use rayon::prelude::*;

use crate::device::Gpu;
use crate::kargs;
use crate::kv_pool::GpuKvPool;
use crate::CudaError;

/// Bytes of each of the two staging slots (pinned host and device alike), unless set.
pub const DEFAULT_STAGING_BYTES: usize = 8 << 20;

/// A piece of a token range: layers `layer0..layer0 + n_layers`, tokens `t0..t0 + n` of the
/// range (relative to its first token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub layer0: usize,
    pub n_layers: usize,
    pub t0: usize,
    pub n: usize,
}

impl Piece {
    /// f16 values the piece stages: K and V of its tokens, every KV head of its layers.
    pub fn elems(&self, g: &KvGeometry) -> usize {
        self.n_layers * 2 * g.n_kv_heads * self.n * g.head_dim
    }
}

/// The f16 values one token of one layer stages (K and V, every KV head): the smallest
/// piece, so the least a staging slot must hold.
pub fn token_layer_elems(g: &KvGeometry) -> usize {
    2 * g.n_kv_heads * g.head_dim
}

/// Cuts `n_tokens` tokens of every layer into pieces of at most `capacity_elems` staged
/// values, in layer order: as many whole layers per piece as fit, or, when one layer does
/// not fit, runs of tokens of one layer. Empty for an empty range.
pub fn plan_pieces(g: &KvGeometry, n_tokens: usize, capacity_elems: usize) -> Vec<Piece> {
    let per_token = token_layer_elems(g);
    assert!(
        capacity_elems >= per_token,
        "a staging slot must hold one token of one layer"
    );
    if n_tokens == 0 {
        return Vec::new();
    }
    let layer_elems = per_token * n_tokens;
    let mut pieces = Vec::new();
    if layer_elems <= capacity_elems {
        let per_piece = capacity_elems / layer_elems;
        let mut l = 0;
        while l < g.n_layers {
            let n_layers = per_piece.min(g.n_layers - l);
            pieces.push(Piece {
                layer0: l,
                n_layers,
                t0: 0,
                n: n_tokens,
            });
            l += n_layers;
        }
    } else {
        let tokens_per_piece = capacity_elems / per_token;
        for layer0 in 0..g.n_layers {
            let mut t0 = 0;
            while t0 < n_tokens {
                let n = tokens_per_piece.min(n_tokens - t0);
                pieces.push(Piece {
                    layer0,
                    n_layers: 1,
                    t0,
                    n,
                });
                t0 += n;
            }
        }
    }
    pieces
}

/// Where row `(layer, side, kv_head, token)` of a piece sits in a range of `n_tokens`
/// tokens in the context layout (`[layer][kv_head][token][head_dim]`, K and V apart), for
/// each staged row in staging order: `(side is V, element offset)`.
fn piece_rows(
    g: &KvGeometry,
    n_tokens: usize,
    p: Piece,
) -> impl Iterator<Item = (bool, usize)> + '_ {
    let hd = g.head_dim;
    (p.layer0..p.layer0 + p.n_layers).flat_map(move |layer| {
        [false, true].into_iter().flat_map(move |is_v| {
            (0..g.n_kv_heads)
                .map(move |h| (is_v, ((layer * g.n_kv_heads + h) * n_tokens + p.t0) * hd))
        })
    })
}

/// Elements one thread converts at a time: the staged path's speed is the host's f32 ↔ f16
/// conversion (one thread did 2.2–3.0 GB/s on the H200 host against the link's 45–55 GB/s,
/// BENCHMARKS.md), so a piece's rows are converted in parts on every core.
const CONVERT_PART_ELEMS: usize = 1 << 15;

/// Packs piece `p` of a range of `n_tokens` tokens (`k`, `v` in the context layout) into
/// `out` in the staging layout (`[layer][K, V][kv_head][token][head_dim]`) as f16.
pub fn pack_piece(
    g: &KvGeometry,
    n_tokens: usize,
    p: Piece,
    k: &[f32],
    v: &[f32],
    out: &mut [f16],
) {
    let run = p.n * g.head_dim;
    let rows: Vec<(bool, usize)> = piece_rows(g, n_tokens, p).collect();
    out[..p.elems(g)]
        .par_chunks_exact_mut(run)
        .zip(rows.par_iter())
        .for_each(|(dst, &(is_v, at))| {
            let src = &(if is_v { v } else { k })[at..at + run];
            dst.par_chunks_mut(CONVERT_PART_ELEMS)
                .zip(src.par_chunks(CONVERT_PART_ELEMS))
                .for_each(|(d, s)| d.convert_from_f32_slice(s));
        });
}

/// The inverse of [`pack_piece`]: staged f16 values back into the context layout as f32.
pub fn unpack_piece(
    g: &KvGeometry,
    n_tokens: usize,
    p: Piece,
    staged: &[f16],
    k: &mut [f32],
    v: &mut [f32],
) {
    let (hd, heads) = (g.head_dim, g.n_kv_heads);
    let run = p.n * hd;
    let layers = p.layer0..p.layer0 + p.n_layers;
    for (side, dst) in [(0, k), (1, v)] {
        // One chunk per (layer, KV head) of the context layout; the piece fills its tokens
        // `t0..t0 + n` of the chunks of its layers.
        dst.par_chunks_mut(n_tokens * hd)
            .enumerate()
            .filter(|(lh, _)| layers.contains(&(lh / heads)))
            .for_each(|(lh, head_rows)| {
                let row = ((lh / heads - p.layer0) * 2 + side) * heads + lh % heads;
                let src = &staged[row * run..(row + 1) * run];
                head_rows[p.t0 * hd..p.t0 * hd + run]
                    .par_chunks_mut(CONVERT_PART_ELEMS)
                    .zip(src.par_chunks(CONVERT_PART_ELEMS))
                    .for_each(|(d, s)| s.convert_to_f32_slice(d));
            });
    }
}

/// Counters of what the transfers moved, for logs and benchmarks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TransferStats {
    pub writes: u64,
    pub reads: u64,
    pub pieces: u64,
    pub bytes_to_device: u64,
    pub bytes_to_host: u64,
}

/// A staging slot: a pinned host buffer, a device buffer of the same size, and the event
/// recorded after the last copy stream work that used them.
struct Slot {
    host: PinnedHostSlice<u16>,
    dev: CudaSlice<u16>,
    done: CudaEvent,
    pending: bool,
}

impl Slot {
    /// Waits until the slot's previous piece is through (its buffers may be reused).
    fn wait(&mut self) -> Result<(), CudaError> {
        if self.pending {
            self.done.synchronize()?;
            self.pending = false;
        }
        Ok(())
    }
}

pub struct Transfers {
    copy: Arc<CudaStream>,
    slots: [Slot; 2],
    staging_elems: usize,
    table_host: PinnedHostSlice<i32>,
    table_dev: CudaSlice<i32>,
    table_done: CudaEvent,
    table_pending: bool,
    pub stats: TransferStats,
}

impl Transfers {
    /// Staging for a pool of `g`: two slots of `staging_bytes` (raised to one token of one
    /// layer if smaller) and a block table as long as the pool has blocks.
    pub fn new(gpu: &Gpu, g: &KvGeometry, staging_bytes: usize) -> Result<Transfers, CudaError> {
        let staging_elems = (staging_bytes / 2).max(token_layer_elems(g));
        let copy = gpu.ctx.new_stream()?;
        let slot = || -> Result<Slot, CudaError> {
            // SAFETY: plain (not write-combined) page-locked memory, cached so that reading
            // downloads back on the host is fast; zeroed before any slice of it is formed.
            let mut host = unsafe { gpu.ctx.alloc_pinned_with_flags::<u16>(staging_elems, 0)? };
            // SAFETY: `host` is one aligned allocation of `staging_elems` u16s, not yet shared
            // with any stream, and all-zero bytes are a valid u16.
            unsafe { std::ptr::write_bytes(host.as_mut_ptr()?, 0, staging_elems) };
            Ok(Slot {
                host,
                dev: gpu.alloc::<u16>(staging_elems)?,
                done: gpu.ctx.new_event(None)?,
                pending: false,
            })
        };
        let slots = [slot()?, slot()?];
        // SAFETY: as above.
        let mut table_host = unsafe {
            gpu.ctx
                .alloc_pinned_with_flags::<i32>(g.num_blocks.max(1), 0)?
        };
        // SAFETY: `table_host` is one aligned allocation of `g.num_blocks.max(1)` i32s, not
        // yet shared with any stream, and all-zero bytes are a valid i32.
        unsafe { std::ptr::write_bytes(table_host.as_mut_ptr()?, 0, g.num_blocks.max(1)) };
        let table_dev = gpu.alloc::<i32>(g.num_blocks.max(1))?;
        // The allocations above were made on the compute stream: the copy stream must not
        // touch them before they exist.
        copy.join(&gpu.stream)?;
        Ok(Transfers {
            copy,
            slots,
            staging_elems,
            table_host,
            table_dev,
            table_done: gpu.ctx.new_event(None)?,
            table_pending: false,
            stats: TransferStats::default(),
        })
    }

    /// Bytes of one staging slot.
    pub fn staging_bytes(&self) -> usize {
        self.staging_elems * 2
    }

    /// Orders the copy stream after the compute stream's pending work and stages `table` on
    /// the device (only the blocks the range touches matter, but the table is short).
    fn begin(&mut self, gpu: &Gpu, table: &[u32]) -> Result<(), CudaError> {
        assert!(
            table.len() <= self.table_host.len(),
            "a block table longer than the pool"
        );
        self.copy.join(&gpu.stream)?;
        if self.table_pending {
            self.table_done.synchronize()?;
            self.table_pending = false;
        }
        let host = self.table_host.as_mut_slice()?;
        for (d, &b) in host.iter_mut().zip(table) {
            *d = b as i32;
        }
        gpu.ctx.bind_to_thread()?;
        // SAFETY: the pinned source stays untouched until `table_done` passes (checked above
        // before the next write), and the device table holds as many entries.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                gpu.ptr(&self.table_dev),
                &host[..table.len()],
                self.copy.cu_stream(),
            )?
        };
        self.table_done.record(&self.copy)?;
        self.table_pending = true;
        Ok(())
    }

    /// Launches `kv_scatter` or `kv_gather` for piece `p` between slot `s`'s device buffer
    /// and the pool, on the copy stream.
    fn launch(
        &self,
        gpu: &Gpu,
        name: &str,
        pool: &GpuKvPool,
        s: usize,
        first: usize,
        p: Piece,
    ) -> Result<(), CudaError> {
        let g = &pool.geometry;
        let (k, v) = pool.layer_ptrs(gpu, p.layer0);
        let stride_pairs = (g.num_blocks * g.block_elems() / 2) as i64;
        let pairs = p.elems(g) / 2;
        // SAFETY: kv_scatter/kv_gather's parameters, in order; the staging buffer holds the
        // piece, the pool's layers `layer0..layer0 + n_layers` exist, and every table entry
        // the range touches is a block id of the pool (the engine's block manager).
        unsafe {
            gpu.launch_on(
                &self.copy,
                name,
                gpu.grid_for(pairs),
                256,
                0,
                kargs![
                    gpu.ptr(&self.slots[s].dev),
                    k,
                    v,
                    stride_pairs,
                    p.n_layers as i32,
                    gpu.ptr(&self.table_dev),
                    (first + p.t0) as i32,
                    p.n as i32,
                    g.n_kv_heads as i32,
                    g.head_dim as i32,
                    g.block_size_tokens as i32
                ],
            )
        }
    }

    /// Writes stored indices `first..` of `table` from `k` and `v` (context layout; see
    /// `KvBlocks::write_tokens`). Returns once the last piece is enqueued; the compute
    /// stream is ordered after it.
    pub fn write_tokens(
        &mut self,
        gpu: &Gpu,
        pool: &mut GpuKvPool,
        table: &[u32],
        first: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), CudaError> {
        let g = pool.geometry;
        let n = token_range_len(&g, table, first, k.len(), v.len());
        if n == 0 {
            return Ok(());
        }
        if !runs_in_table(&g, table, first, n) {
            return Err(CudaError::Unsupported(format!(
                "a block table entry outside the pool of {} blocks",
                g.num_blocks
            )));
        }
        self.begin(gpu, table)?;
        let enqueued = self.enqueue_writes(gpu, pool, first, n, k, v);
        // Even after a failure part-way, whatever was enqueued must be ordered before the
        // compute stream's later work (block reads and writes do not stop at a failure).
        let joined = gpu.stream.join(&self.copy);
        enqueued?;
        joined?;
        self.stats.writes += 1;
        Ok(())
    }

    fn enqueue_writes(
        &mut self,
        gpu: &Gpu,
        pool: &GpuKvPool,
        first: usize,
        n: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), CudaError> {
        let g = pool.geometry;
        for (i, p) in plan_pieces(&g, n, self.staging_elems)
            .into_iter()
            .enumerate()
        {
            let s = i % 2;
            self.slots[s].wait()?;
            let elems = p.elems(&g);
            let slot = &mut self.slots[s];
            let dev = gpu.ptr(&slot.dev);
            let host = &mut slot.host.as_mut_slice()?[..elems];
            pack_piece(
                &g,
                n,
                p,
                k,
                v,
                half::slice::HalfBitsSliceExt::reinterpret_cast_mut(host),
            );
            gpu.ctx.bind_to_thread()?;
            // SAFETY: the slot's buffers are not reused before `done` passes (`wait`).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(dev, &host[..], self.copy.cu_stream())?
            };
            self.launch(gpu, "kv_scatter", pool, s, first, p)?;
            self.slots[s].done.record(&self.copy)?;
            self.slots[s].pending = true;
            self.stats.pieces += 1;
            self.stats.bytes_to_device += 2 * elems as u64;
        }
        Ok(())
    }

    /// Reads stored indices `first..` of `table` into `k` and `v` (context layout). Piece
    /// i + 1 is in flight while piece i is converted.
    pub fn read_tokens(
        &mut self,
        gpu: &Gpu,
        pool: &GpuKvPool,
        table: &[u32],
        first: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), CudaError> {
        let g = pool.geometry;
        let n = token_range_len(&g, table, first, k.len(), v.len());
        if n == 0 {
            return Ok(());
        }
        if !runs_in_table(&g, table, first, n) {
            return Err(CudaError::Unsupported(format!(
                "a block table entry outside the pool of {} blocks",
                g.num_blocks
            )));
        }
        self.begin(gpu, table)?;
        let pieces = plan_pieces(&g, n, self.staging_elems);
        let enqueue = |t: &mut Transfers, i: usize| -> Result<(), CudaError> {
            let (s, p) = (i % 2, pieces[i]);
            t.slots[s].wait()?;
            t.launch(gpu, "kv_gather", pool, s, first, p)?;
            let elems = p.elems(&g);
            let slot = &mut t.slots[s];
            let host = &mut slot.host.as_mut_slice()?[..elems];
            gpu.ctx.bind_to_thread()?;
            // SAFETY: the host buffer is read only after `done` passes, below.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    host,
                    gpu.ptr(&slot.dev),
                    t.copy.cu_stream(),
                )?
            };
            slot.done.record(&t.copy)?;
            slot.pending = true;
            t.stats.pieces += 1;
            t.stats.bytes_to_host += 2 * elems as u64;
            Ok(())
        };
        enqueue(self, 0)?;
        for (i, &p) in pieces.iter().enumerate() {
            if i + 1 < pieces.len() {
                enqueue(self, i + 1)?;
            }
            let slot = &mut self.slots[i % 2];
            slot.wait()?;
            let staged = &slot.host.as_mut_slice()?[..p.elems(&g)];
            unpack_piece(
                &g,
                n,
                p,
                half::slice::HalfBitsSliceExt::reinterpret_cast(staged),
                k,
                v,
            );
        }
        self.stats.reads += 1;
        Ok(())
    }
}

impl Drop for Transfers {
    fn drop(&mut self) {
        // Pinned buffers must outlive every copy that uses them.
        let _ = self.copy.synchronize();
    }
}

/// Checks that the runs of a range stay inside `table` (what `kv_scatter` trusts).
pub fn runs_in_table(g: &KvGeometry, table: &[u32], first: usize, n: usize) -> bool {
    block_runs(first, n, g.block_size_tokens).all(|(t0, _)| {
        t0 / g.block_size_tokens < table.len()
            && (table[t0 / g.block_size_tokens] as usize) < g.num_blocks
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> KvGeometry {
        KvGeometry {
            n_layers: 3,
            n_kv_heads: 2,
            head_dim: 8,
            block_size_tokens: 4,
            num_blocks: 16,
        }
    }

    /// Pieces cover every (layer, token) of the range exactly once, in layer order, and
    /// each fits the slot; whole layers are grouped while a layer fits.
    #[test]
    fn pieces_tile_the_range_and_fit() {
        let g = geometry();
        let per = token_layer_elems(&g);
        for n in [1usize, 5, 16, 40] {
            for cap in [
                per,
                3 * per,
                per * n,
                per * n * 2 + 1,
                per * n * 3,
                per * n * 10,
            ] {
                let pieces = plan_pieces(&g, n, cap);
                let mut covered = vec![0u8; g.n_layers * n];
                for p in &pieces {
                    assert!(
                        p.elems(&g) <= cap && p.n > 0 && p.n_layers > 0,
                        "{p:?} for cap {cap}"
                    );
                    for l in p.layer0..p.layer0 + p.n_layers {
                        for t in p.t0..p.t0 + p.n {
                            covered[l * n + t] += 1;
                        }
                    }
                }
                assert!(
                    covered.iter().all(|&c| c == 1),
                    "n {n} cap {cap}: {pieces:?}"
                );
                if per * n <= cap {
                    assert_eq!(pieces.len(), g.n_layers.div_ceil(cap / (per * n)));
                }
            }
        }
        assert!(plan_pieces(&g, 0, per).is_empty());
    }

    /// Packing then unpacking any plan gives back the range rounded to f16, and the staged
    /// order is the kernels' `[layer][K, V][kv_head][token][head_dim]`.
    #[test]
    fn pack_and_unpack_are_inverse_in_the_kernels_layout() {
        let g = geometry();
        let n = 7;
        let len = g.n_layers * g.n_kv_heads * n * g.head_dim;
        let k: Vec<f32> = (0..len).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..len).map(|i| -(i as f32) - 0.5).collect();
        for cap in [token_layer_elems(&g), 3 * token_layer_elems(&g), 1000] {
            let (mut k2, mut v2) = (vec![f32::NAN; len], vec![f32::NAN; len]);
            let mut staged = vec![f16::ZERO; cap];
            for p in plan_pieces(&g, n, cap) {
                pack_piece(&g, n, p, &k, &v, &mut staged);
                // The first value of the piece's last V row of its last layer and head.
                let (l, h, t) = (p.layer0 + p.n_layers - 1, g.n_kv_heads - 1, p.t0);
                let staged_at = (((p.n_layers - 1) * 2 + 1) * g.n_kv_heads + h) * p.n * g.head_dim;
                assert_eq!(
                    staged[staged_at].to_f32(),
                    v[((l * g.n_kv_heads + h) * n + t) * g.head_dim]
                );
                unpack_piece(&g, n, p, &staged, &mut k2, &mut v2);
            }
            // Small integers and halves are exact in f16.
            assert_eq!((&k2, &v2), (&k, &v), "cap {cap}");
        }
    }

    #[test]
    fn runs_in_table_checks_the_table() {
        let g = geometry();
        assert!(runs_in_table(&g, &[3, 15], 2, 6));
        assert!(!runs_in_table(&g, &[3, 15], 2, 7));
        assert!(!runs_in_table(&g, &[3, 16], 4, 1));
    }
}
