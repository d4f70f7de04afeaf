//! The backend seam: a forward pass plus the paged KV pool it writes, behind two
//! object-safe traits, so that the engine (scheduler, block manager, eviction policies,
//! tiers, context store) drives a CPU model or a GPU model through the same code.
//!
//! What crosses the seam is small on purpose. The engine hands a backend a batch of
//! [`SeqForward`]s (token ids, positions, block tables it owns) and gets logits rows back,
//! plus the post-RoPE queries that attention-based eviction policies score with. Between
//! forward calls it reads and writes the pool's bytes a block at a time through
//! [`KvBlocks`]: policies read K/V, compaction copies slots, the tiers and the context store
//! restore tokens. Block ids, reference counts, block tables and every decision about them
//! stay on the host in `pk-kv` and `pk-engine`; a backend never allocates or frees a block.
//!
//! Calls through the traits are dynamic (`Box<dyn Backend>` in the engine, so no generic
//! parameter spreads through the engine, server and CLI): one virtual call per forward pass
//! and one per block operation, never one per element.
//!
//! [`CpuBackend`] is `Llama` over a host [`KvStore`]; `pk-cuda` provides the GPU one.

use half::f16;

use crate::config::ModelConfig;
use crate::kv_store::{KvDtype, KvGeometry, KvStore};
use crate::llama::{Llama, SeqForward};

/// A failed forward pass or device operation. The CPU backend never fails; a GPU backend
/// reports driver errors, out-of-memory and unsupported shapes this way, and the engine
/// fails the batch's requests instead of panicking.
#[derive(Debug, thiserror::Error)]
#[error("{backend} backend: {message}")]
pub struct BackendError {
    pub backend: String,
    pub message: String,
}

impl BackendError {
    pub fn new(backend: &str, message: impl std::fmt::Display) -> BackendError {
        BackendError {
            backend: backend.to_string(),
            message: message.to_string(),
        }
    }
}

/// The KV data operations the engine performs on a pool, in the CPU store's terms: blocks
/// of `block_size_tokens` slots per layer, addressed by block id, and per-token rows of
/// `head_dim` f32 values whatever the pool stores (f16, f32, quantised) or how it lays
/// them out (the CPU store transposes K within a block; the GPU pool does not).
///
/// Block operations are infallible here: on the CPU they cannot fail, and a GPU backend
/// that fails one records the error and returns it from its next forward call (a device
/// error leaves the pool in an unknown state, so the batch that follows must not run).
pub trait KvBlocks {
    fn geometry(&self) -> KvGeometry;
    fn dtype(&self) -> KvDtype;
    /// Bytes of K and V of the whole pool.
    fn capacity_bytes(&self) -> usize;
    /// Reads the first `out.len() / head_dim` slots of one KV head of a block's K as rows
    /// (`[slot][head_dim]`).
    fn read_k(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]);
    /// As `read_k`, for V.
    fn read_v(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]);
    /// Writes one token's K and V (all KV heads, `n_kv_heads * head_dim` floats each) into
    /// `(block, slot)` of one layer.
    fn write_token(&mut self, layer: usize, block: u32, slot: usize, k: &[f32], v: &[f32]);
    /// Writes consecutive tokens of one KV head into one block from `slot0` on (`k_rows` and
    /// `v_rows` are `[token][head_dim]`); `scratch` is reused across calls by the caller.
    #[allow(clippy::too_many_arguments)]
    fn write_head_rows(
        &mut self,
        layer: usize,
        block: u32,
        kv_head: usize,
        slot0: usize,
        k_rows: &[f32],
        v_rows: &[f32],
        scratch: &mut Vec<f16>,
    );
    /// Copies one token slot to another in every layer and KV head (prefill compaction).
    fn copy_slot(&mut self, src: (u32, usize), dst: (u32, usize));
    /// Copies one token slot to another in `layers` and `kv_heads` only (eviction at `layer`
    /// or `head` granularity moves each unit's tokens separately). The default reads the
    /// source block's rows of each (layer, KV head) and writes one row; the CPU store
    /// copies bytes in place.
    fn copy_slot_in(
        &mut self,
        layers: std::ops::Range<usize>,
        kv_heads: std::ops::Range<usize>,
        src: (u32, usize),
        dst: (u32, usize),
    ) {
        let hd = self.geometry().head_dim;
        let (mut k, mut v) = (vec![0f32; (src.1 + 1) * hd], vec![0f32; (src.1 + 1) * hd]);
        let mut scratch = Vec::new();
        for layer in layers {
            for h in kv_heads.clone() {
                self.read_k(layer, src.0, h, &mut k);
                self.read_v(layer, src.0, h, &mut v);
                let row = src.1 * hd..(src.1 + 1) * hd;
                self.write_head_rows(
                    layer,
                    dst.0,
                    h,
                    dst.1,
                    &k[row.clone()],
                    &v[row],
                    &mut scratch,
                );
            }
        }
    }
    /// Writes `n` consecutive stored tokens of a sequence, stored indices `first..first + n`
    /// of the block table `table`, from `k` and `v` in a stored context's layout
    /// (`[layer][kv_head][token][head_dim]`, `n` tokens): the bulk form of `write_token` that
    /// restoring a context or a tier's chunk uses. The default writes one run of rows per
    /// (layer, KV head, block); a GPU backend overrides it to stage the whole range through
    /// pinned buffers and scatter it on the device.
    fn write_tokens(&mut self, table: &[u32], first: usize, k: &[f32], v: &[f32]) {
        let g = self.geometry();
        let n = token_range_len(&g, table, first, k.len(), v.len());
        let (hd, bs) = (g.head_dim, g.block_size_tokens);
        let mut scratch = Vec::new();
        for lh in 0..g.n_layers * g.n_kv_heads {
            let (layer, h) = (lh / g.n_kv_heads, lh % g.n_kv_heads);
            let (ks, vs) = (
                &k[lh * n * hd..(lh + 1) * n * hd],
                &v[lh * n * hd..(lh + 1) * n * hd],
            );
            for (t0, t1) in block_runs(first, n, bs) {
                let rows = (t0 - first) * hd..(t1 - first) * hd;
                self.write_head_rows(
                    layer,
                    table[t0 / bs],
                    h,
                    t0 % bs,
                    &ks[rows.clone()],
                    &vs[rows],
                    &mut scratch,
                );
            }
        }
    }
    /// Reads stored indices `first..first + n` of `table` into `k` and `v` in a stored
    /// context's layout (the inverse of `write_tokens`). The default reads a block of one
    /// (layer, KV head) at a time. Unlike the single-block reads this one reports a device
    /// failure: its result is kept (tiers, the context store), so it must never be zeros
    /// standing in for data.
    fn read_tokens(
        &self,
        table: &[u32],
        first: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        let g = self.geometry();
        let n = token_range_len(&g, table, first, k.len(), v.len());
        let (hd, bs) = (g.head_dim, g.block_size_tokens);
        let mut buf = vec![0f32; bs * hd];
        for lh in 0..g.n_layers * g.n_kv_heads {
            let (layer, h) = (lh / g.n_kv_heads, lh % g.n_kv_heads);
            for (t0, t1) in block_runs(first, n, bs) {
                let (s0, s1) = (t0 % bs, t0 % bs + (t1 - t0));
                let out = (lh * n + t0 - first) * hd..(lh * n + t1 - first) * hd;
                self.read_k(layer, table[t0 / bs], h, &mut buf[..s1 * hd]);
                k[out.clone()].copy_from_slice(&buf[s0 * hd..s1 * hd]);
                self.read_v(layer, table[t0 / bs], h, &mut buf[..s1 * hd]);
                v[out].copy_from_slice(&buf[s0 * hd..s1 * hd]);
            }
        }
        Ok(())
    }
    /// The host store itself, for callers that need the CPU's concrete type (none in the
    /// engine; benchmarks and tests of the CPU kernels).
    fn as_kv_store(&self) -> Option<&KvStore> {
        None
    }
}

/// The number of tokens in a `write_tokens`/`read_tokens` range whose K and V hold
/// `k_len` and `v_len` floats; panics unless both are whole tokens of every layer and head
/// and the table covers the range (the engine's block manager guarantees both).
pub fn token_range_len(
    g: &KvGeometry,
    table: &[u32],
    first: usize,
    k_len: usize,
    v_len: usize,
) -> usize {
    let per_token = g.n_layers * g.n_kv_heads * g.head_dim;
    let n = k_len / per_token;
    assert!(
        k_len == n * per_token && v_len == k_len,
        "K and V must hold whole tokens of every layer and KV head"
    );
    assert!(
        (first + n).div_ceil(g.block_size_tokens) <= table.len(),
        "the block table does not cover stored tokens {first}..{}",
        first + n
    );
    n
}

/// The maximal runs `[t0, t1)` of `first..first + n` that lie in one block each.
pub fn block_runs(
    first: usize,
    n: usize,
    block_size_tokens: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let end = first + n;
    let mut t = first;
    std::iter::from_fn(move || {
        if t >= end {
            return None;
        }
        let t1 = ((t / block_size_tokens + 1) * block_size_tokens).min(end);
        let run = (t, t1);
        t = t1;
        Some(run)
    })
}

/// A model's forward pass and the KV pool it reads and writes.
pub trait Backend: Send {
    /// A short name for logs, metrics and cache namespaces: "cpu", "cuda".
    fn name(&self) -> &str;
    fn config(&self) -> &ModelConfig;
    fn kv(&self) -> &dyn KvBlocks;
    fn kv_mut(&mut self) -> &mut dyn KvBlocks;
    /// Runs the new tokens of every sequence, writing their K/V into the pool, and returns
    /// the requested logits rows (`vocab_size` floats each, in order) and, per sequence, the
    /// post-RoPE queries of its last `capture_last[i]` new tokens (`[layer][token][n_heads *
    /// head_dim]`; a missing entry means none), with `Llama::forward_with_queries`'s contract.
    fn forward_with_queries(
        &mut self,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), BackendError>;
    /// `forward_with_queries`, with the captured rows' attention log-sum-exp as well
    /// (`[layer][token][n_heads]` per sequence, `Llama::forward_capturing`'s contract),
    /// where this backend computes it; `None` where it does not (the default).
    #[allow(clippy::type_complexity)]
    fn forward_with_queries_lse(
        &mut self,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>, Option<Vec<Vec<f32>>>), BackendError> {
        self.forward_with_queries(seqs, capture_last)
            .map(|(logits, queries)| (logits, queries, None))
    }
    /// `forward_with_queries` without queries.
    /// Rebuilds the (still unused) KV pool for the KV cache groups of `layout`: `num_blocks`
    /// blocks of `layout.layers_per_block` layers each, every layer in its group's slot.
    /// A backend that keeps one block table for all layers says so as an error, and the
    /// engine then runs with one group.
    fn use_kv_groups(
        &mut self,
        layout: &crate::config::KvGroupLayout,
        num_blocks: usize,
    ) -> Result<(), BackendError> {
        let _ = (layout, num_blocks);
        Err(BackendError::new(
            self.name(),
            "this backend reads one block table for every layer (no KV cache groups)",
        ))
    }
    fn forward(&mut self, seqs: &[SeqForward]) -> Result<Vec<f32>, BackendError> {
        self.forward_with_queries(seqs, &[])
            .map(|(logits, _)| logits)
    }
    /// The CPU model, for callers that run it outside the pool (benchmarks of the codecs).
    fn cpu_model(&self) -> Option<&Llama> {
        None
    }
}

impl KvBlocks for KvStore {
    fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    fn dtype(&self) -> KvDtype {
        self.dtype
    }
    fn capacity_bytes(&self) -> usize {
        KvStore::capacity_bytes(self)
    }
    fn read_k(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        KvStore::read_k(self, layer, block, kv_head, out)
    }
    fn read_v(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        KvStore::read_v(self, layer, block, kv_head, out)
    }
    fn write_token(&mut self, layer: usize, block: u32, slot: usize, k: &[f32], v: &[f32]) {
        KvStore::write_token(self, layer, block, slot, k, v)
    }
    fn write_head_rows(
        &mut self,
        layer: usize,
        block: u32,
        kv_head: usize,
        slot0: usize,
        k_rows: &[f32],
        v_rows: &[f32],
        scratch: &mut Vec<f16>,
    ) {
        KvStore::write_head_rows(self, layer, block, kv_head, slot0, k_rows, v_rows, scratch)
    }
    fn copy_slot(&mut self, src: (u32, usize), dst: (u32, usize)) {
        KvStore::copy_slot(self, src, dst)
    }
    fn copy_slot_in(
        &mut self,
        layers: std::ops::Range<usize>,
        kv_heads: std::ops::Range<usize>,
        src: (u32, usize),
        dst: (u32, usize),
    ) {
        KvStore::copy_slot_in(self, layers, kv_heads, src, dst)
    }
    /// Converts straight from the store into the caller's rows (no block buffer between).
    fn read_tokens(
        &self,
        table: &[u32],
        first: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        let g = self.geometry;
        let n = token_range_len(&g, table, first, k.len(), v.len());
        let (hd, bs) = (g.head_dim, g.block_size_tokens);
        for lh in 0..g.n_layers * g.n_kv_heads {
            let (layer, h) = (lh / g.n_kv_heads, lh % g.n_kv_heads);
            for (t0, t1) in block_runs(first, n, bs) {
                let rows = (lh * n + t0 - first) * hd..(lh * n + t1 - first) * hd;
                self.read_k_rows(layer, table[t0 / bs], h, t0 % bs, &mut k[rows.clone()]);
                self.read_v_rows(layer, table[t0 / bs], h, t0 % bs, &mut v[rows]);
            }
        }
        Ok(())
    }
    fn as_kv_store(&self) -> Option<&KvStore> {
        Some(self)
    }
}

/// The CPU backend: `Llama` (SIMD kernels, rayon and the decode pool) over a host
/// `KvStore`. Calls go straight to `Llama::forward_with_queries`: nothing is added to the
/// hot path but the one virtual call per forward pass.
pub struct CpuBackend {
    pub model: Llama,
    pub store: KvStore,
}

impl CpuBackend {
    /// A backend with a fresh store of `geometry` (which must match the model) in `dtype`.
    pub fn new(model: Llama, geometry: KvGeometry, dtype: KvDtype) -> CpuBackend {
        let c = &model.config;
        assert!(
            (geometry.n_layers, geometry.n_kv_heads, geometry.head_dim)
                == (c.n_layers, c.n_kv_heads, c.head_dim),
            "KV geometry {geometry:?} does not match the model"
        );
        CpuBackend {
            store: KvStore::new(geometry, dtype),
            model,
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn kv(&self) -> &dyn KvBlocks {
        &self.store
    }
    fn kv_mut(&mut self) -> &mut dyn KvBlocks {
        &mut self.store
    }
    fn forward_with_queries(
        &mut self,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), BackendError> {
        Ok(self
            .model
            .forward_with_queries(&mut self.store, seqs, capture_last))
    }
    fn forward_with_queries_lse(
        &mut self,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>, Option<Vec<Vec<f32>>>), BackendError> {
        let (logits, captures) =
            self.model
                .forward_capturing(&mut self.store, seqs, capture_last, true);
        Ok((logits, captures.queries, captures.lse))
    }
    fn use_kv_groups(
        &mut self,
        layout: &crate::config::KvGroupLayout,
        num_blocks: usize,
    ) -> Result<(), BackendError> {
        let geometry = KvGeometry {
            num_blocks,
            ..self.store.geometry
        };
        // The old store's pages were never written (the engine calls this before any
        // sequence), so dropping it returns only address space.
        self.store = KvStore::grouped(geometry, self.store.dtype, layout.clone());
        Ok(())
    }
    fn cpu_model(&self) -> Option<&Llama> {
        Some(&self.model)
    }
}

/// A host store seen only through `KvBlocks`' required methods, so that every provided
/// method runs its default and `as_kv_store` is `None`: what a backend without overrides
/// gets, and what a device pool looks like to the engine (tests of both use it).
pub struct BlockOpsOnly(pub KvStore);

impl KvBlocks for BlockOpsOnly {
    fn geometry(&self) -> KvGeometry {
        self.0.geometry
    }
    fn dtype(&self) -> KvDtype {
        self.0.dtype
    }
    fn capacity_bytes(&self) -> usize {
        self.0.capacity_bytes()
    }
    fn read_k(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        self.0.read_k(layer, block, kv_head, out)
    }
    fn read_v(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        self.0.read_v(layer, block, kv_head, out)
    }
    fn write_token(&mut self, layer: usize, block: u32, slot: usize, k: &[f32], v: &[f32]) {
        self.0.write_token(layer, block, slot, k, v)
    }
    fn write_head_rows(
        &mut self,
        layer: usize,
        block: u32,
        kv_head: usize,
        slot0: usize,
        k_rows: &[f32],
        v_rows: &[f32],
        scratch: &mut Vec<f16>,
    ) {
        self.0
            .write_head_rows(layer, block, kv_head, slot0, k_rows, v_rows, scratch)
    }
    fn copy_slot(&mut self, src: (u32, usize), dst: (u32, usize)) {
        self.0.copy_slot(src, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Weights;
    use pk_gguf::GgmlType;

    /// The backend is the model over its store: the same logits and captured queries as
    /// calling `Llama` directly, and the same K/V read back through either interface.
    #[test]
    fn cpu_backend_is_llama_over_its_store() {
        let mut cfg = ModelConfig::dummy("smollm2-135m").unwrap();
        cfg.n_layers = 2;
        cfg.vocab_size = 512;
        let g = KvGeometry {
            n_layers: 2,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            block_size_tokens: 16,
            num_blocks: 4,
        };
        let weights = || Weights::random(&cfg, GgmlType::Q4_1, 3);
        let direct = Llama::new(cfg.clone(), weights());
        let mut store = KvStore::new(g, KvDtype::F16);
        let mut backend: Box<dyn Backend> = Box::new(CpuBackend::new(
            Llama::new(cfg.clone(), weights()),
            g,
            KvDtype::F16,
        ));
        let table = [2u32, 0, 3];
        let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 1) % 512).collect();
        let seq = [SeqForward {
            tokens: &prompt,
            start_position: 0,
            stored_start: 0,
            block_table: &table,
            logits_from: 38,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        }];
        let want = direct.forward_with_queries(&mut store, &seq, &[3]);
        let got = backend.forward_with_queries(&seq, &[3]).unwrap();
        assert_eq!(want, got);
        assert_eq!(got.1[0].len(), 2 * 3 * cfg.q_dim());
        let (mut a, mut b) = (vec![0f32; 16 * g.head_dim], vec![0f32; 16 * g.head_dim]);
        for (layer, block, head) in [(0, 2, 0), (1, 3, 1), (1, 0, 2)] {
            store.read_k(layer, block, head, &mut a);
            backend.kv().read_k(layer, block, head, &mut b);
            assert_eq!(a, b);
            store.read_v(layer, block, head, &mut a);
            backend.kv().read_v(layer, block, head, &mut b);
            assert_eq!(a, b);
        }
        assert_eq!(backend.kv().capacity_bytes(), store.capacity_bytes());
        assert!(backend.kv().as_kv_store().is_some() && backend.cpu_model().is_some());
        assert_eq!(backend.name(), "cpu");
    }

    /// The bulk token-range operations equal their per-token and per-block forms in every
    /// dtype, for ranges that start and end inside blocks and cross several.
    #[test]
    fn token_ranges_match_per_token_writes_and_block_reads() {
        let g = KvGeometry {
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 32,
            block_size_tokens: 4,
            num_blocks: 8,
        };
        let table = [5u32, 1, 7, 0, 3];
        let per_token = g.n_layers * g.n_kv_heads * g.head_dim;
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8, KvDtype::Q4] {
            for (first, n) in [(0usize, 20usize), (3, 9), (5, 2), (8, 4), (7, 0)] {
                let k: Vec<f32> = (0..n * per_token)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
                    .collect();
                let v: Vec<f32> = (0..n * per_token)
                    .map(|i| ((i * 53 % 89) as f32 - 44.0) / 13.0)
                    .collect();
                let (mut bulk, mut single) = (KvStore::new(g, dtype), KvStore::new(g, dtype));
                KvBlocks::write_tokens(&mut bulk, &table, first, &k, &v);
                let kvd = g.n_kv_heads * g.head_dim;
                for t in 0..n {
                    let (mut kt, mut vt) = (vec![0f32; kvd], vec![0f32; kvd]);
                    for layer in 0..g.n_layers {
                        for h in 0..g.n_kv_heads {
                            let at = ((layer * g.n_kv_heads + h) * n + t) * g.head_dim;
                            kt[h * g.head_dim..(h + 1) * g.head_dim]
                                .copy_from_slice(&k[at..at + g.head_dim]);
                            vt[h * g.head_dim..(h + 1) * g.head_dim]
                                .copy_from_slice(&v[at..at + g.head_dim]);
                        }
                        let s = first + t;
                        single.write_token(layer, table[s / 4], s % 4, &kt, &vt);
                    }
                }
                let (mut a, mut b) = (vec![0f32; 4 * g.head_dim], vec![0f32; 4 * g.head_dim]);
                for layer in 0..g.n_layers {
                    for &block in &table {
                        for h in 0..g.n_kv_heads {
                            bulk.read_k(layer, block, h, &mut a);
                            single.read_k(layer, block, h, &mut b);
                            assert_eq!(
                                a, b,
                                "{dtype} K layer {layer} block {block} head {h} for {first}+{n}"
                            );
                            bulk.read_v(layer, block, h, &mut a);
                            single.read_v(layer, block, h, &mut b);
                            assert_eq!(
                                a, b,
                                "{dtype} V layer {layer} block {block} head {h} for {first}+{n}"
                            );
                        }
                    }
                }
                // Reading the range back gives what the store holds: the input itself in
                // f32, its rounding in the others; the store's own read and the trait's
                // default (what a backend without an override gets) agree.
                let (mut kb, mut vb) = (vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
                KvBlocks::read_tokens(&bulk, &table, first, &mut kb, &mut vb).unwrap();
                let (mut kd, mut vd) = (vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
                let mut defaults = BlockOpsOnly(KvStore::new(g, dtype));
                defaults.write_tokens(&table, first, &k, &v);
                defaults
                    .read_tokens(&table, first, &mut kd, &mut vd)
                    .unwrap();
                assert_eq!(
                    (&kd, &vd),
                    (&kb, &vb),
                    "{dtype}: default read_tokens for {first}+{n}"
                );
                if dtype == KvDtype::F32 {
                    assert_eq!((&kb, &vb), (&k, &v));
                }
                for t in 0..n {
                    let s = first + t;
                    for layer in 0..g.n_layers {
                        for h in 0..g.n_kv_heads {
                            bulk.read_k(layer, table[s / 4], h, &mut a);
                            bulk.read_v(layer, table[s / 4], h, &mut b);
                            let at = ((layer * g.n_kv_heads + h) * n + t) * g.head_dim;
                            let row = (s % 4) * g.head_dim..(s % 4 + 1) * g.head_dim;
                            assert_eq!(&kb[at..at + g.head_dim], &a[row.clone()]);
                            assert_eq!(&vb[at..at + g.head_dim], &b[row]);
                        }
                    }
                }
            }
        }
    }

    /// `copy_slot_in` moves one token in the named layers and KV heads only, in every
    /// dtype; the store's byte copy and the trait's default (read rows, write a row) agree.
    #[test]
    fn copy_slot_in_touches_only_its_layers_and_heads() {
        let g = KvGeometry {
            n_layers: 3,
            n_kv_heads: 2,
            head_dim: 32,
            block_size_tokens: 4,
            num_blocks: 4,
        };
        let table = [2u32, 0, 3, 1];
        let n = 16;
        let per_token = g.n_layers * g.n_kv_heads * g.head_dim;
        let k: Vec<f32> = (0..n * per_token)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let v: Vec<f32> = (0..n * per_token)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 13.0)
            .collect();
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8, KvDtype::Q4] {
            let filled = || {
                let mut store = KvStore::new(g, dtype);
                KvBlocks::write_tokens(&mut store, &table, 0, &k, &v);
                store
            };
            let (mut fast, before, mut slow) = (filled(), filled(), BlockOpsOnly(filled()));
            fast.copy_slot_in(1..2, 1..2, (3, 2), (2, 1));
            slow.copy_slot_in(1..2, 1..2, (3, 2), (2, 1));
            let (mut a, mut b, mut c) = (
                vec![0f32; 4 * g.head_dim],
                vec![0f32; 4 * g.head_dim],
                vec![0f32; 4 * g.head_dim],
            );
            for layer in 0..3 {
                for h in 0..2 {
                    for &block in &table {
                        for read in [KvStore::read_k, KvStore::read_v] {
                            read(&fast, layer, block, h, &mut a);
                            read(&slow.0, layer, block, h, &mut b);
                            assert_eq!(a, b, "{dtype}: store and default differ at layer {layer} head {h} block {block}");
                            read(&before, layer, block, h, &mut c);
                            if (layer, h, block) == (1, 1, 2) {
                                let mut src = vec![0f32; 4 * g.head_dim];
                                read(&before, layer, 3, h, &mut src);
                                assert_eq!(a[32..64], src[64..96], "{dtype}: the moved row");
                                assert_eq!(
                                    (&a[..32], &a[64..]),
                                    (&c[..32], &c[64..]),
                                    "{dtype}: the other rows"
                                );
                            } else {
                                assert_eq!(
                                    a, c,
                                    "{dtype}: layer {layer} head {h} block {block} untouched"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn block_runs_split_a_range_at_block_boundaries() {
        assert_eq!(
            block_runs(3, 9, 4).collect::<Vec<_>>(),
            vec![(3, 4), (4, 8), (8, 12)]
        );
        assert_eq!(block_runs(8, 4, 4).collect::<Vec<_>>(), vec![(8, 12)]);
        assert_eq!(block_runs(5, 0, 4).count(), 0);
    }
}
