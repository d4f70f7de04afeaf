//! The paged KV pool in device memory: f16 K and V for every layer, allocated once (plain
//! device allocations, never managed memory) and addressed by the block ids the caller's
//! block manager hands out, exactly as `pk_model::KvStore` is.
//!
//! Logical layout is the CPU store's: `num_blocks` blocks of `block_size_tokens` slots per
//! layer, stored token `i` of a sequence at `(block_table[i / B], i % B)`. Physical layout
//! per layer is `[block][kv_head][slot][head_dim]` for K and V alike: the CPU store keeps K
//! transposed within a block for its SIMD score loop, while the GPU kernel reads a block's
//! keys token by token (one warp reads one key's head vector), so a copy between the two
//! (tiers, offload) transposes K within each block. The block operations below take and
//! return per-token rows, as `pk_model::KvBlocks` does, so K needs no transposition here:
//! a row of the pool is a row of the interface.

use cudarc::driver::CudaSlice;
use pk_model::KvGeometry;

use crate::device::{DevPtr, Gpu};
use crate::CudaError;

/// Element offset of a head vector in a pool of `g` (see [`GpuKvPool::offset`]).
fn row_offset(g: &KvGeometry, layer: usize, block: u32, kv_head: usize, slot: usize) -> usize {
    assert!(
        layer < g.n_layers
            && (block as usize) < g.num_blocks
            && kv_head < g.n_kv_heads
            && slot < g.block_size_tokens,
        "KV row out of the pool"
    );
    (((layer * g.num_blocks + block as usize) * g.n_kv_heads + kv_head) * g.block_size_tokens
        + slot)
        * g.head_dim
}

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    K,
    V,
}

pub struct GpuKvPool {
    pub geometry: KvGeometry,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
}

impl GpuKvPool {
    pub fn new(gpu: &Gpu, geometry: KvGeometry) -> Result<GpuKvPool, CudaError> {
        let n = geometry.n_layers * geometry.num_blocks * geometry.block_elems();
        Ok(GpuKvPool {
            geometry,
            k: gpu.alloc::<u16>(n)?,
            v: gpu.alloc::<u16>(n)?,
        })
    }

    /// Bytes of K and V together.
    pub fn capacity_bytes(&self) -> usize {
        2 * 2 * self.geometry.n_layers * self.geometry.num_blocks * self.geometry.block_elems()
    }

    fn layer_elems(&self) -> usize {
        self.geometry.num_blocks * self.geometry.block_elems()
    }

    /// Device addresses of layer `layer`'s K and V.
    pub fn layer_ptrs(&self, gpu: &Gpu, layer: usize) -> (DevPtr, DevPtr) {
        let off = (layer * self.layer_elems() * 2) as u64;
        (gpu.ptr(&self.k) + off, gpu.ptr(&self.v) + off)
    }

    /// Element offset of `(layer, block, kv_head, slot)`'s head vector in K or V: the
    /// layout `rope_kv_write` writes and `paged_attention` reads.
    pub fn offset(&self, layer: usize, block: u32, kv_head: usize, slot: usize) -> usize {
        row_offset(&self.geometry, layer, block, kv_head, slot)
    }

    fn side(&self, which: Side) -> &CudaSlice<u16> {
        match which {
            Side::K => &self.k,
            Side::V => &self.v,
        }
    }

    /// Copies `out.len()` f16 values of K or V from element `at` to the host (a block's
    /// first slots of one KV head are contiguous: slot-major rows).
    pub fn download_at(
        &self,
        gpu: &Gpu,
        which: Side,
        at: usize,
        out: &mut [u16],
    ) -> Result<(), CudaError> {
        if out.is_empty() {
            return Ok(());
        }
        let src = self.side(which).slice(at..at + out.len());
        gpu.stream.memcpy_dtoh(&src, out)?;
        // The host buffer is read as soon as this returns.
        gpu.synchronize()
    }

    /// Copies `rows` (f16 bits) into K or V from element `at` on. Ordered on the stream
    /// after every forward call already enqueued, and before every later one.
    pub fn upload_at(
        &mut self,
        gpu: &Gpu,
        which: Side,
        at: usize,
        rows: &[u16],
    ) -> Result<(), CudaError> {
        if rows.is_empty() {
            return Ok(());
        }
        let dst = match which {
            Side::K => &mut self.k,
            Side::V => &mut self.v,
        };
        let mut view = dst.slice_mut(at..at + rows.len());
        // From pageable memory the driver stages the bytes before returning, so `rows` may
        // be dropped at once.
        gpu.stream.memcpy_htod(rows, &mut view)?;
        Ok(())
    }

    /// Copies one token slot to another in every layer and KV head, K and V (prefill
    /// compaction), on the stream: `2 × n_layers × n_kv_heads` copies of one head vector.
    pub fn copy_slot(
        &mut self,
        gpu: &Gpu,
        src: (u32, usize),
        dst: (u32, usize),
    ) -> Result<(), CudaError> {
        let g = self.geometry;
        let bytes = 2 * g.head_dim;
        let (k, v) = (gpu.ptr(&self.k), gpu.ptr(&self.v));
        for layer in 0..g.n_layers {
            for h in 0..g.n_kv_heads {
                let (s, d) = (
                    self.offset(layer, src.0, h, src.1) as u64 * 2,
                    self.offset(layer, dst.0, h, dst.1) as u64 * 2,
                );
                // SAFETY: both ranges lie inside the pool's allocations (offsets of valid
                // block ids and slots, checked above in debug builds and by the engine's
                // block manager), and a slot never overlaps another.
                unsafe {
                    gpu.copy_raw(k + d, k + s, bytes)?;
                    gpu.copy_raw(v + d, v + s, bytes)?;
                }
            }
        }
        Ok(())
    }

    /// One stored token's K and V head vectors of one layer, as f32 (`n_kv_heads * head_dim`
    /// each), for tests; copies the whole layer to the host.
    pub fn read_token(
        &self,
        gpu: &Gpu,
        layer: usize,
        block: usize,
        slot: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        let g = &self.geometry;
        let all_k = gpu.download(&self.k, self.layer_elems() * (layer + 1))?;
        let all_v = gpu.download(&self.v, self.layer_elems() * (layer + 1))?;
        let base = layer * self.layer_elems();
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for h in 0..g.n_kv_heads {
            let at = base + ((block * g.n_kv_heads + h) * g.block_size_tokens + slot) * g.head_dim;
            k.extend(
                all_k[at..at + g.head_dim]
                    .iter()
                    .map(|&b| half::f16::from_bits(b).to_f32()),
            );
            v.extend(
                all_v[at..at + g.head_dim]
                    .iter()
                    .map(|&b| half::f16::from_bits(b).to_f32()),
            );
        }
        Ok((k, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Offsets follow the kernels' `[layer][block][kv_head][slot][head_dim]` and tile the
    /// pool: every (layer, block, head, slot) has its own row inside the allocation.
    #[test]
    fn offsets_tile_the_pool() {
        let geometry = KvGeometry {
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 4,
            block_size_tokens: 5,
            num_blocks: 6,
        };
        let offset = |l: usize, b: u32, h: usize, s: usize| row_offset(&geometry, l, b, h, s);
        let mut seen = std::collections::HashSet::new();
        for l in 0..2 {
            for b in 0..6 {
                for h in 0..3 {
                    for s in 0..5 {
                        let at = offset(l, b, h, s);
                        assert_eq!(at % 4, 0);
                        assert!(at + 4 <= 2 * 6 * geometry.block_elems());
                        assert!(seen.insert(at));
                    }
                }
            }
        }
        // A block's slots of one head are consecutive rows (what a block read downloads).
        assert_eq!(offset(1, 2, 1, 3), offset(1, 2, 1, 0) + 3 * 4);
        assert_eq!(offset(1, 0, 0, 0), 6 * geometry.block_elems());
    }
}
