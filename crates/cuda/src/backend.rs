//! `pk_model::Backend` on the GPU: `GpuLlama` over a device `GpuKvPool`, so that the
//! engine's scheduler, block manager, eviction policies, tiers and context store run
//! unchanged with the model on an NVIDIA GPU (`pagekeeper serve|generate --device cuda`).
//!
//! The forward pass runs on the device with the CPU's contract (block tables and stored
//! indices from the engine); logits and captured queries come back to the host, where
//! sampling and the policies run. Bulk token ranges — a restored context, a tier's chunk
//! in or out — go through `transfer.rs` (pinned staging, a copy stream, one scatter or
//! gather launch per piece). The small block operations stay host round trips of one
//! block's slice of one layer and KV head: a policy's scan downloads each block it reads
//! once (and waits for it), and a compaction copy is a device-to-device copy per layer and
//! head (see ARCHITECTURE.md).
//!
//! The pool holds f16 rows slot-major (`kv_pool.rs`), which is what `KvBlocks` reads and
//! writes, so rows need a conversion between f16 and f32 but no transposition.

use std::sync::Mutex;

use half::f16;
use pk_model::{Backend, BackendError, KvBlocks, KvDtype, KvGeometry, ModelConfig, SeqForward};

use crate::kv_pool::Side;
use crate::transfer::{TransferStats, Transfers, DEFAULT_STAGING_BYTES};
use crate::{CudaError, Gpu, GpuKvPool, GpuLlama, GpuWeights};

pub struct CudaBackend {
    pub gpu: Gpu,
    pub model: GpuLlama,
    pub pool: GpuKvPool,
    /// The first device error of a block operation (which cannot return one): the pool's
    /// contents are unknown from then on, so every later forward call fails with it.
    failed: Mutex<Option<String>>,
    /// Staging for bulk token ranges; behind a lock because `read_tokens` takes `&self`.
    transfers: Mutex<Transfers>,
}

// SAFETY: the engine owns its backend and uses it from one thread at a time (`&mut self`
// for every call that launches work). What keeps `GpuLlama` from being `Send` are raw
// driver handles (CUDA graphs); the driver API may be called from any host thread with the
// owning context current, and every entry point here binds it first (`Gpu::launch`,
// `Gpu::gemm`, cudarc's copies and graph launches do).
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    /// A backend over `model` with a fresh f16 pool of `geometry` (which must match it).
    pub fn new(gpu: Gpu, model: GpuLlama, geometry: KvGeometry) -> Result<CudaBackend, CudaError> {
        let c = &model.config;
        if (geometry.n_layers, geometry.n_kv_heads, geometry.head_dim)
            != (c.n_layers, c.n_kv_heads, c.head_dim)
        {
            return Err(CudaError::Unsupported(format!(
                "KV geometry {geometry:?} does not match the model"
            )));
        }
        let pool = GpuKvPool::new(&gpu, geometry)?;
        let transfers = Mutex::new(Transfers::new(&gpu, &geometry, DEFAULT_STAGING_BYTES)?);
        Ok(CudaBackend {
            gpu,
            model,
            pool,
            failed: Mutex::new(None),
            transfers,
        })
    }

    /// Replaces the transfers' two staging slots with slots of `bytes` each (at least one
    /// token of one layer): the bound on a bulk transfer's memory and bytes in flight.
    pub fn set_staging_bytes(&mut self, bytes: usize) -> Result<(), CudaError> {
        let stats = self.transfer_stats();
        let mut t = Transfers::new(&self.gpu, &self.pool.geometry, bytes)?;
        t.stats = stats;
        *self.transfers.lock().unwrap_or_else(|p| p.into_inner()) = t;
        Ok(())
    }

    /// Bytes of each staging slot.
    pub fn staging_bytes(&self) -> usize {
        self.transfers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .staging_bytes()
    }

    /// What the bulk transfers have moved so far.
    pub fn transfer_stats(&self) -> TransferStats {
        self.transfers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stats
    }

    /// A model file's weights on `gpu` (dequantised to its GEMM operand type) with a pool of
    /// `geometry` in `dtype`, which must be f16: the device pool holds nothing else yet.
    pub fn from_gguf(
        gpu: Gpu,
        f: &pk_gguf::GgufFile,
        geometry: KvGeometry,
        dtype: KvDtype,
    ) -> Result<CudaBackend, CudaError> {
        if dtype != KvDtype::F16 {
            return Err(CudaError::Unsupported(format!(
                "KV dtype {dtype}: the GPU pool holds f16 K/V only (--kv-dtype f16)"
            )));
        }
        let cfg = ModelConfig::from_gguf(f).map_err(|e| CudaError::Unsupported(e.to_string()))?;
        let weights = GpuWeights::from_gguf(&gpu, f, &cfg)?;
        let model = GpuLlama::new(&gpu, cfg, weights)?;
        CudaBackend::new(gpu, model, geometry)
    }

    /// Keeps the first error of a block operation for the next forward call.
    fn record(&self, r: Result<(), CudaError>) {
        if let Err(e) = r {
            let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            if failed.is_none() {
                eprintln!("error: CUDA KV block operation failed: {e}");
                *failed = Some(e.to_string());
            }
        }
    }

    fn read(&self, which: Side, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        let g = &self.pool.geometry;
        assert!(
            out.len() <= g.block_size_tokens * g.head_dim,
            "a read covers at most one block"
        );
        let mut bits = vec![0u16; out.len()];
        let r = self.pool.download_at(
            &self.gpu,
            which,
            self.pool.offset(layer, block, kv_head, 0),
            &mut bits,
        );
        if r.is_err() {
            out.fill(0.0);
            return self.record(r);
        }
        for (o, b) in out.iter_mut().zip(bits) {
            *o = f16::from_bits(b).to_f32();
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write_rows(
        &mut self,
        layer: usize,
        block: u32,
        kv_head: usize,
        slot0: usize,
        k_rows: &[f32],
        v_rows: &[f32],
        scratch: &mut Vec<f16>,
    ) -> Result<(), CudaError> {
        use half::slice::HalfFloatSliceExt;
        let at = self.pool.offset(layer, block, kv_head, slot0);
        for (which, rows) in [(Side::K, k_rows), (Side::V, v_rows)] {
            scratch.clear();
            scratch.resize(rows.len(), f16::ZERO);
            scratch.convert_from_f32_slice(rows);
            self.pool
                .upload_at(&self.gpu, which, at, scratch.reinterpret_cast())?;
        }
        Ok(())
    }
}

impl KvBlocks for CudaBackend {
    fn geometry(&self) -> KvGeometry {
        self.pool.geometry
    }
    fn dtype(&self) -> KvDtype {
        KvDtype::F16
    }
    fn capacity_bytes(&self) -> usize {
        self.pool.capacity_bytes()
    }
    fn read_k(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        self.read(Side::K, layer, block, kv_head, out)
    }
    fn read_v(&self, layer: usize, block: u32, kv_head: usize, out: &mut [f32]) {
        self.read(Side::V, layer, block, kv_head, out)
    }
    fn write_token(&mut self, layer: usize, block: u32, slot: usize, k: &[f32], v: &[f32]) {
        // A token's heads are not contiguous in a block (`[kv_head][slot][head_dim]`): one
        // row per head.
        let hd = self.pool.geometry.head_dim;
        let mut scratch = Vec::with_capacity(hd);
        for h in 0..self.pool.geometry.n_kv_heads {
            let r = self.write_rows(
                layer,
                block,
                h,
                slot,
                &k[h * hd..(h + 1) * hd],
                &v[h * hd..(h + 1) * hd],
                &mut scratch,
            );
            self.record(r);
        }
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
        let g = &self.pool.geometry;
        let n = k_rows.len() / g.head_dim;
        assert!(
            k_rows.len() == n * g.head_dim
                && v_rows.len() == k_rows.len()
                && slot0 + n <= g.block_size_tokens,
            "rows must fill whole tokens of one block"
        );
        let r = self.write_rows(layer, block, kv_head, slot0, k_rows, v_rows, scratch);
        self.record(r);
    }
    fn copy_slot(&mut self, src: (u32, usize), dst: (u32, usize)) {
        let r = self.pool.copy_slot(&self.gpu, src, dst);
        self.record(r);
    }
    fn write_tokens(&mut self, table: &[u32], first: usize, k: &[f32], v: &[f32]) {
        let r = self
            .transfers
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .write_tokens(&self.gpu, &mut self.pool, table, first, k, v);
        self.record(r);
    }
    fn read_tokens(
        &self,
        table: &[u32],
        first: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), BackendError> {
        // After a failed block operation the pool's contents are unknown: nothing read from
        // it may be kept.
        if let Some(e) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(BackendError::new(
                "cuda",
                format!("an earlier KV block operation failed ({e})"),
            ));
        }
        let r = self
            .transfers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .read_tokens(&self.gpu, &self.pool, table, first, k, v);
        let out = r
            .as_ref()
            .map(|_| ())
            .map_err(|e| BackendError::new("cuda", e));
        self.record(r);
        out
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    fn kv(&self) -> &dyn KvBlocks {
        self
    }
    fn kv_mut(&mut self) -> &mut dyn KvBlocks {
        self
    }
    fn forward_with_queries(
        &mut self,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), BackendError> {
        if let Some(e) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(BackendError::new(
                "cuda",
                format!("an earlier KV block operation failed ({e}); the pool is unusable"),
            ));
        }
        match self
            .model
            .forward_with_queries(&self.gpu, &mut self.pool, seqs, capture_last)
        {
            Ok(out) => Ok(out),
            Err(e) => {
                // A driver or cuBLAS error may have left K/V half-written: nothing runs
                // after it. A refused call (a shape, a token id) changed nothing.
                if matches!(e, CudaError::Driver(_) | CudaError::Blas(_)) {
                    *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                }
                Err(BackendError::new("cuda", e))
            }
        }
    }
}
