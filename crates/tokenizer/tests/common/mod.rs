//! Shared helpers for the integration tests: the model file and the golden fixtures.
//!
//! The model is not in the repository. Tests that need it fail (rather than skip) when it
//! is missing, because CI fetches it before running tests and a silent skip would hide a
//! broken setup.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use pk_gguf::GgufFile;
use pk_tokenizer::Tokenizer;

pub const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const BOOK: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/around-the-world-in-80-days.txt"
);
pub const BOOK_IDS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/eighty-days-token-ids.json"
);
pub const GREEDY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/smollm2-greedy.json"
);

/// `$PAGEKEEPER_HOME/SmolLM2-135M-Instruct.Q4_1.gguf`, with `PAGEKEEPER_HOME` defaulting to
/// `~/.cache/pagekeeper`.
pub fn model_path() -> PathBuf {
    let home = match std::env::var_os("PAGEKEEPER_HOME") {
        Some(dir) => PathBuf::from(dir),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/pagekeeper")
        }
    };
    home.join(MODEL_FILE)
}

/// The opened model file, shared by all tests of one test binary.
pub fn gguf() -> &'static GgufFile {
    static FILE: OnceLock<GgufFile> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = model_path();
        assert!(
            path.exists(),
            "model file {} is missing: run `pagekeeper fetch-model` first (or set PAGEKEEPER_HOME)",
            path.display()
        );
        GgufFile::open(&path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()))
    })
}

pub fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::from_gguf(gguf()).expect("SmolLM2 tokenizer loads"))
}

pub fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read fixture {path}: {e}"))
}

pub fn json(path: &str) -> serde_json::Value {
    serde_json::from_str(&read(path)).unwrap_or_else(|e| panic!("fixture {path} is not JSON: {e}"))
}

/// `(name, prompt, prompt_token_ids)` for each prompt in `smollm2-greedy.json`.
pub fn golden_prompts() -> Vec<(String, String, Vec<u32>)> {
    let fixture = json(GREEDY);
    let prompts = fixture["prompts"]
        .as_array()
        .expect("`prompts` is an array");
    prompts
        .iter()
        .map(|p| {
            let ids = p["prompt_token_ids"]
                .as_array()
                .expect("`prompt_token_ids` is an array");
            (
                p["name"].as_str().expect("`name` is a string").to_string(),
                p["prompt"]
                    .as_str()
                    .expect("`prompt` is a string")
                    .to_string(),
                ids.iter()
                    .map(|v| v.as_u64().expect("ids are integers") as u32)
                    .collect(),
            )
        })
        .collect()
}

/// Asserts equal id sequences; on mismatch reports the first differing index with context.
pub fn assert_same_ids(what: &str, tok: &Tokenizer, got: &[u32], want: &[u32]) {
    let Some(i) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) else {
        return;
    };
    let show = |ids: &[u32]| -> String {
        let lo = i.saturating_sub(8);
        let hi = (i + 8).min(ids.len());
        ids.get(lo..hi)
            .unwrap_or(&[])
            .iter()
            .map(|&id| format!("{id}:{:?}", String::from_utf8_lossy(tok.token_bytes(id))))
            .collect::<Vec<_>>()
            .join(" ")
    };
    panic!(
        "{what}: ids differ first at index {i} (got {} ids, want {})\n  got : {}\n  want: {}",
        got.len(),
        want.len(),
        show(got),
        show(want)
    );
}
