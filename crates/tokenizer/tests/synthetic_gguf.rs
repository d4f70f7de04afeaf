//! Tokenizers built from small GGUF files written by the test itself: SentencePiece
//! (`"llama"`) behaviour and metadata errors, without needing a real model on disk.

use std::path::PathBuf;

use pk_gguf::GgufFile;
use pk_tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError, TokenizerKind};

/// The few metadata value kinds these tests need.
enum Value {
    Str(&'static str),
    U32(u32),
    Bool(bool),
    StrArray(Vec<String>),
    I32Array(Vec<i32>),
    F32Array(Vec<f32>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Writes a GGUF v3 file with the given metadata and no tensors; returns its path.
fn write_gguf(name: &str, kvs: Vec<(&str, Value)>) -> PathBuf {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(0u64.to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (key, value) in kvs {
        put_str(&mut out, key);
        let array_header = |out: &mut Vec<u8>, elem_type: u32, n: usize| {
            out.extend(9u32.to_le_bytes());
            out.extend(elem_type.to_le_bytes());
            out.extend((n as u64).to_le_bytes());
        };
        match value {
            Value::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Value::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Value::Bool(b) => {
                out.extend(7u32.to_le_bytes());
                out.push(b as u8);
            }
            Value::StrArray(items) => {
                array_header(&mut out, 8, items.len());
                items.iter().for_each(|s| put_str(&mut out, s));
            }
            Value::I32Array(items) => {
                array_header(&mut out, 5, items.len());
                items.iter().for_each(|v| out.extend(v.to_le_bytes()));
            }
            Value::F32Array(items) => {
                array_header(&mut out, 6, items.len());
                items.iter().for_each(|v| out.extend(v.to_le_bytes()));
            }
        }
    }
    let path =
        std::env::temp_dir().join(format!("pk-tokenizer-{}-{name}.gguf", std::process::id()));
    std::fs::write(&path, out).expect("temp dir is writable");
    path
}

fn open(path: &PathBuf) -> GgufFile {
    let f = GgufFile::open(path).expect("written GGUF parses");
    // The metadata is in memory now; the file itself is no longer needed.
    let _ = std::fs::remove_file(path);
    f
}

/// A Gemma-like SentencePiece vocabulary: specials, 256 byte tokens, then a few pieces.
fn spm_gguf(name: &str, add_space_prefix: bool) -> GgufFile {
    spm_gguf_with(name, add_space_prefix, Vec::new())
}

/// `spm_gguf` with more metadata.
fn spm_gguf_with(name: &str, add_space_prefix: bool, extra: Vec<(&str, Value)>) -> GgufFile {
    let specials = [
        ("<pad>", 3),
        ("<eos>", 3),
        ("<bos>", 3),
        ("<unk>", 2),
        ("<start_of_turn>", 3),
        ("<end_of_turn>", 3),
        ("<b>", 4),
    ];
    let pieces = [
        ("▁", -10.0),
        ("h", -10.0),
        ("e", -10.0),
        ("l", -10.0),
        ("o", -10.0),
        ("w", -10.0),
        ("r", -10.0),
        ("d", -10.0),
        ("he", -5.0),
        ("ll", -4.0),
        ("llo", -3.0),
        ("hello", -2.0),
        ("▁hello", -1.0),
        ("▁w", -6.0),
        ("or", -6.5),
        ("▁wor", -3.0),
        ("ld", -6.0),
        ("▁world", -1.5),
    ];
    let mut tokens: Vec<String> = specials.iter().map(|(t, _)| t.to_string()).collect();
    let mut types: Vec<i32> = specials.iter().map(|(_, ty)| *ty).collect();
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    types.extend([6; 256]);
    tokens.extend(pieces.iter().map(|(t, _)| t.to_string()));
    types.extend(vec![1; pieces.len()]);
    let mut scores = vec![0.0f32; tokens.len() - pieces.len()];
    scores.extend(pieces.iter().map(|(_, s)| *s));
    open(&write_gguf(
        name,
        vec![
            ("tokenizer.ggml.model", Value::Str("llama")),
            ("tokenizer.ggml.tokens", Value::StrArray(tokens)),
            ("tokenizer.ggml.token_type", Value::I32Array(types)),
            ("tokenizer.ggml.scores", Value::F32Array(scores)),
            ("tokenizer.ggml.bos_token_id", Value::U32(2)),
            ("tokenizer.ggml.eos_token_id", Value::U32(1)),
            ("tokenizer.ggml.unknown_token_id", Value::U32(3)),
            (
                "tokenizer.ggml.add_space_prefix",
                Value::Bool(add_space_prefix),
            ),
        ]
        .into_iter()
        .chain(extra)
        .collect(),
    ))
}

/// A `tokenizer.*` key the tokenizer does not implement is refused by name; keys known to
/// change nothing (padding id, `add_eos_token: false`) load.
#[test]
fn unknown_tokenizer_keys_are_refused_by_name() {
    let ok = spm_gguf_with(
        "keys-ok",
        false,
        vec![
            ("tokenizer.ggml.padding_token_id", Value::U32(0)),
            ("tokenizer.ggml.add_eos_token", Value::Bool(false)),
            (
                "tokenizer.chat_template.tool_use",
                Value::Str("{{ messages }}"),
            ),
        ],
    );
    Tokenizer::from_gguf(&ok).unwrap();
    for (key, value) in [
        ("tokenizer.ggml.add_eos_token", Value::Bool(true)),
        ("tokenizer.ggml.precompiled_charsmap", Value::Str("x")),
    ] {
        let f = spm_gguf_with("keys-bad", false, vec![(key, value)]);
        let err = Tokenizer::from_gguf(&f).unwrap_err().to_string();
        assert!(err.contains(key), "{err}");
    }
}

fn pieces(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&id| tok.token_text(id).unwrap().to_string())
        .collect()
}

#[test]
fn sentencepiece_merges_by_score_with_space_prefix() {
    let tok = Tokenizer::from_gguf(&spm_gguf("spm-prefix", true)).unwrap();
    assert_eq!(tok.kind(), TokenizerKind::SentencePiece);
    let ids = tok.encode("hello world", false);
    assert_eq!(pieces(&tok, &ids), ["▁hello", "▁world"]);
    assert_eq!(
        tok.decode(&ids),
        "hello world",
        "the added prefix space is removed again"
    );
    // A space prefix is also added after a special token, as llama.cpp does.
    let ids = tok.encode("<start_of_turn>hello", true);
    assert_eq!(pieces(&tok, &ids), ["<start_of_turn>", "▁hello"]);
    assert!(tok.add_bos());
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(tok.eog_ids(), &[1, 5], "<eos> and <end_of_turn>");
}

#[test]
fn sentencepiece_without_prefix_and_byte_fallback() {
    let tok = Tokenizer::from_gguf(&spm_gguf("spm-plain", false)).unwrap();
    let ids = tok.encode("hello world", false);
    assert_eq!(pieces(&tok, &ids), ["hello", "▁world"]);
    let ids = tok.encode("hé<b>", false);
    assert_eq!(
        pieces(&tok, &ids),
        ["h", "<0xC3>", "<0xA9>", "<b>"],
        "user-defined <b> always matches"
    );
    assert_eq!(tok.decode(&ids), "hé<b>");
    assert_eq!(tok.token_bytes(tok.token_id("<0x0A>").unwrap()), b"\n");
}

/// Without a template, a vocabulary with Gemma's turn markers gets Gemma's turn format,
/// with the GGUF's BOS text.
#[test]
fn template_fallback_follows_the_vocabulary_and_uses_gguf_bos() {
    let f = spm_gguf("spm-template", false);
    let template = ChatTemplate::from_gguf(&f).unwrap();
    let out = template
        .render(&[ChatMessage::new("user", "hi")], true)
        .unwrap();
    assert_eq!(
        out,
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    );
    let gemma_like = ChatTemplate::new(
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
        "<bos>",
        "<eos>",
    )
    .unwrap();
    assert_eq!(
        gemma_like
            .render(&[ChatMessage::new("user", "x")], false)
            .unwrap(),
        "<bos>x<eos>"
    );
}

#[test]
fn unsupported_model_is_named_in_the_error() {
    let f = open(&write_gguf(
        "bert",
        vec![
            ("tokenizer.ggml.model", Value::Str("bert")),
            (
                "tokenizer.ggml.tokens",
                Value::StrArray(vec!["[CLS]".into()]),
            ),
        ],
    ));
    let err = Tokenizer::from_gguf(&f).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::UnsupportedModel { model } if model == "bert"),
        "{err}"
    );
    assert!(err.to_string().contains("\"bert\""), "{err}");
}

#[test]
fn inconsistent_metadata_is_an_error() {
    let missing_merges = open(&write_gguf(
        "no-merges",
        vec![
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            ("tokenizer.ggml.pre", Value::Str("gpt-2")),
            ("tokenizer.ggml.tokens", Value::StrArray(vec!["a".into()])),
            ("tokenizer.ggml.eos_token_id", Value::U32(0)),
        ],
    ));
    let err = Tokenizer::from_gguf(&missing_merges).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");

    let short_types = open(&write_gguf(
        "short-types",
        vec![
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            (
                "tokenizer.ggml.tokens",
                Value::StrArray(vec!["a".into(), "b".into()]),
            ),
            ("tokenizer.ggml.token_type", Value::I32Array(vec![1])),
            ("tokenizer.ggml.merges", Value::StrArray(vec![])),
            ("tokenizer.ggml.eos_token_id", Value::U32(0)),
        ],
    ));
    let err = Tokenizer::from_gguf(&short_types).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::InvalidMetadata {
                key: "tokenizer.ggml.token_type",
                ..
            }
        ),
        "{err}"
    );

    // No EOS key, and llama.cpp's default (11) is outside this two-token vocabulary.
    let no_eos = open(&write_gguf(
        "no-eos",
        vec![
            ("tokenizer.ggml.model", Value::Str("gpt2")),
            (
                "tokenizer.ggml.tokens",
                Value::StrArray(vec!["a".into(), "b".into()]),
            ),
            ("tokenizer.ggml.merges", Value::StrArray(vec!["a b".into()])),
        ],
    ));
    let err = Tokenizer::from_gguf(&no_eos).unwrap_err();
    assert!(err.to_string().contains("eos_token_id"), "{err}");
}

/// A byte-level BPE vocabulary of three tokens with `tokenizer.ggml.pre` set to `pre`
/// (absent for `None`).
fn bpe_gguf(name: &str, pre: Option<&'static str>) -> GgufFile {
    let mut kvs = vec![
        ("tokenizer.ggml.model", Value::Str("gpt2")),
        (
            "tokenizer.ggml.tokens",
            Value::StrArray(vec!["a".into(), "b".into(), "ab".into()]),
        ),
        ("tokenizer.ggml.merges", Value::StrArray(vec!["a b".into()])),
        ("tokenizer.ggml.eos_token_id", Value::U32(0)),
    ];
    kvs.extend(pre.map(|p| ("tokenizer.ggml.pre", Value::Str(p))));
    open(&write_gguf(name, kvs))
}

/// A pre-tokenizer whose splitting llama.cpp does differently from every one we implement
/// (or one it does not know) is refused with the key and the value, and so is a missing
/// key, for which llama.cpp would use its own "default" split.
#[test]
fn pre_tokenizers_we_do_not_implement_are_refused_by_name() {
    let tok = Tokenizer::from_gguf(&bpe_gguf("pre-gpt-2", Some("gpt-2"))).unwrap();
    assert_eq!(tok.encode("ab", false), [2]);
    for pre in ["tekken", "default", "smaug-bpe", "gpt-4o", "something-new"] {
        let err = Tokenizer::from_gguf(&bpe_gguf("pre-bad", Some(pre))).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::UnrecognizedKey { key, why }
                if key == "tokenizer.ggml.pre" && *why == format!(" = {pre:?}")),
            "{pre}: {err:?}"
        );
        assert!(err
            .to_string()
            .contains(&format!("\"tokenizer.ggml.pre\" = \"{pre}\"")));
    }
    let err = Tokenizer::from_gguf(&bpe_gguf("pre-missing", None)).unwrap_err();
    assert!(
        matches!(
            &err,
            TokenizerError::InvalidMetadata {
                key: "tokenizer.ggml.pre",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("missing"), "{err}");
}
