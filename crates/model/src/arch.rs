//! Reading a `ModelConfig` from GGUF metadata, strictly: every `{arch}.*` key is either
//! honoured here or refused by name, and so is every tensor `Weights` does not read.
//!
//! llama.cpp loads what it knows and ignores the rest, which is how a Llama 3.1 file whose
//! `rope_freqs.weight` was never applied ran here silently wrong. A key or tensor we do
//! not use can change the model's math, so it stops the load unless it is on the short
//! list of keys known not to (`HARMLESS_ARCH_KEYS`, provenance metadata).

use std::collections::BTreeSet;

use pk_gguf::{GgufError, GgufFile, MetaValue};

use crate::config::{ArchExtras, ModelConfig, RopeStyle, SlidingWindow};
use crate::ModelError;

/// Architectures whose forward pass we implement.
pub const SUPPORTED_ARCHS: &[&str] = &["llama", "gemma3", "qwen2", "qwen3"];

/// `{arch}.*` keys read by `ModelConfig::from_gguf` for every architecture.
const COMMON_ARCH_KEYS: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "vocab_size",
];

/// `{arch}.*` keys that change nothing in the forward pass we run: the context length a
/// YaRN or LongRoPE model was trained at (we refuse both scalings, and linear scaling does
/// not read it) and the converter's note that the model was fine-tuned at its scaling.
const HARMLESS_ARCH_KEYS: &[&str] = &[
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
];

/// Keys only Gemma 3 reads.
const GEMMA3_KEYS: &[&str] = &[
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "rope.freq_base_swa",
    "final_logit_softcapping",
];

/// Gemma 3's "5-to-1 interleaved attention" and its local RoPE base, which older GGUFs do
/// not carry (llama.cpp defaults both for the architecture).
const GEMMA3_GLOBAL_EVERY: usize = 6;
const GEMMA3_ROPE_THETA_LOCAL: f32 = 10_000.0;
/// llama.cpp tells Gemma 3 27B by its depth and scales its queries by 1/√(d_model/heads)
/// instead of 1/√head_dim (gemma_pytorch's `query_pre_attn_scalar`).
const GEMMA3_27B_LAYERS: usize = 62;

impl ModelConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch = f.get_str("general.architecture")?.to_string();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            return Err(ModelError::UnsupportedArch(arch));
        }
        check_arch_keys(f, &arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let n_heads = f.get_u64(&key("attention.head_count"))? as usize;
        let d_model = f.get_u64(&key("embedding_length"))? as usize;
        let head_dim = optional_u64(f, &key("attention.key_length"))?
            .map_or(d_model / n_heads.max(1), |v| v as usize);
        let vocab_size = match optional_u64(f, &key("vocab_size"))? {
            Some(v) => v as usize,
            None => f.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let n_layers = f.get_u64(&key("block_count"))? as usize;
        let mut cfg = ModelConfig {
            name: f.get_str("general.name").unwrap_or("unnamed").to_string(),
            n_layers,
            n_heads,
            n_kv_heads: n_kv_heads(f, &key("attention.head_count_kv"), n_heads, n_layers)?,
            head_dim,
            d_model,
            d_ff: f.get_u64(&key("feed_forward_length"))? as usize,
            vocab_size,
            context_length: f.get_u64(&key("context_length"))? as usize,
            rope_theta: optional_f64(f, &key("rope.freq_base"))?.unwrap_or(10000.0) as f32,
            rope_style: RopeStyle::Normal,
            rope_freq_scale: linear_rope_freq_scale(f, &arch)?,
            rope_freq_factors: None,
            // llama.cpp requires it for every architecture we run, so there is no default.
            rms_eps: f.get_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            extras: ArchExtras::default(),
            arch: arch.clone(),
        };
        check_head_lengths(f, &cfg)?;
        match arch.as_str() {
            "llama" => cfg.rope_freq_factors = rope_freq_factors(f, &cfg)?,
            // llama.cpp's qwen2 graph: the Llama block with biased Q/K/V projections and
            // NEOX RoPE (its converter does not permute Q/K as it does for Llama).
            "qwen2" => {
                cfg.rope_style = RopeStyle::Neox;
                cfg.extras.qkv_bias = true;
            }
            // llama.cpp's qwen3 graph: no biases, Q and K RMS-normalised per head before
            // NEOX RoPE.
            "qwen3" => {
                cfg.rope_style = RopeStyle::Neox;
                cfg.extras.qk_norm = true;
            }
            "gemma3" => gemma3_extras(f, &mut cfg)?,
            _ => unreachable!("checked against SUPPORTED_ARCHS"),
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Refuses any `{arch}.*` key this module does not read and is not known to be harmless.
fn check_arch_keys(f: &GgufFile, arch: &str) -> Result<(), ModelError> {
    let prefix = format!("{arch}.");
    let gemma: &[&str] = if arch == "gemma3" { GEMMA3_KEYS } else { &[] };
    let known: BTreeSet<&str> = COMMON_ARCH_KEYS
        .iter()
        .chain(HARMLESS_ARCH_KEYS)
        .chain(gemma)
        .copied()
        .collect();
    for k in f.metadata.keys() {
        if let Some(rest) = k.strip_prefix(&prefix) {
            if !known.contains(rest) {
                return Err(ModelError::Unrecognized {
                    what: "metadata key",
                    name: k.clone(),
                });
            }
        }
    }
    Ok(())
}

/// A key's value, `None` only when it is missing: a value of the wrong type is refused
/// (naming the key and both types) rather than replaced by a default.
fn optional_u64(f: &GgufFile, key: &str) -> Result<Option<u64>, ModelError> {
    missing_as_none(f.get_u64(key))
}

fn optional_f64(f: &GgufFile, key: &str) -> Result<Option<f64>, ModelError> {
    missing_as_none(f.get_f64(key))
}

fn missing_as_none<T>(r: Result<T, GgufError>) -> Result<Option<T>, ModelError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(GgufError::MissingKey(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// `{arch}.attention.head_count_kv`: absent means one KV head per query head (as in
/// llama.cpp). llama.cpp also reads an array of one count per layer; we run one count
/// for all layers, so an array is honoured only when it has `n_layers` equal entries.
fn n_kv_heads(
    f: &GgufFile,
    key: &str,
    n_heads: usize,
    n_layers: usize,
) -> Result<usize, ModelError> {
    let Some(MetaValue::Array(items)) = f.get(key) else {
        return Ok(optional_u64(f, key)?.map_or(n_heads, |v| v as usize));
    };
    let counts: Option<Vec<u64>> = items.iter().map(MetaValue::as_u64).collect();
    match counts.as_deref() {
        Some([first, rest @ ..]) if items.len() == n_layers && rest.iter().all(|c| c == first) => {
            Ok(*first as usize)
        }
        _ => Err(ModelError::BadConfig(format!(
            "{key} is an array of {} entries; per-layer KV head counts are not supported \
             (give a number, or {n_layers} equal counts)",
            items.len()
        ))),
    }
}

/// Keys and values must have one head length, and RoPE must rotate all of it (llama.cpp's
/// Llama, Qwen and Gemma graphs assert both).
fn check_head_lengths(f: &GgufFile, cfg: &ModelConfig) -> Result<(), ModelError> {
    let key = |k: &str| format!("{}.{k}", cfg.arch);
    for (k, what) in [
        ("attention.value_length", "value head length"),
        ("rope.dimension_count", "rotated dimensions"),
    ] {
        if let Some(v) = optional_u64(f, &key(k))? {
            if v as usize != cfg.head_dim {
                return Err(ModelError::BadConfig(format!(
                    "{} = {v}: a {what} other than the key head length {} is not supported",
                    key(k),
                    cfg.head_dim
                )));
            }
        }
    }
    Ok(())
}

/// `{arch}.rope.scaling.type`: `linear` or absent (1 / `rope.scaling.factor`, as
/// llama.cpp's `rope_freq_scale_train`), `none` (1.0); YaRN, LongRoPE and anything else
/// are refused.
fn linear_rope_freq_scale(f: &GgufFile, arch: &str) -> Result<f32, ModelError> {
    let ty_key = format!("{arch}.rope.scaling.type");
    let factor_key = format!("{arch}.rope.scaling.factor");
    let factor = optional_f64(f, &factor_key)?;
    let ty = match f.get_str(&ty_key) {
        Ok(t) => t.to_string(),
        Err(GgufError::MissingKey(_)) => "linear".to_string(),
        Err(e) => return Err(e.into()),
    };
    match (ty.as_str(), factor) {
        // llama.cpp reads a factor of 0 as "no scaling".
        ("none", None | Some(0.0) | Some(1.0)) | ("linear", None | Some(0.0)) => Ok(1.0),
        // llama.cpp computes 1 / factor from the file but then, for type none, rotates
        // unscaled (`llama_context`: "never scale if scaling type is none"). A file saying
        // both is contradictory, so it is refused rather than silently read either way.
        ("none", Some(x)) => Err(ModelError::BadConfig(format!(
            "{factor_key} = {x} contradicts {ty_key} = \"none\" (llama.cpp would ignore \
             the factor); set the type to \"linear\" or drop the factor"
        ))),
        ("linear", Some(x)) if x > 0.0 && x.is_finite() => Ok((1.0 / x) as f32),
        ("linear", Some(x)) => Err(ModelError::BadConfig(format!("{factor_key} = {x}"))),
        (other, _) => Err(ModelError::BadConfig(format!(
            "{ty_key} = {other:?} is not supported (only linear RoPE scaling is)"
        ))),
    }
}

/// Llama 3.1/3.2's RoPE frequency factors: the tensor `rope_freqs.weight` (`head_dim / 2`
/// floats), by which llama.cpp divides every rotation frequency.
fn rope_freq_factors(f: &GgufFile, cfg: &ModelConfig) -> Result<Option<Vec<f32>>, ModelError> {
    let name = "rope_freqs.weight";
    let Ok(info) = f.tensor_info(name) else {
        return Ok(None);
    };
    let half = cfg.head_dim / 2;
    if info.n_elems() as usize != half {
        return Err(ModelError::BadConfig(format!(
            "tensor {name} has {} elements, expected head_dim / 2 = {half}",
            info.n_elems()
        )));
    }
    let mut out = vec![0f32; half];
    pk_gguf::dequantize(info.ggml_type, f.tensor_data(info), &mut out);
    if let Some(bad) = out.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        return Err(ModelError::BadConfig(format!(
            "tensor {name} holds {bad}; RoPE frequency factors must be positive"
        )));
    }
    Ok(Some(out))
}

fn gemma3_extras(f: &GgufFile, cfg: &mut ModelConfig) -> Result<(), ModelError> {
    let key = |k: &str| format!("gemma3.{k}");
    // Gemma's GGUF converter stores its norms' weights as 1 + w, so the plain RMSNorm of the
    // Llama block applies unchanged.
    cfg.rope_style = RopeStyle::Neox;
    let softcap = match f.get_f64(&key("final_logit_softcapping")) {
        Ok(v) => v,
        Err(GgufError::MissingKey(_)) => 0.0,
        Err(e) => return Err(e.into()),
    };
    if softcap != 0.0 {
        return Err(ModelError::BadConfig(format!(
            "gemma3.final_logit_softcapping = {softcap} is not supported"
        )));
    }
    let global_every = match f.get("gemma3.attention.sliding_window_pattern") {
        None => GEMMA3_GLOBAL_EVERY,
        Some(v) => v.as_u64().map(|n| n as usize).filter(|&n| n > 0).ok_or_else(|| {
            ModelError::BadConfig(format!(
                "gemma3.attention.sliding_window_pattern = {v:?}: only a number (every n-th layer global) is supported"
            ))
        })?,
    };
    let rope_theta_local = match f.get_f64(&key("rope.freq_base_swa")) {
        Ok(v) => v as f32,
        Err(GgufError::MissingKey(_)) => GEMMA3_ROPE_THETA_LOCAL,
        Err(e) => return Err(e.into()),
    };
    cfg.extras = ArchExtras {
        embed_scale: Some((cfg.d_model as f32).sqrt()),
        gelu: true,
        qk_norm: true,
        post_norms: true,
        // A window of 0, or none given, is llama.cpp's "no sliding window" (`gemma3.cpp`:
        // `found_swa && n_swa > 0`): every layer attends globally.
        sliding_window: match optional_u64(f, &key("attention.sliding_window"))?.unwrap_or(0)
            as usize
        {
            0 => None,
            window_tokens => Some(SlidingWindow {
                window_tokens,
                global_every,
                rope_theta_local,
            }),
        },
        qkv_bias: false,
        query_scale: (cfg.n_layers == GEMMA3_27B_LAYERS)
            .then(|| 1.0 / ((cfg.d_model / cfg.n_heads) as f32).sqrt()),
    };
    Ok(())
}
