//! Loading Llama-family (Gemma 3, Qwen2) weights from GGUF, or generating random weights of a real shape.
//!
//! Weights stay in their quantised GGML format in memory (copied out of the memory map
//! once, so that later kernels may repack them); only norms are converted to f32.

use std::collections::BTreeSet;

use pk_gguf::{dequantize, GgmlType, GgufFile};
use rand::{Rng, SeedableRng};

use crate::config::ModelConfig;
use crate::kernels::{place_in_arena, QMatrix};
use crate::ModelError;

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
    pub ffn_norm: Vec<f32>,
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
    /// Gemma 3's extra norms (`ArchExtras::qk_norm`, `post_norms`); `None` for Llama.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
    /// Qwen2's Q/K/V biases (`ArchExtras::qkv_bias`), added after the projections.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
}

pub struct Weights {
    /// `vocab × d_model`; row t is token t's embedding.
    pub token_embd: QMatrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The output head; `None` means tied to `token_embd`.
    pub output: Option<QMatrix>,
}

impl Weights {
    pub fn output_head(&self) -> &QMatrix {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// The weight bytes one decoded token reads, in the order it reads them: every layer's
    /// matrices, then the output head (the embedding lookup reads one row, left out).
    /// Reading them alone is the fastest a decode step could be (`decode_bench --vs-stream`).
    pub fn decode_read_data(&self) -> Vec<&[u8]> {
        let mut parts: Vec<&[u8]> = Vec::new();
        for l in &self.layers {
            parts.extend(
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .map(QMatrix::stored_data),
            );
        }
        parts.push(self.output_head().stored_data());
        parts
    }

    /// [`Self::decode_read_data`]'s bytes in all.
    pub fn decode_read_bytes(&self) -> usize {
        self.decode_read_data().iter().map(|p| p.len()).sum()
    }

    pub fn from_gguf(f: &GgufFile, cfg: &ModelConfig) -> Result<Weights, ModelError> {
        check_tensor_names(f, cfg)?;
        let layers = (0..cfg.n_layers)
            .map(|i| {
                let p = |n: &str| format!("blk.{i}.{n}.weight");
                Ok(LayerWeights {
                    attn_norm: vector(f, &p("attn_norm"), cfg.d_model)?,
                    wq: matrix(f, &p("attn_q"), cfg.q_dim(), cfg.d_model)?,
                    wk: matrix(f, &p("attn_k"), cfg.kv_dim(), cfg.d_model)?,
                    wv: matrix(f, &p("attn_v"), cfg.kv_dim(), cfg.d_model)?,
                    wo: matrix(f, &p("attn_output"), cfg.d_model, cfg.q_dim())?,
                    ffn_norm: vector(f, &p("ffn_norm"), cfg.d_model)?,
                    w_gate: matrix(f, &p("ffn_gate"), cfg.d_ff, cfg.d_model)?,
                    w_up: matrix(f, &p("ffn_up"), cfg.d_ff, cfg.d_model)?,
                    w_down: matrix(f, &p("ffn_down"), cfg.d_model, cfg.d_ff)?,
                    q_norm: cfg
                        .extras
                        .qk_norm
                        .then(|| vector(f, &p("attn_q_norm"), cfg.head_dim))
                        .transpose()?,
                    k_norm: cfg
                        .extras
                        .qk_norm
                        .then(|| vector(f, &p("attn_k_norm"), cfg.head_dim))
                        .transpose()?,
                    post_attn_norm: cfg
                        .extras
                        .post_norms
                        .then(|| vector(f, &p("post_attention_norm"), cfg.d_model))
                        .transpose()?,
                    post_ffn_norm: cfg
                        .extras
                        .post_norms
                        .then(|| vector(f, &p("post_ffw_norm"), cfg.d_model))
                        .transpose()?,
                    bq: cfg
                        .extras
                        .qkv_bias
                        .then(|| vector(f, &format!("blk.{i}.attn_q.bias"), cfg.q_dim()))
                        .transpose()?,
                    bk: cfg
                        .extras
                        .qkv_bias
                        .then(|| vector(f, &format!("blk.{i}.attn_k.bias"), cfg.kv_dim()))
                        .transpose()?,
                    bv: cfg
                        .extras
                        .qkv_bias
                        .then(|| vector(f, &format!("blk.{i}.attn_v.bias"), cfg.kv_dim()))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let output = match f.tensor_info("output.weight") {
            Ok(_) => Some(matrix(f, "output.weight", cfg.vocab_size, cfg.d_model)?),
            Err(_) => None,
        };
        let mut w = Weights {
            token_embd: matrix(f, "token_embd.weight", cfg.vocab_size, cfg.d_model)?,
            layers,
            output_norm: vector(f, "output_norm.weight", cfg.d_model)?,
            output,
        };
        w.place_in_arena();
        Ok(w)
    }

    /// Moves every matrix into one huge-page buffer in the order a forward pass reads them
    /// (layer by layer: q, k, v, o, gate, up, down; then the head), so that decode reads
    /// its weights as one sequential stream without TLB misses (see `kernels::hugebuf`).
    fn place_in_arena(&mut self) {
        let mut mats: Vec<&mut QMatrix> = Vec::new();
        for l in &mut self.layers {
            mats.extend([
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ]);
        }
        mats.extend(self.output.as_mut());
        mats.push(&mut self.token_embd);
        place_in_arena(&mut mats);
    }

    /// Random weights of `cfg`'s shape in format `ty`, for speed benchmarks only: the values
    /// are small and finite so that the arithmetic is representative, not meaningful.
    pub fn random(cfg: &ModelConfig, ty: GgmlType, seed: u64) -> Weights {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut m = |rows, cols| random_matrix(&mut rng, ty, rows, cols);
        let layers = (0..cfg.n_layers)
            .map(|_| LayerWeights {
                attn_norm: vec![1.0; cfg.d_model],
                wq: m(cfg.q_dim(), cfg.d_model),
                wk: m(cfg.kv_dim(), cfg.d_model),
                wv: m(cfg.kv_dim(), cfg.d_model),
                wo: m(cfg.d_model, cfg.q_dim()),
                ffn_norm: vec![1.0; cfg.d_model],
                w_gate: m(cfg.d_ff, cfg.d_model),
                w_up: m(cfg.d_ff, cfg.d_model),
                w_down: m(cfg.d_model, cfg.d_ff),
                q_norm: cfg.extras.qk_norm.then(|| vec![1.0; cfg.head_dim]),
                k_norm: cfg.extras.qk_norm.then(|| vec![1.0; cfg.head_dim]),
                post_attn_norm: cfg.extras.post_norms.then(|| vec![1.0; cfg.d_model]),
                post_ffn_norm: cfg.extras.post_norms.then(|| vec![1.0; cfg.d_model]),
                bq: cfg.extras.qkv_bias.then(|| vec![0.01; cfg.q_dim()]),
                bk: cfg.extras.qkv_bias.then(|| vec![0.01; cfg.kv_dim()]),
                bv: cfg.extras.qkv_bias.then(|| vec![0.01; cfg.kv_dim()]),
            })
            .collect();
        let mut w = Weights {
            token_embd: m(cfg.vocab_size, cfg.d_model),
            layers,
            output_norm: vec![1.0; cfg.d_model],
            output: None,
        };
        w.place_in_arena();
        w
    }
}

/// The tensors a model of `cfg`'s architecture reads: the Llama block's, what `cfg.extras`
/// adds, an optional untied output head and, where `ModelConfig` read them, Llama 3.1's
/// RoPE frequency factors.
pub fn expected_tensor_names(cfg: &ModelConfig) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = ["token_embd.weight", "output_norm.weight", "output.weight"]
        .map(String::from)
        .into();
    if cfg.rope_freq_factors.is_some() {
        names.insert("rope_freqs.weight".into());
    }
    let x = &cfg.extras;
    let mut per_layer = vec![
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    if x.qk_norm {
        per_layer.extend(["attn_q_norm.weight", "attn_k_norm.weight"]);
    }
    if x.post_norms {
        per_layer.extend(["post_attention_norm.weight", "post_ffw_norm.weight"]);
    }
    if x.qkv_bias {
        per_layer.extend(["attn_q.bias", "attn_k.bias", "attn_v.bias"]);
    }
    for i in 0..cfg.n_layers {
        names.extend(per_layer.iter().map(|n| format!("blk.{i}.{n}")));
    }
    names
}

/// Refuses a file that holds a tensor the forward pass would not read (a bias, a norm or
/// RoPE factors of an architecture variant we do not implement): run without it, the
/// model would be silently wrong.
pub fn check_tensor_names(f: &GgufFile, cfg: &ModelConfig) -> Result<(), ModelError> {
    let expected = expected_tensor_names(cfg);
    match f.tensors.iter().find(|t| !expected.contains(&t.name)) {
        Some(t) => Err(ModelError::Unrecognized {
            what: "tensor",
            name: t.name.clone(),
        }),
        None => Ok(()),
    }
}

fn matrix(f: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<QMatrix, ModelError> {
    let info = f.tensor_info(name)?;
    if info.row_len() != cols || info.n_rows() != rows {
        return Err(ModelError::BadConfig(format!(
            "tensor {name} has shape {:?}, expected [{cols}, {rows}]",
            info.dims
        )));
    }
    // K-quants run as the integer kernels' formats (see `kquant`).
    let m = match crate::kquant::convert(info.ggml_type, f.tensor_data(info)) {
        Some((ty, data)) => QMatrix::new(ty, rows, cols, data),
        None => QMatrix::from_bytes(info.ggml_type, rows, cols, f.tensor_data(info)),
    };
    // The matrix now has its own copy; the file's pages need not stay resident beside it.
    f.release_tensor_pages(info);
    Ok(m)
}

fn vector(f: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let info = f.tensor_info(name)?;
    if info.n_elems() as usize != len {
        return Err(ModelError::BadConfig(format!(
            "tensor {name} has {} elements, expected {len}",
            info.n_elems()
        )));
    }
    let mut out = vec![0f32; len];
    dequantize(info.ggml_type, f.tensor_data(info), &mut out);
    Ok(out)
}

/// Random blocks whose scale fields are valid small f16 values (random bytes there would
/// make NaNs and infinities, which run at different speeds on some CPUs).
fn random_matrix(rng: &mut impl Rng, ty: GgmlType, rows: usize, cols: usize) -> QMatrix {
    let row_bytes = ty
        .row_bytes(cols)
        .expect("dummy shapes are block multiples");
    let mut data = vec![0u8; rows * row_bytes];
    rng.fill(&mut data[..]);
    let scale = |rng: &mut dyn rand::RngCore| {
        half::f16::from_f32(rng.gen_range(0.001f32..0.01)).to_le_bytes()
    };
    let bb = ty.block_bytes();
    for blk in data.chunks_exact_mut(bb) {
        match ty {
            GgmlType::F32 => blk.copy_from_slice(&rng.gen_range(-0.05f32..0.05).to_le_bytes()),
            GgmlType::F16 => {
                blk.copy_from_slice(&half::f16::from_f32(rng.gen_range(-0.05..0.05)).to_le_bytes())
            }
            GgmlType::BF16 => {
                blk.copy_from_slice(&half::bf16::from_f32(rng.gen_range(-0.05..0.05)).to_le_bytes())
            }
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
                blk[0..2].copy_from_slice(&scale(rng))
            }
            GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q6S => {
                blk[0..2].copy_from_slice(&scale(rng));
                blk[2..4].copy_from_slice(&scale(rng));
            }
            GgmlType::Q6K => blk[208..210].copy_from_slice(&scale(rng)),
        }
    }
    QMatrix::new(ty, rows, cols, data)
}
