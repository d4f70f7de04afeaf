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
use crate::weights::{GpuLayer, GpuWeights};
use crate::{kargs, CudaError};

pub struct GpuLlama {
    pub config: ModelConfig,
    pub weights: GpuWeights,
    inv_freq: CudaSlice<f32>,
    scratch: Scratch,
    /// Replay decode steps from CUDA graphs: one launch per step instead of about ten per
    /// layer. On by default (`PK_CUDA_GRAPHS=0` turns it off): on an H200, batch-1 decode of
    /// Llama-3.1-8B shapes reached 63 % of the copy bandwidth with graphs against 59 %
    /// eager (BENCHMARKS.md, 2026-12-04). A capture that fails turns it off with a warning
    /// and the step runs eagerly.
    use_graphs: bool,
    /// Captured graphs by (shape, pool address, scratch generation).
    graphs: std::collections::HashMap<(Shape, DevPtr, u64), cudarc::driver::CudaGraph>,
}

/// Activation buffers, grown (never shrunk) to the largest call so far.
#[derive(Default)]
struct Scratch {
    /// Bumped on every reallocation: graphs captured on older buffers are stale.
    generation: u64,
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

/// What fixes a call's sequence of launches (grid sizes, scalar arguments, metadata
/// offsets): two calls of the same shape on the same buffers launch identical work, which
/// is what lets a decode step be replayed from a CUDA graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    n: usize,
    n_out: usize,
    n_seqs: usize,
    n_items: usize,
    max_splits: usize,
    argmax: bool,
}

/// Offsets (in i32s) of each section of the per-call metadata, uploaded as one buffer; a
/// function of the shape alone. The block tables come last, so their lengths (which grow
/// with the context) move no other section.
struct Offsets {
    tokens: usize,
    positions: usize,
    slots: usize,
    out_rows: usize,
    seqs: usize,
    items: usize,
    row_splits: usize,
    tables: usize,
}

impl Shape {
    fn offsets(&self) -> Offsets {
        let n = self.n;
        let out_rows = 3 * n;
        let seqs = out_rows + self.n_out;
        let items = seqs + 6 * self.n_seqs;
        let row_splits = items + 4 * self.n_items;
        Offsets {
            tokens: 0,
            positions: n,
            slots: 2 * n,
            out_rows,
            seqs,
            items,
            row_splits,
            tables: row_splits + n,
        }
    }
}

/// Where a forward call copies queries to: a device buffer of `[layer][i][q_dim]` f32 and
/// the batch rows `i` stands for.
type Capture<'a> = (DevPtr, &'a [usize]);

/// The batch rows whose queries a call captures (each sequence's last `capture_last[i]`
/// rows, clamped to its tokens; a missing entry means none), in order, and how many each
/// sequence gets.
fn capture_rows(seqs: &[SeqForward], capture_last: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let (mut rows, mut counts, mut row0) = (Vec::new(), Vec::with_capacity(seqs.len()), 0);
    for (i, s) in seqs.iter().enumerate() {
        let n = s.tokens.len();
        let want = capture_last.get(i).copied().unwrap_or(0).min(n);
        rows.extend(row0 + n - want..row0 + n);
        counts.push(want);
        row0 += n;
    }
    (rows, counts)
}

/// The capture buffer (`[layer][captured row][q_dim]`) as each sequence's
/// `[layer][its rows][q_dim]`, the CPU's layout.
fn split_captured(all: &[f32], counts: &[usize], n_layers: usize, qd: usize) -> Vec<Vec<f32>> {
    let total: usize = counts.iter().sum();
    let mut out = Vec::with_capacity(counts.len());
    let mut first = 0;
    for &want in counts {
        let mut q = Vec::with_capacity(n_layers * want * qd);
        for layer in 0..n_layers {
            let at = (layer * total + first) * qd;
            q.extend_from_slice(&all[at..at + want * qd]);
        }
        out.push(q);
        first += want;
    }
    out
}

/// Decode steps of at most this many rows are replayed from CUDA graphs when enabled.
const GRAPH_MAX_ROWS: usize = 256;
/// Graphs kept at most (one per decode shape seen); the cache is cleared when full.
const GRAPH_CACHE_MAX: usize = 64;

impl GpuLlama {
    pub fn new(gpu: &Gpu, config: ModelConfig, weights: GpuWeights) -> Result<GpuLlama, CudaError> {
        let hd = config.head_dim;
        if config.extras != pk_model::ArchExtras::default() {
            return Err(CudaError::Unsupported(format!("the {} architecture (Gemma 3's norms, GeGLU and sliding windows and Qwen2's Q/K/V biases run on the CPU only)", config.arch)));
        }
        if !hd.is_multiple_of(32) || hd > 256 {
            return Err(CudaError::Unsupported(format!(
                "head_dim {hd} (the attention kernel needs a multiple of 32, at most 256)"
            )));
        }
        // The same frequencies as `Llama::new` (base, Llama 3.1's frequency factors, linear
        // scaling), so both rotate by the same angles.
        let inv_freq = config.rope_inv_freq(false);
        let use_graphs = std::env::var("PK_CUDA_GRAPHS").as_deref() != Ok("0");
        Ok(GpuLlama {
            inv_freq: gpu.upload(&inv_freq)?,
            config,
            weights,
            scratch: Scratch::default(),
            use_graphs,
            graphs: Default::default(),
        })
    }

    /// Runs the batch and returns the requested logits rows (`vocab_size` floats each).
    pub fn forward(
        &mut self,
        gpu: &Gpu,
        pool: &mut GpuKvPool,
        seqs: &[SeqForward],
    ) -> Result<Vec<f32>, CudaError> {
        let n_out = self.forward_on_device(gpu, pool, seqs, false, None)?;
        if n_out == 0 {
            // Also a batch without tokens, which allocates no scratch buffers.
            return Ok(Vec::new());
        }
        let bufs = self
            .scratch
            .bufs
            .as_ref()
            .expect("allocated by the forward pass");
        gpu.download(&bufs.logits, n_out * self.config.vocab_size)
    }

    /// Runs the batch and returns the greedy token of each requested logits row, computed
    /// on the device so that a decode step copies 4 bytes per sequence back, not the logits.
    pub fn forward_argmax(
        &mut self,
        gpu: &Gpu,
        pool: &mut GpuKvPool,
        seqs: &[SeqForward],
    ) -> Result<Vec<u32>, CudaError> {
        let n_out = self.forward_on_device(gpu, pool, seqs, true, None)?;
        if n_out == 0 {
            return Ok(Vec::new());
        }
        let bufs = self
            .scratch
            .bufs
            .as_ref()
            .expect("allocated by the forward pass");
        Ok(gpu
            .download(&bufs.argmax, n_out)?
            .into_iter()
            .map(|t| t as u32)
            .collect())
    }

    /// Like `forward`, and also returns, per sequence, the post-RoPE queries of its last
    /// `capture_last[i]` new tokens (`[layer][token][n_heads * head_dim]`, f32), with
    /// `pk_model::Llama::forward_with_queries`'s contract: attention-based eviction policies
    /// score with them. Each layer copies the wanted rows of Q (rotated in place by
    /// `rope_kv_write`) into one capture buffer, downloaded once at the end; such a call runs
    /// eagerly, never from a graph (it happens once per prompt, and per decode step only
    /// for policies that ask for decode queries).
    pub fn forward_with_queries(
        &mut self,
        gpu: &Gpu,
        pool: &mut GpuKvPool,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), CudaError> {
        let qd = self.config.q_dim();
        let (rows, counts) = capture_rows(seqs, capture_last);
        if rows.is_empty() {
            return Ok((self.forward(gpu, pool, seqs)?, vec![Vec::new(); seqs.len()]));
        }
        let n_layers = self.config.n_layers;
        let captured = gpu.alloc::<f32>(n_layers * rows.len() * qd)?;
        let n_out =
            self.forward_on_device(gpu, pool, seqs, false, Some((gpu.ptr(&captured), &rows)))?;
        let bufs = self
            .scratch
            .bufs
            .as_ref()
            .expect("allocated by the forward pass");
        let logits = gpu.download(&bufs.logits, n_out * self.config.vocab_size)?;
        let all = gpu.download(&captured, n_layers * rows.len() * qd)?;
        Ok((logits, split_captured(&all, &counts, n_layers, qd)))
    }

    /// Whether decode steps are replayed from CUDA graphs.
    pub fn graphs_enabled(&self) -> bool {
        self.use_graphs
    }

    /// Turns graph replay of decode steps on or off (the default comes from `PK_CUDA_GRAPHS`).
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
        self.graphs.clear();
    }

    /// Plans the call on the host: token ids, positions, physical slots, the rows that get
    /// logits and the attention plan, laid out as `Shape::offsets` says.
    fn meta(
        &self,
        gpu: &Gpu,
        pool: &GpuKvPool,
        seqs: &[SeqForward],
        argmax: bool,
    ) -> Result<(Shape, Vec<i32>), CudaError> {
        let c = &self.config;
        let bs = pool.geometry.block_size_tokens;
        let ap: AttnPlan = plan(seqs, c.n_heads, c.n_kv_heads, bs, 2 * gpu.sm_count)?;
        let (mut tokens, mut positions, mut slots, mut out_rows) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for s in seqs {
            for (i, &t) in s.tokens.iter().enumerate() {
                if t as usize >= c.vocab_size {
                    return Err(CudaError::Unsupported(format!(
                        "token id {t} outside the vocabulary of {}",
                        c.vocab_size
                    )));
                }
                let idx = s.stored_start + i;
                let block = s.block_table[idx / bs] as usize;
                if block >= pool.geometry.num_blocks {
                    return Err(CudaError::Unsupported(format!(
                        "block id {block} outside the pool of {}",
                        pool.geometry.num_blocks
                    )));
                }
                if i >= s.logits_from {
                    out_rows.push(tokens.len() as i32);
                }
                tokens.push(t as i32);
                positions.push((s.start_position + i) as i32);
                slots.push((block * bs + idx % bs) as i32);
            }
        }
        let shape = Shape {
            n: tokens.len(),
            n_out: out_rows.len(),
            n_seqs: seqs.len(),
            n_items: ap.n_items(),
            max_splits: ap.max_splits,
            argmax,
        };
        let mut ints = Vec::with_capacity(shape.offsets().tables + ap.tables.len());
        for section in [
            &tokens,
            &positions,
            &slots,
            &out_rows,
            &ap.seqs,
            &ap.items,
            &ap.row_splits,
            &ap.tables,
        ] {
            ints.extend_from_slice(section);
        }
        debug_assert_eq!(ints.len(), shape.offsets().tables + ap.tables.len());
        debug_assert_eq!(
            ap.threads_per_block as usize,
            32 * self.tile_tokens() * c.group_size()
        );
        Ok((shape, ints))
    }

    /// Query tokens per attention thread block (as `attention::plan` chooses).
    fn tile_tokens(&self) -> usize {
        (16 / self.config.group_size()).max(1)
    }

    /// Grows the scratch buffers to hold `n` rows, `n_out` logits rows and the plan.
    fn ensure_scratch(
        &mut self,
        gpu: &Gpu,
        n: usize,
        n_out: usize,
        partial_floats: usize,
        meta_ints: usize,
    ) -> Result<(), CudaError> {
        let c = &self.config;
        let s = &mut self.scratch;
        if s.bufs.is_some()
            && n <= s.rows
            && n_out <= s.logit_rows
            && partial_floats <= s.partial_floats
            && meta_ints <= s.meta_ints
        {
            return Ok(());
        }
        s.rows = s.rows.max(n);
        s.logit_rows = s.logit_rows.max(n_out);
        s.partial_floats = s.partial_floats.max(partial_floats);
        s.meta_ints = s.meta_ints.max(meta_ints);
        let r = s.rows;
        s.generation += 1;
        self.graphs.clear();
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

    /// Runs every layer; leaves the requested rows' logits (and their argmax when asked) in
    /// the scratch buffers and returns how many rows there are. With `capture`, each
    /// layer's post-RoPE Q of the given rows goes to `[layer][i][q_dim]` of the buffer.
    fn forward_on_device(
        &mut self,
        gpu: &Gpu,
        pool: &mut GpuKvPool,
        seqs: &[SeqForward],
        argmax: bool,
        capture: Option<Capture>,
    ) -> Result<usize, CudaError> {
        let g = pool.geometry;
        let c = self.config.clone();
        if g.n_layers != c.n_layers || g.n_kv_heads != c.n_kv_heads || g.head_dim != c.head_dim {
            return Err(CudaError::Unsupported(format!(
                "pool geometry {g:?} does not match the model"
            )));
        }
        if 2 * g.block_size_tokens * c.head_dim * 4 > 48 * 1024 {
            return Err(CudaError::Unsupported(format!(
                "block size {} × head_dim {} needs more than 48 KiB of shared memory",
                g.block_size_tokens, c.head_dim
            )));
        }
        if seqs.iter().any(|s| !s.head_first_keys.is_empty()) {
            return Err(CudaError::Unsupported(
                "per-head first keys (a ragged eviction such as kvzip:global) run on the CPU only"
                    .into(),
            ));
        }
        if seqs.iter().all(|s| s.tokens.is_empty()) {
            return Ok(0);
        }
        let (shape, ints) = self.meta(gpu, pool, seqs, argmax)?;
        let partial_floats = shape.max_splits * shape.n * c.n_heads * (c.head_dim + 2);
        self.ensure_scratch(gpu, shape.n, shape.n_out, partial_floats, ints.len())?;
        let b = self.scratch.bufs.as_mut().expect("just allocated");
        // Ordered on the stream after the previous call's kernels, which read this buffer.
        gpu.upload_into(&ints, &mut b.meta)?;

        if !(self.use_graphs && shape.n <= GRAPH_MAX_ROWS) || capture.is_some() {
            self.launch_all(gpu, pool, shape, capture)?;
            return Ok(shape.n_out);
        }
        let key = (shape, pool.layer_ptrs(gpu, 0).0, self.scratch.generation);
        if !self.graphs.contains_key(&key) {
            if self.graphs.len() >= GRAPH_CACHE_MAX {
                self.graphs.clear();
            }
            gpu.stream.begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )?;
            let launched = self.launch_all(gpu, pool, shape, None);
            let captured = gpu
                .stream
                .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            match (launched, captured) {
                (Ok(()), Ok(Some(graph))) => {
                    self.graphs.insert(key, graph);
                }
                (launched, captured) => {
                    eprintln!("warning: CUDA graph capture failed ({:?}, {:?}); running steps eagerly from now on", launched.err(), captured.err());
                    self.use_graphs = false;
                    self.launch_all(gpu, pool, shape, None)?;
                    return Ok(shape.n_out);
                }
            }
        }
        self.graphs[&key].launch()?;
        Ok(shape.n_out)
    }

    /// Enqueues every kernel of a call whose metadata is in the scratch buffer.
    fn launch_all(
        &self,
        gpu: &Gpu,
        pool: &GpuKvPool,
        shape: Shape,
        capture: Option<Capture>,
    ) -> Result<(), CudaError> {
        let b = self
            .scratch
            .bufs
            .as_ref()
            .expect("allocated before launching");
        let l = Launcher {
            model: self,
            gpu,
            pool,
            shape,
            o: shape.offsets(),
            meta: gpu.ptr(&b.meta),
            x: gpu.ptr(&b.x),
            h: gpu.ptr(&b.h),
            qkv: gpu.ptr(&b.qkv),
            attn: gpu.ptr(&b.attn),
            gate_up: gpu.ptr(&b.gate_up),
            act_ff: gpu.ptr(&b.act_ff),
            partial: gpu.ptr(&b.partial),
            logits: gpu.ptr(&b.logits),
            argmax: gpu.ptr(&b.argmax),
        };
        let (w, d) = (&self.weights, self.config.d_model);
        // SAFETY: for every launch here and in `Launcher`'s methods, argument lists follow
        // the kernels' signatures in kernels/*.cu; buffers were sized for the shape by
        // `ensure_scratch`; slots and block ids were checked against the pool in `meta`, and
        // the plan checked every block table's length; a capture buffer holds
        // `n_layers × rows × q_dim` floats for rows below `n` (`forward_with_queries`).
        unsafe {
            let args = kargs![gpu.ptr(&w.token_embd), l.ip(l.o.tokens), l.x, d as i32];
            gpu.launch("embed", shape.n as u32, 256, 0, args)?;
            for (li, lw) in w.layers.iter().enumerate() {
                l.attention(li, lw, capture)?;
                l.mlp(lw)?;
            }
            if shape.n_out > 0 {
                l.head()?;
            }
        }
        Ok(())
    }
}

/// One call's launches: the model, the pool, the shape and the scratch buffers' pointers.
struct Launcher<'a> {
    model: &'a GpuLlama,
    gpu: &'a Gpu,
    pool: &'a GpuKvPool,
    shape: Shape,
    o: Offsets,
    meta: DevPtr,
    x: DevPtr,
    h: DevPtr,
    qkv: DevPtr,
    attn: DevPtr,
    gate_up: DevPtr,
    act_ff: DevPtr,
    partial: DevPtr,
    logits: DevPtr,
    argmax: DevPtr,
}

impl Launcher<'_> {
    /// The device address of metadata entry `at` (in i32s).
    fn ip(&self, at: usize) -> DevPtr {
        self.meta + 4 * at as u64
    }

    /// Layer `li`'s attention half: RMSNorm, the QKV GEMM, RoPE with the K/V write into
    /// the pool, the capture of Q, paged attention and its combine, the output GEMM added
    /// into the residual.
    ///
    /// # Safety
    /// As in `GpuLlama::launch_all`.
    unsafe fn attention(
        &self,
        li: usize,
        lw: &GpuLayer,
        capture: Option<Capture>,
    ) -> Result<(), CudaError> {
        let (c, gpu, o, n) = (&self.model.config, self.gpu, &self.o, self.shape.n);
        let g = self.pool.geometry;
        let (d, qd, kvd) = (c.d_model, c.q_dim(), c.kv_dim());
        let qkv_stride = (qd + 2 * kvd) as i32;
        let (k_pool, v_pool) = self.pool.layer_ptrs(gpu, li);
        let null: DevPtr = 0;
        let (x, h, qkv) = (self.x, self.h, self.qkv);
        let norm_args = kargs![x, gpu.ptr(&lw.attn_norm), h, null, d as i32, c.rms_eps];
        gpu.launch("rmsnorm", n as u32, 256, 0, norm_args)?;
        gpu.gemm(gpu.ptr(&lw.wqkv), qd + 2 * kvd, d, h, n, qkv, 0.0)?;
        let neox = (c.rope_style == RopeStyle::Neox) as i32;
        let rope_args = kargs![
            qkv,
            qkv_stride,
            self.ip(o.positions),
            gpu.ptr(&self.model.inv_freq),
            c.n_heads as i32,
            c.n_kv_heads as i32,
            c.head_dim as i32,
            neox,
            k_pool,
            v_pool,
            self.ip(o.slots),
            g.block_size_tokens as i32
        ];
        gpu.launch("rope_kv_write", n as u32, 256, 0, rope_args)?;
        if let Some((buf, rows)) = capture {
            // Q is each row's first q_dim floats, rotated in place just above.
            for (i, &r) in rows.iter().enumerate() {
                let dst = buf + (4 * (li * rows.len() + i) * qd) as u64;
                gpu.copy_raw(dst, qkv + 4 * (r * qkv_stride as usize) as u64, 4 * qd)?;
            }
        }
        self.paged_attention(k_pool, v_pool)?;
        gpu.gemm(gpu.ptr(&lw.wo), d, qd, self.attn, n, x, 1.0)
    }

    /// Paged attention into per-split partials, then their combine into `attn`.
    ///
    /// # Safety
    /// As in `GpuLlama::launch_all`.
    unsafe fn paged_attention(&self, k_pool: DevPtr, v_pool: DevPtr) -> Result<(), CudaError> {
        let (m, gpu, o, n) = (self.model, self.gpu, &self.o, self.shape.n);
        let c = &m.config;
        let g = self.pool.geometry;
        let attn_smem = (2 * g.block_size_tokens * c.head_dim * 4) as u32;
        let threads = (32 * m.tile_tokens() * c.group_size()) as u32;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let n_i = n as i32;
        let attn_args = kargs![
            self.qkv,
            (c.q_dim() + 2 * c.kv_dim()) as i32,
            k_pool,
            v_pool,
            self.ip(o.tables),
            self.ip(o.seqs),
            self.ip(o.items),
            self.partial,
            c.n_heads as i32,
            c.n_kv_heads as i32,
            c.head_dim as i32,
            g.block_size_tokens as i32,
            m.tile_tokens() as i32,
            n_i,
            scale
        ];
        let items = self.shape.n_items as u32;
        gpu.launch("paged_attention", items, threads, attn_smem, attn_args)?;
        let combine_args = kargs![
            self.partial,
            self.ip(o.row_splits),
            self.attn,
            c.n_heads as i32,
            c.head_dim as i32,
            n_i
        ];
        let rows = (n * c.n_heads) as u32;
        gpu.launch("attn_combine", rows, c.head_dim as u32, 0, combine_args)
    }

    /// Layer's MLP half: RMSNorm, the gate/up GEMM, SwiGLU, the down GEMM added into the
    /// residual.
    ///
    /// # Safety
    /// As in `GpuLlama::launch_all`.
    unsafe fn mlp(&self, lw: &GpuLayer) -> Result<(), CudaError> {
        let (c, gpu, n) = (&self.model.config, self.gpu, self.shape.n);
        let (d, ff) = (c.d_model, c.d_ff);
        let null: DevPtr = 0;
        let (x, h) = (self.x, self.h);
        let norm_args = kargs![x, gpu.ptr(&lw.ffn_norm), h, null, d as i32, c.rms_eps];
        gpu.launch("rmsnorm", n as u32, 256, 0, norm_args)?;
        gpu.gemm(gpu.ptr(&lw.w_gate_up), 2 * ff, d, h, n, self.gate_up, 0.0)?;
        let swiglu_args = kargs![self.gate_up, self.act_ff, n as i32, ff as i32];
        gpu.launch("swiglu", gpu.grid_for(n * ff), 256, 0, swiglu_args)?;
        gpu.gemm(gpu.ptr(&lw.w_down), d, ff, self.act_ff, n, x, 1.0)
    }

    /// The output rows' final norm, the output head, and each row's argmax when asked.
    ///
    /// # Safety
    /// As in `GpuLlama::launch_all`.
    unsafe fn head(&self) -> Result<(), CudaError> {
        let (c, gpu, n_out) = (&self.model.config, self.gpu, self.shape.n_out);
        let w = &self.model.weights;
        let d = c.d_model;
        let norm_args = kargs![
            self.x,
            gpu.ptr(&w.output_norm),
            self.h,
            self.ip(self.o.out_rows),
            d as i32,
            c.rms_eps
        ];
        gpu.launch("rmsnorm", n_out as u32, 256, 0, norm_args)?;
        let head = gpu.ptr(w.output_head());
        gpu.gemm(head, c.vocab_size, d, self.h, n_out, self.logits, 0.0)?;
        if self.shape.argmax {
            let args = kargs![self.logits, c.vocab_size as i32, self.argmax];
            gpu.launch("argmax_rows", n_out as u32, 1024, 0, args)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row selection and layout of captured queries, as `Llama::forward_with_queries` lays
    /// them out: per sequence its last rows, clamped, `[layer][token][q_dim]`.
    #[test]
    fn captured_queries_are_split_per_sequence_like_the_cpu() {
        let (a, b, c) = ([1u32; 5], [2u32; 1], [3u32; 3]);
        let seqs = [&a[..], &b[..], &c[..]].map(|tokens| SeqForward {
            tokens,
            start_position: 0,
            stored_start: 0,
            block_table: &[],
            logits_from: 0,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        });
        // Sequence 1 asks for more than it has; sequence 2 has no entry.
        let (rows, counts) = capture_rows(&seqs, &[2, 4]);
        assert_eq!((rows, counts.clone()), (vec![3, 4, 5], vec![2, 1, 0]));
        // Two layers, q_dim 2: the buffer holds value 100·layer + 10·captured row + d.
        let (n_layers, qd) = (2, 2);
        let all: Vec<f32> = (0..n_layers)
            .flat_map(|l| {
                (0..3).flat_map(move |i| (0..qd).map(move |d| (100 * l + 10 * i + d) as f32))
            })
            .collect();
        let out = split_captured(&all, &counts, n_layers, qd);
        assert_eq!(
            out[0],
            vec![0.0, 1.0, 10.0, 11.0, 100.0, 101.0, 110.0, 111.0]
        );
        assert_eq!(out[1], vec![20.0, 21.0, 120.0, 121.0]);
        assert!(out[2].is_empty());
    }
}
