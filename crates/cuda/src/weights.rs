//! Model weights in device memory, as `act_t` (f16 or bf16) matrices ready for cuBLAS.
//!
//! GGUF tensors are uploaded in their own format and dequantised on the device once at
//! load time (`kernels/dequant.cu`), so a model needs its dequantised size in device memory
//! (SmolLM2-135M: 270 MB) and the host holds no dequantised copy. Q, K and V are stacked
//! into one `[q_dim + 2 kv_dim, d_model]` matrix and gate and up into one
//! `[2 d_ff, d_model]` matrix, so that each makes one GEMM (one weight stream in decode).
//! Random weights are generated on the device by a hash kernel: a model of Llama-3.1-8B's
//! shape (16 GB in bf16) never exists on the host.

use cudarc::driver::CudaSlice;
use pk_gguf::{GgmlType, GgufFile};
use pk_model::weights::Weights;
use pk_model::ModelConfig;

use crate::device::{DevPtr, Gpu};
use crate::{kargs, CudaError};

pub struct GpuLayer {
    pub attn_norm: CudaSlice<f32>,
    /// Rows: q (q_dim), then k (kv_dim), then v (kv_dim).
    pub wqkv: CudaSlice<u16>,
    pub wo: CudaSlice<u16>,
    pub ffn_norm: CudaSlice<f32>,
    /// Rows: gate (d_ff), then up (d_ff).
    pub w_gate_up: CudaSlice<u16>,
    pub w_down: CudaSlice<u16>,
}

pub struct GpuWeights {
    /// `vocab × d_model`.
    pub token_embd: CudaSlice<u16>,
    pub layers: Vec<GpuLayer>,
    pub output_norm: CudaSlice<f32>,
    /// `None`: tied to `token_embd`.
    pub output: Option<CudaSlice<u16>>,
}

/// Where a matrix's GGUF bytes come from: a file's tensor, or a CPU model's matrix.
trait MatrixSource {
    fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<(GgmlType, Vec<u8>), CudaError>;
}

impl GpuWeights {
    /// The weights of a GGUF file (tensor names as `pk_model::weights::Weights::from_gguf`).
    pub fn from_gguf(gpu: &Gpu, f: &GgufFile, cfg: &ModelConfig) -> Result<GpuWeights, CudaError> {
        // The same refusal as the CPU loader's: a tensor we would not read stops the load.
        pk_model::weights::check_tensor_names(f, cfg)
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        struct File<'a>(&'a GgufFile);
        impl MatrixSource for File<'_> {
            fn matrix(
                &self,
                name: &str,
                rows: usize,
                cols: usize,
            ) -> Result<(GgmlType, Vec<u8>), CudaError> {
                let info = self
                    .0
                    .tensor_info(name)
                    .map_err(|e| CudaError::Unsupported(e.to_string()))?;
                if info.row_len() != cols || info.n_rows() != rows {
                    return Err(CudaError::Unsupported(format!(
                        "tensor {name} has shape {:?}, expected [{cols}, {rows}]",
                        info.dims
                    )));
                }
                Ok((info.ggml_type, self.0.tensor_data(info).to_vec()))
            }
        }
        let vector = |name: &str| -> Result<Vec<f32>, CudaError> {
            let info = f
                .tensor_info(name)
                .map_err(|e| CudaError::Unsupported(e.to_string()))?;
            let mut out = vec![0f32; info.n_elems() as usize];
            pk_gguf::dequantize(info.ggml_type, f.tensor_data(info), &mut out);
            Ok(out)
        };
        let norms = (0..cfg.n_layers)
            .map(|i| {
                Ok((
                    vector(&format!("blk.{i}.attn_norm.weight"))?,
                    vector(&format!("blk.{i}.ffn_norm.weight"))?,
                ))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let tied = f.tensor_info("output.weight").is_err();
        build(
            gpu,
            cfg,
            &File(f),
            &norms,
            &vector("output_norm.weight")?,
            tied,
        )
    }

    /// The weights of a CPU model (any format `pk_model` holds), for comparing the two.
    pub fn from_cpu(gpu: &Gpu, w: &Weights, cfg: &ModelConfig) -> Result<GpuWeights, CudaError> {
        struct Cpu<'a>(&'a Weights);
        impl MatrixSource for Cpu<'_> {
            fn matrix(
                &self,
                name: &str,
                _rows: usize,
                _cols: usize,
            ) -> Result<(GgmlType, Vec<u8>), CudaError> {
                let w = self.0;
                let m = match name.split_once('.') {
                    Some(("token_embd", _)) => &w.token_embd,
                    Some(("output", _)) => w.output.as_ref().expect("asked only when untied"),
                    _ => {
                        let mut parts = name.split('.');
                        let i: usize = parts
                            .nth(1)
                            .and_then(|s| s.parse().ok())
                            .expect("blk.N.name.weight");
                        let l = &w.layers[i];
                        match parts.next() {
                            Some("attn_q") => &l.wq,
                            Some("attn_k") => &l.wk,
                            Some("attn_v") => &l.wv,
                            Some("attn_output") => &l.wo,
                            Some("ffn_gate") => &l.w_gate,
                            Some("ffn_up") => &l.w_up,
                            Some("ffn_down") => &l.w_down,
                            other => panic!("no matrix {other:?}"),
                        }
                    }
                };
                let rb = m.row_bytes();
                let mut bytes = vec![0u8; m.rows * rb];
                for (r, row) in bytes.chunks_exact_mut(rb).enumerate() {
                    m.row_gguf(r, row);
                }
                Ok((m.ty, bytes))
            }
        }
        let norms: Vec<_> = w
            .layers
            .iter()
            .map(|l| (l.attn_norm.clone(), l.ffn_norm.clone()))
            .collect();
        build(
            gpu,
            cfg,
            &Cpu(w),
            &norms,
            &w.output_norm,
            w.output.is_none(),
        )
    }

    /// Uniform random weights in [-0.05, 0.05) (as `Weights::random` for F16/BF16) made on
    /// the device from `seed`, norms of ones, output head tied to the embedding.
    pub fn random(gpu: &Gpu, cfg: &ModelConfig, seed: u64) -> Result<GpuWeights, CudaError> {
        let mut next_seed = seed.wrapping_mul(1_000_003);
        let mut matrix = |rows: usize, cols: usize| -> Result<CudaSlice<u16>, CudaError> {
            let n = rows * cols;
            let buf = gpu.alloc::<u16>(n)?;
            next_seed = next_seed.wrapping_add(1);
            // SAFETY: random_fill(act_t*, long long, u64, float) writes n elements of buf.
            unsafe {
                gpu.launch(
                    "random_fill",
                    gpu.grid_for(n),
                    256,
                    0,
                    kargs![gpu.ptr(&buf), n as i64, next_seed, 0.05f32],
                )?
            };
            Ok(buf)
        };
        let (d, qkv, ff) = (cfg.d_model, cfg.q_dim() + 2 * cfg.kv_dim(), cfg.d_ff);
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            layers.push(GpuLayer {
                attn_norm: gpu.upload(&vec![1f32; d])?,
                wqkv: matrix(qkv, d)?,
                wo: matrix(d, cfg.q_dim())?,
                ffn_norm: gpu.upload(&vec![1f32; d])?,
                w_gate_up: matrix(2 * ff, d)?,
                w_down: matrix(d, ff)?,
            });
        }
        let token_embd = matrix(cfg.vocab_size, d)?;
        gpu.synchronize()?;
        Ok(GpuWeights {
            token_embd,
            layers,
            output_norm: gpu.upload(&vec![1f32; d])?,
            output: None,
        })
    }

    pub fn output_head(&self) -> &CudaSlice<u16> {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Weight bytes one decode step reads: every layer matrix and the output head (not the
    /// embedding, of which a step reads one row per token).
    pub fn bytes_per_token(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| 2 * (l.wqkv.len() + l.wo.len() + l.w_gate_up.len() + l.w_down.len()))
            .sum();
        per_layer + 2 * self.output_head().len()
    }
}

/// Uploads every matrix of `src` (dequantised on the device) and the norms.
fn build(
    gpu: &Gpu,
    cfg: &ModelConfig,
    src: &dyn MatrixSource,
    norms: &[(Vec<f32>, Vec<f32>)],
    output_norm: &[f32],
    tied: bool,
) -> Result<GpuWeights, CudaError> {
    let (d, qd, kvd, ff) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.d_ff);
    let mut layers = Vec::with_capacity(cfg.n_layers);
    for (i, (attn_norm, ffn_norm)) in norms.iter().enumerate() {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        let wqkv = gpu.alloc::<u16>((qd + 2 * kvd) * d)?;
        load_into(gpu, src, &p("attn_q"), qd, d, gpu.ptr(&wqkv))?;
        load_into(
            gpu,
            src,
            &p("attn_k"),
            kvd,
            d,
            gpu.ptr(&wqkv) + (2 * qd * d) as u64,
        )?;
        load_into(
            gpu,
            src,
            &p("attn_v"),
            kvd,
            d,
            gpu.ptr(&wqkv) + (2 * (qd + kvd) * d) as u64,
        )?;
        let w_gate_up = gpu.alloc::<u16>(2 * ff * d)?;
        load_into(gpu, src, &p("ffn_gate"), ff, d, gpu.ptr(&w_gate_up))?;
        load_into(
            gpu,
            src,
            &p("ffn_up"),
            ff,
            d,
            gpu.ptr(&w_gate_up) + (2 * ff * d) as u64,
        )?;
        layers.push(GpuLayer {
            attn_norm: gpu.upload(attn_norm)?,
            wqkv,
            wo: load(gpu, src, &p("attn_output"), d, qd)?,
            ffn_norm: gpu.upload(ffn_norm)?,
            w_gate_up,
            w_down: load(gpu, src, &p("ffn_down"), d, ff)?,
        });
    }
    let token_embd = load(gpu, src, "token_embd.weight", cfg.vocab_size, d)?;
    let output = if tied {
        None
    } else {
        Some(load(gpu, src, "output.weight", cfg.vocab_size, d)?)
    };
    gpu.synchronize()?;
    Ok(GpuWeights {
        token_embd,
        layers,
        output_norm: gpu.upload(output_norm)?,
        output,
    })
}

fn load(
    gpu: &Gpu,
    src: &dyn MatrixSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<CudaSlice<u16>, CudaError> {
    let buf = gpu.alloc::<u16>(rows * cols)?;
    load_into(gpu, src, name, rows, cols, gpu.ptr(&buf))?;
    Ok(buf)
}

/// Dequantises matrix `name` into the `rows × cols` act_t elements at `dst`.
fn load_into(
    gpu: &Gpu,
    src: &dyn MatrixSource,
    name: &str,
    rows: usize,
    cols: usize,
    dst: DevPtr,
) -> Result<(), CudaError> {
    let (ty, bytes) = src.matrix(name, rows, cols)?;
    dequantize_into(gpu, ty, &bytes, rows * cols, dst)
}

/// Uploads GGUF blocks of type `ty` and dequantises their `n` values into act_t at `dst`.
pub fn dequantize_into(
    gpu: &Gpu,
    ty: GgmlType,
    bytes: &[u8],
    n: usize,
    dst: DevPtr,
) -> Result<(), CudaError> {
    let kernel = match ty {
        GgmlType::Q4_0 => "dequant_q4_0",
        GgmlType::Q4_1 => "dequant_q4_1",
        GgmlType::Q8_0 => "dequant_q8_0",
        GgmlType::F16 => "dequant_f16",
        GgmlType::BF16 => "dequant_bf16",
        GgmlType::F32 => "dequant_f32",
        other => {
            return Err(CudaError::Unsupported(format!(
                "weights of type {other} (supported: Q4_0, Q4_1, Q8_0, F16, BF16, F32)"
            )))
        }
    };
    let expect = ty
        .row_bytes(n)
        .ok_or_else(|| CudaError::Unsupported(format!("{n} values are not whole {ty} blocks")))?;
    if bytes.len() != expect {
        return Err(CudaError::Unsupported(format!(
            "{} bytes for {n} values of {ty}, expected {expect}",
            bytes.len()
        )));
    }
    let staged = gpu.upload(bytes)?;
    // SAFETY: dequant_*(const src*, act_t*, long long) reads `expect` bytes of `staged` and
    // writes n elements at dst, which the caller allocated.
    unsafe {
        gpu.launch(
            kernel,
            gpu.grid_for(n),
            256,
            0,
            kargs![gpu.ptr(&staged), dst, n as i64],
        )?
    };
    // The staging buffer is freed on drop; make sure the kernel has read it first.
    gpu.synchronize()?;
    Ok(())
}
