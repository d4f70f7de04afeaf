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
//!
//! `Q8` and `Q4` store each token's head vector quantised in groups of 32 dimensions with
//! an f16 scale per group, in the same `[block][kv_head]` regions and with the same
//! transposition of K (format and rationale in `kernels::kv_quant`); every method below
//! quantises on write and dequantises on read, and attention reads the bytes in place.
//! Storage is allocated once at start-up and never grows (a limit, like everything else);
//! its pages are committed by the OS as blocks are first written, so an unused pool costs
//! address space, not memory.

use half::f16;

use crate::config::KvGroupLayout;
use crate::kernels::kv_quant::{QLayout, QuantBits};

/// Element type of the live KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
    /// 8-bit, groups of 32 with an f16 scale: 8.5 bits per element.
    Q8,
    /// 4-bit, groups of 32 with an f16 scale: 4.5 bits per element.
    Q4,
}

impl KvDtype {
    /// Bytes of one token's vector of one KV head (K or V alone), scales included.
    pub fn bytes_per_head_token(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F16 => 2 * head_dim,
            KvDtype::F32 => 4 * head_dim,
            KvDtype::Q8 | KvDtype::Q4 => {
                QLayout::new(self.quant_bits().unwrap(), head_dim, 1).bytes_per_token()
            }
        }
    }
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "f16" => Some(KvDtype::F16),
            "f32" => Some(KvDtype::F32),
            "q8" | "q8_0" => Some(KvDtype::Q8),
            "q4" | "q4_0" => Some(KvDtype::Q4),
            _ => None,
        }
    }
    /// The names `parse` accepts, for help and error texts.
    pub const NAMES: &'static str = "f16, f32, q8 or q4";

    pub(crate) fn quant_bits(self) -> Option<QuantBits> {
        match self {
            KvDtype::Q8 => Some(QuantBits::Q8),
            KvDtype::Q4 => Some(QuantBits::Q4),
            KvDtype::F16 | KvDtype::F32 => None,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
            KvDtype::Q8 => "q8",
            KvDtype::Q4 => "q4",
        })
    }
}

enum Buf {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Buf {
    fn new(dtype: KvDtype, n: usize) -> Buf {
        match dtype {
            KvDtype::F16 => {
                // Zeroed `u16`s come from the allocator's zeroed pages, which the OS commits
                // only when a block is first written; `vec![f16::ZERO; n]` would write every
                // element and make the whole pool resident at start-up (0.9 GB for SmolLM2's
                // default pool). The bits of 0u16 are f16's +0.
                use half::vec::HalfBitsVecExt;
                Buf::F16(vec![0u16; n].reinterpret_into())
            }
            KvDtype::F32 => Buf::F32(vec![0.0; n]),
            KvDtype::Q8 | KvDtype::Q4 => unreachable!("quantised layers are byte buffers"),
        }
    }
    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Buf::F16(b) => {
                // The slice conversion uses F16C where the CPU has it; both round to nearest even.
                use half::slice::HalfFloatSliceExt;
                b[at..at + src.len()].convert_from_f32_slice(src);
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
        2 * self.n_layers * self.n_kv_heads * dtype.bytes_per_head_token(self.head_dim)
    }
}

/// One layer's K and V storage, borrowed by the attention kernels (layout in the module doc).
pub(crate) enum LayerKv<'a> {
    F16 {
        k: &'a [f16],
        v: &'a [f16],
    },
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    /// `head_bytes` per `(block, kv_head)` region, laid out as `layout` says.
    Quant {
        k: &'a [u8],
        v: &'a [u8],
        layout: QLayout,
    },
}

/// Storage of one layer: elements for f16/f32, or quantised head regions.
enum LayerBufs {
    Elems { k: Buf, v: Buf },
    Quant { k: Vec<u8>, v: Vec<u8> },
}

pub struct KvStore {
    pub geometry: KvGeometry,
    pub dtype: KvDtype,
    /// One per layer slot of a block: `geometry.n_layers` without KV cache groups,
    /// `layers_per_block` with them.
    layers: Vec<LayerBufs>,
    /// Per model layer: the index into `layers` holding it.
    layer_slot: Vec<usize>,
    /// The KV cache groups the pool's blocks serve (`None`: one table for every layer).
    grouping: Option<KvGroupLayout>,
    /// The block format when `dtype` is quantised.
    qlayout: Option<QLayout>,
}

impl KvStore {
    /// Panics if `dtype` is quantised and `head_dim` is not a multiple of 32.
    pub fn new(geometry: KvGeometry, dtype: KvDtype) -> KvStore {
        KvStore::with_layer_slots(geometry, dtype, None)
    }

    /// A store whose blocks serve the KV cache groups of `layout`: each block holds
    /// `layout.layers_per_block` layers, and a layer is read and written in the slot the
    /// layout gives it, through the block ids of its own group's table.
    pub fn grouped(geometry: KvGeometry, dtype: KvDtype, layout: KvGroupLayout) -> KvStore {
        assert_eq!(
            layout.layer_slot.len(),
            geometry.n_layers,
            "a slot for every layer"
        );
        KvStore::with_layer_slots(geometry, dtype, Some(layout))
    }

    fn with_layer_slots(
        geometry: KvGeometry,
        dtype: KvDtype,
        grouping: Option<KvGroupLayout>,
    ) -> KvStore {
        let (n_slots, layer_slot) = match &grouping {
            Some(g) => (g.layers_per_block, g.layer_slot.clone()),
            None => (geometry.n_layers, (0..geometry.n_layers).collect()),
        };
        let n = geometry.num_blocks * geometry.block_elems();
        let qlayout = dtype
            .quant_bits()
            .map(|bits| QLayout::new(bits, geometry.head_dim, geometry.block_size_tokens));
        let layers = (0..n_slots)
            .map(|_| match qlayout {
                None => LayerBufs::Elems {
                    k: Buf::new(dtype, n),
                    v: Buf::new(dtype, n),
                },
                Some(q) => {
                    let bytes = geometry.num_blocks * geometry.n_kv_heads * q.head_bytes();
                    LayerBufs::Quant {
                        k: vec![0; bytes],
                        v: vec![0; bytes],
                    }
                }
            })
            .collect();
        KvStore {
            geometry,
            dtype,
            layers,
            layer_slot,
            grouping,
            qlayout,
        }
    }

    /// The KV cache groups this store's blocks serve, if any.
    pub fn grouping(&self) -> Option<&KvGroupLayout> {
        self.grouping.as_ref()
    }

    /// Layers one block holds: every layer without groups, `layers_per_block` with them.
    pub fn layers_per_block(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of one block (K and V of every layer slot, scales included).
    pub fn block_bytes(&self) -> usize {
        let g = &self.geometry;
        2 * self.layers.len()
            * g.n_kv_heads
            * g.block_size_tokens
            * self.dtype.bytes_per_head_token(g.head_dim)
    }

    pub fn capacity_bytes(&self) -> usize {
        self.geometry.num_blocks * self.block_bytes()
    }

    /// Byte offset of `(block, kv_head)`'s region in a quantised layer.
    #[inline]
    fn q_offset(&self, q: &QLayout, block: u32, kv_head: usize) -> usize {
        (block as usize * self.geometry.n_kv_heads + kv_head) * q.head_bytes()
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
            let (kh, vh) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            if let Some(q) = self.qlayout {
                let at = self.q_offset(&q, block, h);
                let LayerBufs::Quant { k: kb, v: vb } = &mut self.layers[self.layer_slot[layer]]
                else {
                    unreachable!()
                };
                q.write_k(&mut kb[at..at + q.head_bytes()], slot, kh);
                q.write_v(&mut vb[at..at + q.head_bytes()], slot, vh);
                continue;
            }
            let (k_at, v_at, bs) = (
                self.k_offset(block, h, slot, 0),
                self.offset(block, h, slot),
                self.geometry.block_size_tokens,
            );
            let LayerBufs::Elems { k: kb, v: vb } = &mut self.layers[self.layer_slot[layer]] else {
                unreachable!()
            };
            for (d, &x) in kh.iter().enumerate() {
                kb.set(k_at + d * bs, x);
            }
            vb.write(v_at, vh);
        }
    }

    /// Writes consecutive tokens of one KV head into one block, starting at `slot0`:
    /// `k_rows` and `v_rows` are `[token][head_dim]`. The bulk form of `write_token` for
    /// restoring a stored context, where per-token calls cost more than the copy itself.
    // The same argument list as `Backend::write_head_rows`, which this implements for the
    // CPU backend and which allows it for the same reason.
    #[allow(clippy::too_many_arguments)]
    pub fn write_head_rows(
        &mut self,
        layer: usize,
        block: u32,
        kv_head: usize,
        slot0: usize,
        k_rows: &[f32],
        v_rows: &[f32],
        scratch: &mut Vec<f16>,
    ) {
        let (hd, bs) = (self.geometry.head_dim, self.geometry.block_size_tokens);
        let n = k_rows.len() / hd;
        assert!(
            k_rows.len() == n * hd && v_rows.len() == n * hd && slot0 + n <= bs,
            "rows must fill whole tokens of one block"
        );
        if let Some(q) = self.qlayout {
            let at = self.q_offset(&q, block, kv_head);
            let LayerBufs::Quant { k: kb, v: vb } = &mut self.layers[self.layer_slot[layer]] else {
                unreachable!()
            };
            for t in 0..n {
                q.write_k(
                    &mut kb[at..at + q.head_bytes()],
                    slot0 + t,
                    &k_rows[t * hd..(t + 1) * hd],
                );
                q.write_v(
                    &mut vb[at..at + q.head_bytes()],
                    slot0 + t,
                    &v_rows[t * hd..(t + 1) * hd],
                );
            }
            return;
        }
        let (k_base, v_at) = (
            self.k_offset(block, kv_head, 0, 0),
            self.offset(block, kv_head, slot0),
        );
        let LayerBufs::Elems { k: kb, v: vb } = &mut self.layers[self.layer_slot[layer]] else {
            unreachable!()
        };
        vb.write(v_at, v_rows);
        match kb {
            Buf::F16(b) => {
                // Convert the rows in one vectorised pass, then scatter them into the block's
                // transposed `[head_dim][slot]` layout.
                use half::slice::HalfFloatSliceExt;
                scratch.clear();
                scratch.resize(k_rows.len(), f16::ZERO);
                scratch.convert_from_f32_slice(k_rows);
                for d in 0..hd {
                    let dst = &mut b[k_base + d * bs + slot0..k_base + d * bs + slot0 + n];
                    for (t, o) in dst.iter_mut().enumerate() {
                        *o = scratch[t * hd + d];
                    }
                }
            }
            Buf::F32(b) => {
                for d in 0..hd {
                    for t in 0..n {
                        b[k_base + d * bs + slot0 + t] = k_rows[t * hd + d];
                    }
                }
            }
        }
    }

    /// Reads the first `n_tokens` slots of one KV head of a block as f32 (`n_tokens × head_dim`).
    pub fn read_k(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        self.read_k_rows(layer, block, kv_head, 0, out)
    }

    /// Reads slots `slot0..slot0 + out.len() / head_dim` of one KV head of a block's K as
    /// f32 rows.
    pub fn read_k_rows(
        &self,
        layer: usize,
        block: u32,
        kv_head: usize,
        slot0: usize,
        out: &mut [f32],
    ) {
        let (hd, bs) = (self.geometry.head_dim, self.geometry.block_size_tokens);
        let n = out.len() / hd;
        assert!(
            out.len() == n * hd && slot0 + n <= bs,
            "rows must be whole tokens of one block"
        );
        match &self.layers[self.layer_slot[layer]] {
            LayerBufs::Elems { k, .. } => {
                // K is transposed within a block (`[head_dim][slot]`): convert a span of
                // whole dimensions in one bulk call (F16C), then transpose the wanted slots
                // into rows. An element-at-a-time read was the slower half of a block read.
                let mut tmp = [0f32; 4096];
                assert!(bs <= tmp.len(), "blocks of at most 4096 tokens");
                let dims = tmp.len() / bs;
                let base = self.offset(block, kv_head, 0);
                for d0 in (0..hd).step_by(dims) {
                    let dn = dims.min(hd - d0);
                    let t = &mut tmp[..dn * bs];
                    k.read(base + d0 * bs, t);
                    for (j, row) in out.chunks_exact_mut(hd).enumerate() {
                        for (dd, o) in row[d0..d0 + dn].iter_mut().enumerate() {
                            *o = t[dd * bs + slot0 + j];
                        }
                    }
                }
            }
            LayerBufs::Quant { k, .. } => {
                let q = self.qlayout.expect("quantised store");
                let head = &k[self.q_offset(&q, block, kv_head)..][..q.head_bytes()];
                for (j, row) in out.chunks_exact_mut(hd).enumerate() {
                    for (d, o) in row.iter_mut().enumerate() {
                        *o = q.k_elem(head, slot0 + j, d);
                    }
                }
            }
        }
    }

    /// Reads one KV head of a block's K transposed, as f32: `out[d * stride + slot]` for every
    /// slot of the block (`stride ≥ block_size_tokens`; padding lanes are left as they are).
    pub fn read_k_transposed(
        &self,
        layer: usize,
        block: u32,
        kv_head: usize,
        stride: usize,
        out: &mut [f32],
    ) {
        let bs = self.geometry.block_size_tokens;
        debug_assert!(
            stride >= bs && out.len() >= (self.geometry.head_dim - 1) * stride + bs,
            "transposed K needs head_dim rows of `stride` floats"
        );
        match &self.layers[self.layer_slot[layer]] {
            LayerBufs::Elems { k, .. } => {
                for d in 0..self.geometry.head_dim {
                    k.read(
                        self.k_offset(block, kv_head, 0, d),
                        &mut out[d * stride..d * stride + bs],
                    );
                }
            }
            LayerBufs::Quant { k, .. } => {
                let q = self.qlayout.expect("quantised store");
                let head = &k[self.q_offset(&q, block, kv_head)..][..q.head_bytes()];
                q.read_k_transposed(head, stride, out);
            }
        }
    }

    /// The raw storage of one layer, for the attention kernels.
    pub(crate) fn layer(&self, layer: usize) -> LayerKv<'_> {
        match &self.layers[self.layer_slot[layer]] {
            LayerBufs::Elems {
                k: Buf::F16(k),
                v: Buf::F16(v),
            } => LayerKv::F16 { k, v },
            LayerBufs::Elems {
                k: Buf::F32(k),
                v: Buf::F32(v),
            } => LayerKv::F32 { k, v },
            LayerBufs::Quant { k, v } => LayerKv::Quant {
                k,
                v,
                layout: self.qlayout.expect("quantised store"),
            },
            _ => unreachable!("K and V share a dtype"),
        }
    }

    /// Offset of `(block, kv_head)`'s first element in either of `layer()`'s slices
    /// (f16/f32 stores; in elements).
    #[inline]
    pub(crate) fn head_offset(&self, block: u32, kv_head: usize) -> usize {
        self.offset(block, kv_head, 0)
    }

    /// Reads the first `n_tokens` slots of one KV head of a block's V (`n_tokens × head_dim`).
    pub fn read_v(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        self.read_v_rows(layer, block, kv_head, 0, out)
    }

    /// Reads slots `slot0..slot0 + out.len() / head_dim` of one KV head of a block's V.
    pub fn read_v_rows(
        &self,
        layer: usize,
        block: u32,
        kv_head: usize,
        slot0: usize,
        out: &mut [f32],
    ) {
        let (hd, bs) = (self.geometry.head_dim, self.geometry.block_size_tokens);
        assert!(
            out.len().is_multiple_of(hd) && slot0 + out.len() / hd <= bs,
            "rows must be whole tokens of one block"
        );
        match &self.layers[self.layer_slot[layer]] {
            LayerBufs::Elems { v, .. } => v.read(self.offset(block, kv_head, slot0), out),
            LayerBufs::Quant { v, .. } => {
                let q = self.qlayout.expect("quantised store");
                let head = &v[self.q_offset(&q, block, kv_head)..][..q.head_bytes()];
                for (j, row) in out.chunks_exact_mut(self.geometry.head_dim).enumerate() {
                    q.read_v(head, slot0 + j, row);
                }
            }
        }
    }

    /// Copies one token slot to another in every layer and KV head (prefill compaction).
    /// Quantised tokens are copied as bytes: they are never re-quantised.
    pub fn copy_slot(&mut self, src: (u32, usize), dst: (u32, usize)) {
        let all_slots: Vec<usize> = (0..self.layers.len()).collect();
        self.copy_slot_in_slots(&all_slots, 0..self.geometry.n_kv_heads, src, dst)
    }

    /// Copies one token slot to another in `layers` and `kv_heads` only (eviction that
    /// chooses tokens per layer or per KV head moves each unit's tokens separately).
    pub fn copy_slot_in(
        &mut self,
        layers: std::ops::Range<usize>,
        kv_heads: std::ops::Range<usize>,
        src: (u32, usize),
        dst: (u32, usize),
    ) {
        // With KV cache groups several layers share a slot index (in blocks of different
        // groups); a block belongs to one group, so each slot is copied once.
        let mut slots: Vec<usize> = layers.map(|l| self.layer_slot[l]).collect();
        slots.sort_unstable();
        slots.dedup();
        self.copy_slot_in_slots(&slots, kv_heads, src, dst)
    }

    fn copy_slot_in_slots(
        &mut self,
        slots: &[usize],
        kv_heads: std::ops::Range<usize>,
        src: (u32, usize),
        dst: (u32, usize),
    ) {
        let hd = self.geometry.head_dim;
        let bs = self.geometry.block_size_tokens;
        for h in kv_heads {
            let (vs, vd) = (self.offset(src.0, h, src.1), self.offset(dst.0, h, dst.1));
            let (ks, kd) = (
                self.k_offset(src.0, h, src.1, 0),
                self.k_offset(dst.0, h, dst.1, 0),
            );
            let q_regions = self
                .qlayout
                .map(|q| (q, self.q_offset(&q, src.0, h), self.q_offset(&q, dst.0, h)));
            for &slot in slots {
                match (&mut self.layers[slot], q_regions) {
                    (LayerBufs::Elems { k, v }, _) => {
                        v.copy_within(vs, vd, hd);
                        k.copy_strided(ks, kd, hd, bs);
                    }
                    (LayerBufs::Quant { k, v }, Some((q, s, d))) => {
                        q.copy_k_slot(k, s, src.1, d, dst.1);
                        q.copy_v_slot(v, s, src.1, d, dst.1);
                    }
                    _ => unreachable!("quantised layers have a layout"),
                }
            }
        }
    }

    /// Copies a whole block (copy-on-write of a shared partial block).
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let n = self.geometry.block_elems();
        let (s, d) = (src as usize * n, dst as usize * n);
        let qn = self
            .qlayout
            .map_or(0, |q| self.geometry.n_kv_heads * q.head_bytes());
        for layer in self.layers.iter_mut() {
            match layer {
                LayerBufs::Elems { k, v } => {
                    k.copy_within(s, d, n);
                    v.copy_within(s, d, n);
                }
                LayerBufs::Quant { k, v } => {
                    let (s, d) = (src as usize * qn, dst as usize * qn);
                    k.copy_within(s..s + qn, d);
                    v.copy_within(s..s + qn, d);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_read_copy_roundtrip() {
        let g = KvGeometry {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
            block_size_tokens: 4,
            num_blocks: 3,
        };
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
            assert_eq!(
                [kt[3], kt[8 + 3], kt[16 + 3], kt[24 + 3]],
                [4.0, 5.0, 6.0, 7.0]
            );
        }
    }

    /// The bulk restore path stores exactly what per-token writes store, in every dtype.
    #[test]
    fn head_rows_match_token_writes() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let g = KvGeometry {
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 64,
            block_size_tokens: 16,
            num_blocks: 4,
        };
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8, KvDtype::Q4] {
            let (mut a, mut b) = (KvStore::new(g, dtype), KvStore::new(g, dtype));
            let n = 11;
            let kvd = g.n_kv_heads * g.head_dim;
            let k: Vec<f32> = (0..n * kvd).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let v: Vec<f32> = (0..n * kvd).map(|_| rng.gen_range(-3.0..3.0)).collect();
            for t in 0..n {
                a.write_token(
                    1,
                    2,
                    3 + t,
                    &k[t * kvd..(t + 1) * kvd],
                    &v[t * kvd..(t + 1) * kvd],
                );
            }
            let mut scratch = Vec::new();
            for h in 0..g.n_kv_heads {
                let rows = |x: &[f32]| {
                    (0..n)
                        .flat_map(|t| x[t * kvd + h * 64..t * kvd + (h + 1) * 64].to_vec())
                        .collect::<Vec<f32>>()
                };
                b.write_head_rows(1, 2, h, 3, &rows(&k), &rows(&v), &mut scratch);
            }
            let (mut x, mut y) = (vec![0f32; 16 * 64], vec![0f32; 16 * 64]);
            for h in 0..g.n_kv_heads {
                a.read_k(1, 2, h, &mut x);
                b.read_k(1, 2, h, &mut y);
                assert_eq!(x, y, "{dtype} K head {h}");
                a.read_v(1, 2, h, &mut x);
                b.read_v(1, 2, h, &mut y);
                assert_eq!(x, y, "{dtype} V head {h}");
            }
        }
    }

    /// Quantised stores: reads agree with each other, copies move exact bytes, and the
    /// reconstruction error is within the format's half step.
    #[test]
    fn quantised_write_read_copy() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let g = KvGeometry {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 64,
            block_size_tokens: 8,
            num_blocks: 4,
        };
        // Largest error for |x| < 2: half a step for q8, a whole step for q4 (kv_quant's tests).
        for (dtype, max_err) in [(KvDtype::Q8, 1.0 / 127.0), (KvDtype::Q4, 2.0 / 8.0)] {
            let mut s = KvStore::new(g, dtype);
            assert_eq!(s.capacity_bytes(), 4 * 8 * g.bytes_per_token(dtype));
            let k: Vec<f32> = (0..128).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let v: Vec<f32> = (0..128).map(|_| rng.gen_range(-2.0..2.0)).collect();
            s.write_token(1, 2, 5, &k, &v);
            let (mut ko, mut vo) = (vec![0f32; 8 * 64], vec![0f32; 8 * 64]);
            s.read_k(1, 2, 1, &mut ko);
            s.read_v(1, 2, 1, &mut vo);
            for d in 0..64 {
                assert!(
                    (ko[5 * 64 + d] - k[64 + d]).abs() <= max_err * 1.01,
                    "{dtype} K d {d}"
                );
                assert!(
                    (vo[5 * 64 + d] - v[64 + d]).abs() <= max_err * 1.01,
                    "{dtype} V d {d}"
                );
            }
            let mut kt = vec![0f32; 64 * 16];
            s.read_k_transposed(1, 2, 1, 16, &mut kt);
            assert!((0..64).all(|d| kt[d * 16 + 5] == ko[5 * 64 + d]));
            s.copy_slot((2, 5), (0, 1));
            let (mut k2, mut v2) = (vec![0f32; 8 * 64], vec![0f32; 8 * 64]);
            s.read_k(1, 0, 1, &mut k2);
            s.read_v(1, 0, 1, &mut v2);
            assert_eq!(&k2[64..128], &ko[5 * 64..6 * 64]);
            assert_eq!(&v2[64..128], &vo[5 * 64..6 * 64]);
            s.copy_block(2, 3);
            s.read_k(1, 3, 1, &mut k2);
            s.read_v(1, 3, 1, &mut v2);
            assert_eq!((k2, v2), (ko, vo));
        }
        assert_eq!(
            g.bytes_per_token(KvDtype::Q8) * 64,
            g.bytes_per_token(KvDtype::F16) * 34
        );
        assert_eq!(
            g.bytes_per_token(KvDtype::Q4) * 64,
            g.bytes_per_token(KvDtype::F16) * 18
        );
    }
}
