//! The paged KV pool in device memory: f16 K and V for every layer, allocated once (plain
//! device allocations, never managed memory) and addressed by the block ids the caller's
//! block manager hands out, exactly as `pk_model::KvStore` is.
//!
//! Logical layout is the CPU store's: `num_blocks` blocks of `block_size_tokens` slots per
//! layer, stored token `i` of a sequence at `(block_table[i / B], i % B)`. Physical layout
//! per layer is `[block][kv_head][slot][head_dim]` for K and V alike: the CPU store keeps K
//! transposed within a block for its SIMD score loop, while the GPU kernel reads a block's
//! keys token by token (one warp reads one key's head vector), so a copy between the two
//! (tiers, offload) transposes K within each block; no such copy exists yet.

use cudarc::driver::CudaSlice;
use pk_model::KvGeometry;

use crate::device::{DevPtr, Gpu};
use crate::CudaError;

pub struct GpuKvPool {
    pub geometry: KvGeometry,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
}

impl GpuKvPool {
    pub fn new(gpu: &Gpu, geometry: KvGeometry) -> Result<GpuKvPool, CudaError> {
        let n = geometry.n_layers * geometry.num_blocks * geometry.block_elems();
        Ok(GpuKvPool { geometry, k: gpu.alloc::<u16>(n)?, v: gpu.alloc::<u16>(n)? })
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

    /// One stored token's K and V head vectors of one layer, as f32 (`n_kv_heads * head_dim`
    /// each), for tests; copies the whole layer to the host.
    pub fn read_token(&self, gpu: &Gpu, layer: usize, block: usize, slot: usize) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
        let g = &self.geometry;
        let all_k = gpu.download(&self.k, self.layer_elems() * (layer + 1))?;
        let all_v = gpu.download(&self.v, self.layer_elems() * (layer + 1))?;
        let base = layer * self.layer_elems();
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for h in 0..g.n_kv_heads {
            let at = base + ((block * g.n_kv_heads + h) * g.block_size_tokens + slot) * g.head_dim;
            k.extend(all_k[at..at + g.head_dim].iter().map(|&b| half::f16::from_bits(b).to_f32()));
            v.extend(all_v[at..at + g.head_dim].iter().map(|&b| half::f16::from_bits(b).to_f32()));
        }
        Ok((k, v))
    }
}
