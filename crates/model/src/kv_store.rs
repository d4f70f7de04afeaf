//! Physical K/V storage of the paged cache: one array per layer for keys and one for values,
//! indexed by the block ids that `pk-kv`'s pool hands out.
//!
//! Layout per layer: V is `[block][kv_head][slot][head_dim]`, K is stored transposed within
//! each block, `[block][kv_head][head_dim][slot]`. Keeping a KV head's slots of one block
//! contiguous means attention reads `block_size × head_dim` consecutive elements per block
//! and KV head, and block eviction never moves data: it only edits the block table. K is
//! transposed because the attention kernel computes the scores of 16 keys as the 16 lanes
//! of one vector (`s += q[d] · K[d][slot..slot+16]`), which needs a dimension of
//! consecutive keys in one load and no horizontal sums; V is consumed row by row
//! (`acc += p[slot] · V[slot]`), so it stays slot-major. Callers see neither: `read_k`
//! returns slot-major K like `read_v`.
//! Storage is allocated once at start-up and never grows (a limit, like everything else).

use half::f16;

/// Element type of the live KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes_per_elem(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "f16" => Some(KvDtype::F16),
            "f32" => Some(KvDtype::F32),
            _ => None,
        }
    }
}

enum Buf {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Buf {
    fn new(dtype: KvDtype, n: usize) -> Buf {
        match dtype {
            KvDtype::F16 => Buf::F16(vec![f16::ZERO; n]),
            KvDtype::F32 => Buf::F32(vec![0.0; n]),
        }
    }
    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Buf::F16(b) => {
                for (d, &s) in b[at..at + src.len()].iter_mut().zip(src) {
                    *d = f16::from_f32(s);
                }
            }
            Buf::F32(b) => b[at..at + src.len()].copy_from_slice(src),
        }
    }
    fn read(&self, at: usize, out: &mut [f32]) {
        match self {
            Buf::F16(b) => {
                use half::slice::HalfFloatSliceExt;
                b[at..at + out.len()].convert_to_f32_slice(out);
            }
            Buf::F32(b) => out.copy_from_slice(&b[at..at + out.len()]),
        }
    }
    /// Element `at` as f32 (strided reads of transposed K; not a hot path).
    fn get(&self, at: usize) -> f32 {
        match self {
            Buf::F16(b) => b[at].to_f32(),
            Buf::F32(b) => b[at],
        }
    }
    fn set(&mut self, at: usize, x: f32) {
        match self {
            Buf::F16(b) => b[at] = f16::from_f32(x),
            Buf::F32(b) => b[at] = x,
        }
    }
    fn copy_strided(&mut self, src: usize, dst: usize, n: usize, stride: usize) {
        match self {
            Buf::F16(b) => (0..n).for_each(|i| b[dst + i * stride] = b[src + i * stride]),
            Buf::F32(b) => (0..n).for_each(|i| b[dst + i * stride] = b[src + i * stride]),
        }
    }
    fn copy_within(&mut self, src: usize, dst: usize, n: usize) {
        match self {
            Buf::F16(b) => b.copy_within(src..src + n, dst),
            Buf::F32(b) => b.copy_within(src..src + n, dst),
        }
    }
}

/// Geometry of the store.
#[derive(Debug, Clone, Copy)]
pub struct KvGeometry {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size_tokens: usize,
    pub num_blocks: usize,
}

impl KvGeometry {
    /// Elements of one block of one layer, for K (or V) alone.
    pub fn block_elems(&self) -> usize {
        self.n_kv_heads * self.block_size_tokens * self.head_dim
    }
    /// Bytes of K and V of one token over all layers.
    pub fn bytes_per_token(&self, dtype: KvDtype) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype.bytes_per_elem()
    }
}

/// One layer's K and V storage, borrowed by the attention kernels (layout in the module doc).
pub(crate) enum LayerKv<'a> {
    F16 { k: &'a [f16], v: &'a [f16] },
    F32 { k: &'a [f32], v: &'a [f32] },
}

pub struct KvStore {
    pub geometry: KvGeometry,
    pub dtype: KvDtype,
    k: Vec<Buf>,
    v: Vec<Buf>,
}

impl KvStore {
    pub fn new(geometry: KvGeometry, dtype: KvDtype) -> KvStore {
        let n = geometry.num_blocks * geometry.block_elems();
        let k = (0..geometry.n_layers).map(|_| Buf::new(dtype, n)).collect();
        let v = (0..geometry.n_layers).map(|_| Buf::new(dtype, n)).collect();
        KvStore { geometry, dtype, k, v }
    }

    pub fn capacity_bytes(&self) -> usize {
        2 * self.geometry.n_layers * self.geometry.num_blocks * self.geometry.block_elems() * self.dtype.bytes_per_elem()
    }

    #[inline]
    fn offset(&self, block: u32, kv_head: usize, slot: usize) -> usize {
        let g = &self.geometry;
        debug_assert!((block as usize) < g.num_blocks && slot < g.block_size_tokens);
        ((block as usize * g.n_kv_heads + kv_head) * g.block_size_tokens + slot) * g.head_dim
    }

    /// Offset of element `d` of slot `slot` in transposed K.
    #[inline]
    fn k_offset(&self, block: u32, kv_head: usize, slot: usize, d: usize) -> usize {
        self.offset(block, kv_head, 0) + d * self.geometry.block_size_tokens + slot
    }

    /// Writes one token's K and V (all KV heads, `kv_dim` floats each) into `(block, slot)`.
    pub fn write_token(&mut self, layer: usize, block: u32, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.geometry.head_dim;
        for h in 0..self.geometry.n_kv_heads {
            for (d, &x) in k[h * hd..(h + 1) * hd].iter().enumerate() {
                let at = self.k_offset(block, h, slot, d);
                self.k[layer].set(at, x);
            }
            let at = self.offset(block, h, slot);
            self.v[layer].write(at, &v[h * hd..(h + 1) * hd]);
        }
    }

    /// Reads the first `n_tokens` slots of one KV head of a block as f32 (`n_tokens × head_dim`).
    pub fn read_k(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        let hd = self.geometry.head_dim;
        for (j, row) in out.chunks_exact_mut(hd).enumerate() {
            for (d, o) in row.iter_mut().enumerate() {
                *o = self.k[layer].get(self.k_offset(block, kv_head, j, d));
            }
        }
    }

    /// Reads one KV head of a block's K transposed, as f32: `out[d * stride + slot]` for every
    /// slot of the block (`stride ≥ block_size_tokens`; padding lanes are left as they are).
    pub fn read_k_transposed(&self, layer: usize, block: u32, kv_head: usize, stride: usize, out: &mut [f32]) {
        let bs = self.geometry.block_size_tokens;
        debug_assert!(stride >= bs && out.len() >= self.geometry.head_dim * stride);
        for d in 0..self.geometry.head_dim {
            self.k[layer].read(self.k_offset(block, kv_head, 0, d), &mut out[d * stride..d * stride + bs]);
        }
    }

    /// The raw storage of one layer, for the attention kernels.
    pub(crate) fn layer(&self, layer: usize) -> LayerKv<'_> {
        match (&self.k[layer], &self.v[layer]) {
            (Buf::F16(k), Buf::F16(v)) => LayerKv::F16 { k, v },
            (Buf::F32(k), Buf::F32(v)) => LayerKv::F32 { k, v },
            _ => unreachable!("K and V share a dtype"),
        }
    }

    /// Offset of `(block, kv_head)`'s first element in either of `layer()`'s slices.
    #[inline]
    pub(crate) fn head_offset(&self, block: u32, kv_head: usize) -> usize {
        self.offset(block, kv_head, 0)
    }

    pub fn read_v(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        self.v[layer].read(self.offset(block, kv_head, 0), out);
    }

    /// Copies one token slot to another in every layer and KV head (prefill compaction).
    pub fn copy_slot(&mut self, src: (u32, usize), dst: (u32, usize)) {
        let hd = self.geometry.head_dim;
        for layer in 0..self.geometry.n_layers {
            for h in 0..self.geometry.n_kv_heads {
                let (s, d) = (self.offset(src.0, h, src.1), self.offset(dst.0, h, dst.1));
                self.v[layer].copy_within(s, d, hd);
                let (s, d) = (self.k_offset(src.0, h, src.1, 0), self.k_offset(dst.0, h, dst.1, 0));
                self.k[layer].copy_strided(s, d, hd, self.geometry.block_size_tokens);
            }
        }
    }

    /// Copies a whole block (copy-on-write of a shared partial block).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let n = self.geometry.block_elems();
        let (s, d) = (src as usize * n, dst as usize * n);
        for layer in 0..self.geometry.n_layers {
            self.k[layer].copy_within(s, d, n);
            self.v[layer].copy_within(s, d, n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_copy_roundtrip() {
        let g = KvGeometry { n_layers: 2, n_kv_heads: 2, head_dim: 4, block_size_tokens: 4, num_blocks: 3 };
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut s = KvStore::new(g, dtype);
            let k: Vec<f32> = (0..8).map(|i| i as f32).collect();
            let v: Vec<f32> = (0..8).map(|i| -(i as f32)).collect();
            s.write_token(1, 2, 3, &k, &v);
            let mut out = vec![0f32; 16];
            s.read_k(1, 2, 1, &mut out);
            assert_eq!(&out[12..16], &[4.0, 5.0, 6.0, 7.0]);
            s.copy_slot((2, 3), (0, 1));
            s.read_v(1, 0, 0, &mut out);
            assert_eq!(&out[4..8], &[-0.0, -1.0, -2.0, -3.0]);
            s.read_k(1, 0, 0, &mut out);
            assert_eq!(&out[4..8], &[0.0, 1.0, 2.0, 3.0]);
            s.copy_block(2, 1);
            s.read_k(1, 1, 1, &mut out);
            assert_eq!(&out[12..16], &[4.0, 5.0, 6.0, 7.0]);
            let mut kt = vec![0f32; 4 * 8];
            s.read_k_transposed(1, 1, 1, 8, &mut kt);
            assert_eq!([kt[3], kt[8 + 3], kt[16 + 3], kt[24 + 3]], [4.0, 5.0, 6.0, 7.0]);
        }
    }
}
