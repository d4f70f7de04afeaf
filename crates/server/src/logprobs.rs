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

/// vLLM's `prompt_logprobs`: per prompt token, `null` for the first (nothing predicts it),
/// else a map from token id (as a string key) to `{logprob, rank, decoded_token}` holding
/// the prompt's own token and the most likely alternatives (ranks 1, 2, …).
pub fn prompt(tokenizer: &Tokenizer, tokens: &[Option<TokenLogprob>]) -> Value {
    let entry = |id: u32, logprob: f32, rank: u32| json!({"logprob": logprob, "rank": rank, "decoded_token": token_str(tokenizer, id)});
    tokens
        .iter()
        .map(|t| match t {
            None => Value::Null,
            Some(t) => {
                let mut m = Map::new();
                m.insert(t.id.to_string(), entry(t.id, t.logprob, t.rank));
                for (i, &(id, lp)) in t.top.iter().enumerate() {
                    m.entry(id.to_string())
                        .or_insert_with(|| entry(id, lp, i as u32 + 1));
                }
                Value::Object(m)
            }
        })
        .collect()
}
