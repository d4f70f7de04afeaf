//! Whether a GGUF would load, without loading its weights: `info` reports this, so it must
//! run every check that `generate` runs on the file before the first forward pass.
//!
//! NOTE 1: `ModelConfig::from_gguf` alone is not enough: a tensor the forward pass would
//! not read (`weights::check_tensor_names`) or a tokenizer key or pre-tokenizer we do not
//! implement (`Tokenizer::from_gguf`) stops `generate` too, so `info` must say so.

use anyhow::{Context, Result};
use pk_gguf::GgufFile;
use pk_model::ModelConfig;

/// The model's configuration if `generate` would accept the file's metadata and tensor
/// names; otherwise the first refusal, as `generate` words it.
pub fn runnable_config(f: &GgufFile) -> Result<ModelConfig> {
    let cfg = ModelConfig::from_gguf(f).context("reading the model's configuration")?;
    pk_model::weights::check_tensor_names(f, &cfg).context("checking the tensor names")?;
    pk_tokenizer::Tokenizer::from_gguf(f).context("building the tokenizer")?;
    pk_tokenizer::ChatTemplate::from_gguf(f).context("reading the chat template")?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    enum V {
        U32(u32),
        F32(f32),
        Str(&'static str),
        Strs(&'static [&'static str]),
    }

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A GGUF v3 file with `kvs` and one f32 tensor of 32 elements per name in `tensors`.
    fn gguf(name: &str, kvs: &[(&str, V)], tensors: &[&str]) -> GgufFile {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (key, value) in kvs {
            put_str(&mut out, key);
            match value {
                V::U32(v) => out.extend([&4u32.to_le_bytes()[..], &v.to_le_bytes()].concat()),
                V::F32(v) => out.extend([&6u32.to_le_bytes()[..], &v.to_le_bytes()].concat()),
                V::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                V::Strs(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    items.iter().for_each(|s| put_str(&mut out, s));
                }
            }
        }
        let tensor_bytes = 32 * 4;
        for (i, t) in tensors.iter().enumerate() {
            put_str(&mut out, t);
            out.extend(1u32.to_le_bytes());
            out.extend(32u64.to_le_bytes());
            out.extend(0u32.to_le_bytes()); // GGML_TYPE_F32
            out.extend((i as u64 * tensor_bytes).to_le_bytes());
        }
        out.resize(
            out.len().div_ceil(32) * 32 + tensors.len() * tensor_bytes as usize,
            0,
        );
        let path = std::env::temp_dir().join(format!("pk-cli-{}-{name}.gguf", std::process::id()));
        std::fs::write(&path, out).expect("temp dir is writable");
        let f = GgufFile::open(&path).expect("written GGUF parses");
        let _ = std::fs::remove_file(&path);
        f
    }

    /// A one-layer Llama's metadata with a three-token byte-level BPE vocabulary using
    /// the pre-tokenizer `pre`.
    fn llama_kvs(pre: &'static str) -> Vec<(&'static str, V)> {
        vec![
            ("general.architecture", V::Str("llama")),
            ("llama.block_count", V::U32(1)),
            ("llama.embedding_length", V::U32(32)),
            ("llama.feed_forward_length", V::U32(64)),
            ("llama.attention.head_count", V::U32(4)),
            ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
            ("llama.context_length", V::U32(128)),
            ("tokenizer.ggml.model", V::Str("gpt2")),
            ("tokenizer.ggml.pre", V::Str(pre)),
            ("tokenizer.ggml.tokens", V::Strs(&["a", "b", "ab"])),
            ("tokenizer.ggml.merges", V::Strs(&["a b"])),
            ("tokenizer.ggml.eos_token_id", V::U32(0)),
        ]
    }

    #[test]
    fn a_file_generate_accepts_is_runnable() {
        let f = gguf("ok", &llama_kvs("smollm"), &["token_embd.weight"]);
        assert_eq!(runnable_config(&f).unwrap().n_layers, 1);
    }

    #[test]
    fn a_tensor_the_forward_pass_does_not_read_is_reported_by_name() {
        let tensors = ["token_embd.weight", "blk.0.attn_output.bias"];
        let f = gguf("bias", &llama_kvs("smollm"), &tensors);
        let err = format!("{:#}", runnable_config(&f).unwrap_err());
        assert!(
            err.contains("tensor \"blk.0.attn_output.bias\", which this engine does not use"),
            "{err}"
        );
    }

    #[test]
    fn a_tokenizer_we_do_not_implement_is_reported_by_name() {
        let f = gguf("tekken", &llama_kvs("tekken"), &["token_embd.weight"]);
        let err = format!("{:#}", runnable_config(&f).unwrap_err());
        assert!(
            err.contains("building the tokenizer")
                && err.contains("\"tokenizer.ggml.pre\" = \"tekken\""),
            "{err}"
        );
    }
}
