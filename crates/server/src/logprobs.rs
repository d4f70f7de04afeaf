//! Log-probabilities in OpenAI's two shapes: chat's `{"content": [{token, logprob, bytes,
//! top_logprobs}]}` and the legacy completions' parallel lists (`tokens`,
//! `token_logprobs`, `top_logprobs` as token → logprob maps, `text_offset`).
//!
//! A token's text is its raw bytes read as UTF-8 with invalid sequences replaced (a token
//! may hold part of a character); `bytes` carries the exact bytes, as OpenAI's does.

use pk_engine::TokenLogprob;
use pk_tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

fn token_str(tokenizer: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(tokenizer.token_bytes(id)).into_owned()
}

fn entry(tokenizer: &Tokenizer, id: u32, logprob: f32) -> Value {
    json!({
        "token": token_str(tokenizer, id),
        "logprob": logprob,
        "bytes": tokenizer.token_bytes(id),
    })
}

/// Chat completions' `logprobs` object for these tokens.
pub fn chat(tokenizer: &Tokenizer, tokens: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(tokenizer, t.id, t.logprob);
            e["top_logprobs"] = t
                .top
                .iter()
                .map(|&(id, lp)| entry(tokenizer, id, lp))
                .collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs` object for these tokens, the first of which starts at byte
/// `text_offset` of the choice's text.
pub fn completion(tokenizer: &Tokenizer, tokens: &[TokenLogprob], text_offset: usize) -> Value {
    let mut offset = text_offset;
    let mut offsets = Vec::with_capacity(tokens.len());
    for t in tokens {
        offsets.push(offset);
        offset += token_str(tokenizer, t.id).len();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut m = Map::new();
            for &(id, lp) in &t.top {
                // Two ids with the same text (rare) keep the likelier, which comes first.
                m.entry(token_str(tokenizer, id)).or_insert(json!(lp));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| token_str(tokenizer, t.id)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// Byte length of the tokens' texts as `completion` counts them, for the next chunk's
/// `text_offset`.
pub fn text_len(tokenizer: &Tokenizer, tokens: &[TokenLogprob]) -> usize {
    tokens
        .iter()
        .map(|t| token_str(tokenizer, t.id).len())
        .sum()
}
