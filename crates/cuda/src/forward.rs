//! The Llama forward pass on the GPU, with `pk_model::Llama::forward`'s contract: a batch of
//! sequences, each with new tokens, a start position, a stored index and a block table;
//! K/V written into the device pool at `(block_table[i / B], i % B)`; logits for the
//! requested rows. Prefill and decode share one path, as on the CPU.
//!
//! Per layer: RMSNorm → one QKV GEMM → RoPE on Q and K → K/V into the pool → paged
//! attention → output GEMM added into the residual (cuBLAS beta = 1) → RMSNorm → one
//! gate/up GEMM → SwiGLU → down GEMM added into the residual. The residual stream and GEMM
//! outputs are f32; GEMM inputs are act_t (f16 or bf16) with f32 accumulation.

use cudarc::driver::CudaSlice;
use pk_model::{ModelConfig, RopeStyle, SeqForward};

use crate::attention::{plan, AttnPlan};
use crate::device::{DevPtr, Gpu};
use crate::kv_pool::GpuKvPool;
use crate::weights::GpuWeights;
use crate::{kargs, CudaError};

pub struct GpuLlama {
    pub config: ModelConfig,
    pub weights: GpuWeights,
    inv_freq: CudaSlice<f32>,
    scratch: Scratch,
}

/// Activation buffers, grown (never shrunk) to the largest call so far.
#[derive(Default)]
struct Scratch {
    rows: usize,
    partial_floats: usize,
    meta_ints: usize,
    logit_rows: usize,
    bufs: Option<Bufs>,
}

struct Bufs {
    x: CudaSlice<f32>,
    h: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<u16>,
    gate_up: CudaSlice<f32>,
    act_ff: CudaSlice<u16>,
    partial: CudaSlice<f32>,
    meta: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    argmax: CudaSlice<i32>,
}

/// Offsets (in i32s) of each section of the per-call metadata, uploaded as one buffer.
struct Meta {
    ints: Vec<i32>,
    n_out: usize,
    tokens: usize,
    positions: usize,
    slots: usize,
    out_rows: usize,
    seqs: usize,
    items: usize,
    row_splits: usize,
    tables: usize,
}

impl GpuLlama {
    pub fn new(gpu: &Gpu, config: ModelConfig, weights: GpuWeights) -> Result<GpuLlama, CudaError> {
        let hd = config.head_dim;
        if hd % 32 != 0 || hd > 256 {
            return Err(CudaError::Unsupported(format!("head_dim {hd} (the attention kernel needs a multiple of 32, at most 256)")));
        }
        // The same f32 computation as `Llama::new`, so both rotate by the same angles.
        let inv_freq: Vec<f32> = (0..hd / 2).map(|i| config.rope_theta.powf(-2.0 * i as f32 / hd as f32)).collect();
        Ok(GpuLlama { inv_freq: gpu.upload(&inv_freq)?, config, weights, scratch: Scratch::default() })
    }

    /// Runs the batch and returns the requested logits rows (`vocab_size` floats each).
    pub fn forward(&mut self, gpu: &Gpu, pool: &mut GpuKvPool, seqs: &[SeqForward]) -> Result<Vec<f32>, CudaError> {
        let n_out = self.forward_on_device(gpu, pool, seqs)?;
        let bufs = self.scratch.bufs.as_ref().expect("allocated by the forward pass");
        gpu.download(&bufs.logits, n_out * self.config.vocab_size)
    }

    /// Runs the batch and returns the greedy token of each requested logits row, computed
    /// on the device so that a decode step copies 4 bytes per sequence back, not the logits.
    pub fn forward_argmax(&mut self, gpu: &Gpu, pool: &mut GpuKvPool, seqs: &[SeqForward]) -> Result<Vec<u32>, CudaError> {
        let n_out = self.forward_on_device(gpu, pool, seqs)?;
        let bufs = self.scratch.bufs.as_ref().expect("allocated by the forward pass");
        if n_out == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: argmax_rows(const float*, int, int*) reads n_out rows of logits, writes n_out ints.
        unsafe { gpu.launch("argmax_rows", n_out as u32, 1024, 0, kargs![gpu.ptr(&bufs.logits), self.config.vocab_size as i32, gpu.ptr(&bufs.argmax)])? };
        Ok(gpu.download(&bufs.argmax, n_out)?.into_iter().map(|t| t as u32).collect())
    }

    /// Plans the call's metadata on the host: token ids, positions, physical slots, the
    /// rows that get logits, and the attention plan.
    fn meta(&self, gpu: &Gpu, pool: &GpuKvPool, seqs: &[SeqForward]) -> Result<(Meta, AttnPlan), CudaError> {
        let c = &self.config;
        let bs = pool.geometry.block_size_tokens;
        let ap = plan(seqs, c.n_heads, c.n_kv_heads, bs, 2 * gpu.sm_count)?;
        let (mut tokens, mut positions, mut slots, mut out_rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for s in seqs {
            for (i, &t) in s.tokens.iter().enumerate() {
                if t as usize >= c.vocab_size {
                    return Err(CudaError::Unsupported(format!("token id {t} outside the vocabulary of {}", c.vocab_size)));
                }
                let idx = s.stored_start + i;
                let block = s.block_table[idx / bs] as usize;
                if block >= pool.geometry.num_blocks {
                    return Err(CudaError::Unsupported(format!("block id {block} outside the pool of {}", pool.geometry.num_blocks)));
                }
                if i >= s.logits_from {
                    out_rows.push(tokens.len() as i32);
                }
                tokens.push(t as i32);
                positions.push((s.start_position + i) as i32);
                slots.push((block * bs + idx % bs) as i32);
            }
        }
        let mut ints = Vec::new();
        let mut section = |v: &[i32]| {
            let at = ints.len();
            ints.extend_from_slice(v);
            at
        };
        let tokens_at = section(&tokens);
        let positions_at = section(&positions);
        let slots_at = section(&slots);
        let out_rows_at = section(&out_rows);
        let seqs_at = section(&ap.seqs);
        let items_at = section(&ap.items);
        let row_splits_at = section(&ap.row_splits);
        let tables_at = section(&ap.tables);
        let m = Meta { ints, n_out: out_rows.len(), tokens: tokens_at, positions: positions_at, slots: slots_at, out_rows: out_rows_at, seqs: seqs_at, items: items_at, row_splits: row_splits_at, tables: tables_at };
        Ok((m, ap))
    }

    /// Grows the scratch buffers to hold `n` rows, `n_out` logits rows and the plan.
    fn ensure_scratch(&mut self, gpu: &Gpu, n: usize, n_out: usize, partial_floats: usize, meta_ints: usize) -> Result<(), CudaError> {
        let c = &self.config;
        let s = &mut self.scratch;
        if s.bufs.is_some() && n <= s.rows && n_out <= s.logit_rows && partial_floats <= s.partial_floats && meta_ints <= s.meta_ints {
            return Ok(());
        }
        s.rows = s.rows.max(n);
        s.logit_rows = s.logit_rows.max(n_out);
        s.partial_floats = s.partial_floats.max(partial_floats);
        s.meta_ints = s.meta_ints.max(meta_ints);
        let r = s.rows;
        s.bufs = None; // free the old buffers before taking new ones
        s.bufs = Some(Bufs {
            x: gpu.alloc(r * c.d_model)?,
            h: gpu.alloc(r * c.d_model)?,
            qkv: gpu.alloc(r * (c.q_dim() + 2 * c.kv_dim()))?,
            attn: gpu.alloc(r * c.q_dim())?,
            gate_up: gpu.alloc(r * 2 * c.d_ff)?,
            act_ff: gpu.alloc(r * c.d_ff)?,
            partial: gpu.alloc(s.partial_floats)?,
            meta: gpu.alloc(s.meta_ints)?,
            logits: gpu.alloc(s.logit_rows * c.vocab_size)?,
            argmax: gpu.alloc(s.logit_rows)?,
        });
        Ok(())
    }

    /// Runs every layer; leaves the requested rows' logits in the scratch buffer and
    /// returns how many there are.
    fn forward_on_device(&mut self, gpu: &Gpu, pool: &mut GpuKvPool, seqs: &[SeqForward]) -> Result<usize, CudaError> {
        let g = pool.geometry;
        {
            let c = &self.config;
            if g.n_layers != c.n_layers || g.n_kv_heads != c.n_kv_heads || g.head_dim != c.head_dim {
                return Err(CudaError::Unsupported(format!("pool geometry {g:?} does not match the model")));
            }
        }
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if n == 0 {
            return Ok(0);
        }
        let (meta, ap) = self.meta(gpu, pool, seqs)?;
        let n_out = meta.n_out;
        let c = self.config.clone();
        let partial_floats = ap.max_splits * n * c.n_heads * (c.head_dim + 2);
        self.ensure_scratch(gpu, n, n_out, partial_floats, meta.ints.len())?;
        let b = self.scratch.bufs.as_mut().expect("just allocated");
        gpu.upload_into(&meta.ints, &mut b.meta)?;

        let (d, qd, kvd, ff) = (c.d_model, c.q_dim(), c.kv_dim(), c.d_ff);
        let qkv_stride = (qd + 2 * kvd) as i32;
        let ip = |at: usize| -> DevPtr { gpu.ptr(&b.meta) + 4 * at as u64 };
        let (x, h, qkv, attn, gate_up, act_ff, partial) = (gpu.ptr(&b.x), gpu.ptr(&b.h), gpu.ptr(&b.qkv), gpu.ptr(&b.attn), gpu.ptr(&b.gate_up), gpu.ptr(&b.act_ff), gpu.ptr(&b.partial));
        let (k_new, v_new) = (qkv + 4 * qd as u64, qkv + 4 * (qd + kvd) as u64);
        let neox = (c.rope_style == RopeStyle::Neox) as i32;
        let null: DevPtr = 0;
        let attn_smem = (2 * g.block_size_tokens * c.head_dim * 4) as u32;
        if attn_smem > 48 * 1024 {
            return Err(CudaError::Unsupported(format!("block size {} × head_dim {} needs {attn_smem} bytes of shared memory (at most 48 KiB)", g.block_size_tokens, c.head_dim)));
        }
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let w = &self.weights;
        let n_i = n as i32;

        // SAFETY (every launch below): argument lists follow the kernels' signatures in
        // kernels/*.cu; buffers were sized for n rows above; slots and block ids were checked
        // against the pool in `meta`, and the plan checked every block table's length.
        unsafe {
            gpu.launch("embed", n as u32, 256, 0, kargs![gpu.ptr(&w.token_embd), ip(meta.tokens), x, d as i32])?;
            for (li, lw) in w.layers.iter().enumerate() {
                let (k_pool, v_pool) = pool.layer_ptrs(gpu, li);
                gpu.launch("rmsnorm", n as u32, 256, 0, kargs![x, gpu.ptr(&lw.attn_norm), h, null, d as i32, c.rms_eps])?;
                gpu.gemm(gpu.ptr(&lw.wqkv), qd + 2 * kvd, d, h, n, qkv, 0.0)?;
                gpu.launch("rope", n as u32, 128, 0, kargs![qkv, qkv_stride, ip(meta.positions), gpu.ptr(&self.inv_freq), c.n_heads as i32, c.head_dim as i32, neox])?;
                gpu.launch("rope", n as u32, 128, 0, kargs![k_new, qkv_stride, ip(meta.positions), gpu.ptr(&self.inv_freq), c.n_kv_heads as i32, c.head_dim as i32, neox])?;
                gpu.launch("kv_write", n as u32, 256, 0, kargs![k_new, v_new, qkv_stride, k_pool, v_pool, ip(meta.slots), c.n_kv_heads as i32, c.head_dim as i32, g.block_size_tokens as i32])?;
                gpu.launch(
                    "paged_attention",
                    ap.n_items() as u32,
                    ap.threads_per_block,
                    attn_smem,
                    kargs![qkv, qkv_stride, k_pool, v_pool, ip(meta.tables), ip(meta.seqs), ip(meta.items), partial, c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32, g.block_size_tokens as i32, ap.tile_tokens as i32, n_i, scale],
                )?;
                gpu.launch("attn_combine", (n * c.n_heads) as u32, c.head_dim as u32, 0, kargs![partial, ip(meta.row_splits), attn, c.n_heads as i32, c.head_dim as i32, n_i])?;
                gpu.gemm(gpu.ptr(&lw.wo), d, qd, attn, n, x, 1.0)?;
                gpu.launch("rmsnorm", n as u32, 256, 0, kargs![x, gpu.ptr(&lw.ffn_norm), h, null, d as i32, c.rms_eps])?;
                gpu.gemm(gpu.ptr(&lw.w_gate_up), 2 * ff, d, h, n, gate_up, 0.0)?;
                gpu.launch("swiglu", gpu.grid_for(n * ff), 256, 0, kargs![gate_up, act_ff, n_i, ff as i32])?;
                gpu.gemm(gpu.ptr(&lw.w_down), d, ff, act_ff, n, x, 1.0)?;
            }
            if n_out > 0 {
                gpu.launch("rmsnorm", n_out as u32, 256, 0, kargs![x, gpu.ptr(&w.output_norm), h, ip(meta.out_rows), d as i32, c.rms_eps])?;
                gpu.gemm(gpu.ptr(w.output_head()), c.vocab_size, d, h, n_out, gpu.ptr(&b.logits), 0.0)?;
            }
        }
        Ok(n_out)
    }
}
