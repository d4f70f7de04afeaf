//! `ModelConfig::from_gguf` on metadata-only GGUFs written here: what each architecture
//! reads (Llama 3's linear RoPE scaling, Qwen3's extras, Gemma 3's pattern and local base)
//! and what it refuses by name (YaRN, unknown `{arch}.*` keys, partial rotary dimensions).

use pk_gguf::GgufFile;
use pk_model::{ModelConfig, ModelError, RopeStyle};

enum V {
    U32(u32),
    F32(f32),
    Str(&'static str),
    U32Array(Vec<u32>),
}

/// A GGUF v3 file holding only `kvs`; opened, then deleted.
fn gguf(name: &str, kvs: &[(&str, V)]) -> GgufFile {
    let put_str = |out: &mut Vec<u8>, s: &str| {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    };
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (key, value) in kvs {
        put_str(&mut out, key);
        match value {
            V::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            V::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            V::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            V::U32Array(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(4u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                items.iter().for_each(|v| out.extend(v.to_le_bytes()));
            }
        }
    }
    let path = std::env::temp_dir().join(format!("pk-arch-{}-{name}.gguf", std::process::id()));
    std::fs::write(&path, out).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    f
}

/// The keys every architecture needs, for `arch`, with `extra` added (an extra key of the
/// same name replaces the base one).
fn config(
    name: &str,
    arch: &'static str,
    extra: Vec<(String, V)>,
) -> Result<ModelConfig, ModelError> {
    config_without(name, arch, &[], extra)
}

/// `config` without the base keys named in `drop` (written without the `{arch}.` prefix).
fn config_without(
    name: &str,
    arch: &'static str,
    drop: &[&str],
    extra: Vec<(String, V)>,
) -> Result<ModelConfig, ModelError> {
    let k = |s: &str| format!("{arch}.{s}");
    let mut kvs: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::Str(arch)),
        (k("block_count"), V::U32(2)),
        (k("embedding_length"), V::U32(256)),
        (k("feed_forward_length"), V::U32(512)),
        (k("attention.head_count"), V::U32(4)),
        (k("attention.head_count_kv"), V::U32(2)),
        (k("attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
        (k("context_length"), V::U32(4096)),
        (k("vocab_size"), V::U32(1000)),
    ];
    kvs.retain(|(key, _)| {
        !drop.iter().any(|d| *key == k(d)) && !extra.iter().any(|(e, _)| e == key)
    });
    kvs.extend(extra);
    let refs: Vec<(&str, V)> = kvs
        .into_iter()
        .map(|(key, v)| (&*Box::leak(key.into_boxed_str()), v))
        .collect();
    ModelConfig::from_gguf(&gguf(name, &refs))
}

#[test]
fn llama_linear_scaling_is_read_and_yarn_refused_by_name() {
    let c = config(
        "linear",
        "llama",
        vec![
            ("llama.rope.scaling.type".into(), V::Str("linear")),
            ("llama.rope.scaling.factor".into(), V::F32(4.0)),
        ],
    )
    .unwrap();
    assert_eq!(c.rope_freq_scale, 0.25);
    assert_eq!(
        c.rope_inv_freq(false)[0],
        0.25,
        "frequency 0 is 1 rad/token, scaled"
    );
    let err = config(
        "yarn",
        "llama",
        vec![("llama.rope.scaling.type".into(), V::Str("yarn"))],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("llama.rope.scaling.type") && err.contains("yarn"),
        "{err}"
    );
}

#[test]
fn an_unknown_architecture_key_is_refused_by_name() {
    let err = config(
        "unknown",
        "llama",
        vec![("llama.attention.scale".into(), V::F32(0.1))],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("llama.attention.scale"), "{err}");
    // Keys of another prefix are not the architecture's (general.*, tokenizer.*).
    config(
        "general",
        "llama",
        vec![("general.license".into(), V::Str("mit"))],
    )
    .unwrap();
}

#[test]
fn partial_rotary_dimensions_are_refused() {
    let err = config(
        "rot",
        "llama",
        vec![("llama.rope.dimension_count".into(), V::U32(32))],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("llama.rope.dimension_count"), "{err}");
    // Equal to the head length (256 / 4): fine.
    config(
        "rot64",
        "llama",
        vec![("llama.rope.dimension_count".into(), V::U32(64))],
    )
    .unwrap();
}

#[test]
fn qwen3_is_neox_with_qk_norms_and_no_biases() {
    let c = config(
        "qwen3",
        "qwen3",
        vec![("qwen3.attention.key_length".into(), V::U32(128))],
    )
    .unwrap();
    assert_eq!(c.rope_style, RopeStyle::Neox);
    assert!(c.extras.qk_norm && !c.extras.qkv_bias && !c.extras.post_norms);
    assert_eq!(
        (c.head_dim, c.q_dim()),
        (128, 512),
        "head length independent of width"
    );
}

#[test]
fn gemma3_pattern_local_base_and_global_scaling() {
    let c = config(
        "gemma",
        "gemma3",
        vec![
            ("gemma3.attention.sliding_window".into(), V::U32(1024)),
            ("gemma3.attention.sliding_window_pattern".into(), V::U32(2)),
            ("gemma3.rope.freq_base_swa".into(), V::F32(20000.0)),
            ("gemma3.rope.scaling.type".into(), V::Str("linear")),
            ("gemma3.rope.scaling.factor".into(), V::F32(8.0)),
        ],
    )
    .unwrap();
    let w = c.extras.sliding_window.unwrap();
    assert_eq!(
        (w.window_tokens, w.global_every, w.rope_theta_local),
        (1024, 2, 20000.0)
    );
    assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(1024), None));
    assert_eq!(c.rope_inv_freq(false)[0], 0.125, "global layers scaled");
    assert_eq!(c.rope_inv_freq(true)[0], 1.0, "local layers not");
    let err = config(
        "softcap",
        "gemma3",
        vec![
            ("gemma3.attention.sliding_window".into(), V::U32(512)),
            ("gemma3.final_logit_softcapping".into(), V::F32(30.0)),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("final_logit_softcapping"), "{err}");
}

#[test]
fn a_hyperparameter_of_the_wrong_type_is_refused_not_defaulted() {
    for (key, expected) in [
        ("llama.rope.freq_base", "number"),
        ("llama.attention.layer_norm_rms_epsilon", "number"),
        ("llama.attention.head_count_kv", "integer"),
        ("llama.vocab_size", "integer"),
    ] {
        let err = config("wrong-type", "llama", vec![(key.into(), V::Str("1"))])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!("metadata key {key} has type string, expected {expected}")
        );
    }
    // Missing, the optional ones take llama.cpp's defaults.
    let c = config_without(
        "defaults",
        "llama",
        &["attention.head_count_kv", "vocab_size"],
        vec![],
    );
    let err = c.unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.ggml.tokens"),
        "vocab size falls back to the vocabulary: {err}"
    );
    let c = config_without("defaults", "llama", &["attention.head_count_kv"], vec![]).unwrap();
    assert_eq!((c.n_kv_heads, c.rope_theta), (4, 10000.0));
}

#[test]
fn a_missing_rms_epsilon_is_refused_by_name() {
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        let window = vec![("gemma3.attention.sliding_window".into(), V::U32(512))];
        let extra = if arch == "gemma3" { window } else { vec![] };
        let err = config_without("no-eps", arch, &["attention.layer_norm_rms_epsilon"], extra)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!("missing metadata key {arch}.attention.layer_norm_rms_epsilon")
        );
    }
    assert_eq!(config("eps", "llama", vec![]).unwrap().rms_eps, 1e-6);
}

#[test]
fn a_per_layer_kv_head_count_is_honoured_only_when_uniform() {
    let key = "llama.attention.head_count_kv";
    let c = config(
        "kv-equal",
        "llama",
        vec![(key.into(), V::U32Array(vec![2, 2]))],
    )
    .unwrap();
    assert_eq!(c.n_kv_heads, 2);
    for counts in [vec![2, 4], vec![2, 2, 2], vec![]] {
        let err = config(
            "kv-varied",
            "llama",
            vec![(key.into(), V::U32Array(counts))],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(key) && err.contains("per-layer KV head counts are not supported"),
            "{err}"
        );
    }
}

#[test]
fn a_scaling_factor_with_scaling_type_none_is_refused() {
    let none = |factor: Option<f32>| {
        let mut extra = vec![("llama.rope.scaling.type".into(), V::Str("none"))];
        extra.extend(factor.map(|x| ("llama.rope.scaling.factor".into(), V::F32(x))));
        config("none", "llama", extra)
    };
    // llama.cpp rotates unscaled under type none, whatever the factor says.
    for factor in [None, Some(0.0), Some(1.0)] {
        assert_eq!(none(factor).unwrap().rope_freq_scale, 1.0, "{factor:?}");
    }
    let err = none(Some(4.0)).unwrap_err().to_string();
    assert!(
        err.contains("llama.rope.scaling.factor = 4")
            && err.contains("llama.rope.scaling.type = \"none\""),
        "{err}"
    );
}

#[test]
fn gemma3_sliding_window_zero_makes_every_layer_global() {
    let c = config(
        "swa0",
        "gemma3",
        vec![
            ("gemma3.attention.sliding_window".into(), V::U32(0)),
            ("gemma3.rope.scaling.type".into(), V::Str("linear")),
            ("gemma3.rope.scaling.factor".into(), V::F32(8.0)),
        ],
    )
    .unwrap();
    assert!(c.extras.sliding_window.is_none());
    assert_eq!((c.layer_window(0), c.layer_window(1)), (None, None));
    assert!(c.kv_group_layout().is_none());
    assert_eq!(
        c.rope_inv_freq(false)[0],
        0.125,
        "every layer is global, so scaled"
    );
}

/// A Gemma 3 file without `sliding_window` is llama.cpp's no sliding window, as 0 is.
#[test]
fn gemma3_without_a_sliding_window_makes_every_layer_global() {
    let c = config("no-swa", "gemma3", vec![]).unwrap();
    assert!(c.extras.sliding_window.is_none());
    assert_eq!((c.layer_window(0), c.layer_window(1)), (None, None));
}
