//! Perplexity by llama.cpp's method on the Verne text.
//!
//! llama.cpp b4748's reference values (277.5967 at n_ctx 512 over 20 chunks, 321.8246 at
//! 2048 over 51) cannot be reproduced by a correct forward pass of this GGUF: an
//! independent numpy f32 implementation (weights dequantised by the `gguf` Python package,
//! no code shared with ours) gives 22.71 on the first 512-token chunk, where we give 22.66,
//! and the reference gets worse with more context, which a working model does not (see
//! crates/model/tests/golden_logits.rs for the evidence). So these tests hold our values
//! to the independent implementation on chunk 0, and to our own measured values over
//! more chunks (a regression bound), and record llama.cpp's for comparison.

mod common;

use pk_engine::perplexity::perplexity;
use pk_engine::EngineConfig;

/// llama.cpp's values, kept for the record and printed beside ours.
const LLAMA_CPP_PPL_512_20: f64 = 277.5967;
const LLAMA_CPP_PPL_2048_ALL: f64 = 321.8246;

fn ppl(n_ctx: usize, chunks: Option<usize>) -> f64 {
    let mut engine = common::engine(EngineConfig { kv_capacity_tokens: Some(n_ctx), ..Default::default() });
    let ids = common::book_ids();
    let r = perplexity(&mut engine, &ids, n_ctx, chunks, &mut |_, _| {}).unwrap();
    engine.check_invariants();
    r.ppl
}

fn assert_within(got: f64, want: f64, rel: f64, what: &str) {
    assert!((got - want).abs() / want < rel, "{what}: PPL {got:.4}, expected {want} within {:.1}%", rel * 100.0);
}

#[test]
fn ppl_512_chunk0_matches_independent_reference() {
    // The numpy reference scored tokens 256..512 of the chunk (each from all tokens before
    // it), one more than llama.cpp's method; score exactly those here.
    let mut engine = common::engine(EngineConfig { kv_capacity_tokens: Some(512), ..Default::default() });
    let ids = common::book_ids();
    let chunk = &ids[..512];
    let vocab = engine.model_config().vocab_size;
    let logits = engine.score(chunk, 255).unwrap();
    let nll: f64 = (256..512).map(|t| -pk_engine::sampler::log_prob(&logits[(t - 256) * vocab..(t - 255) * vocab], chunk[t])).sum();
    assert_within((nll / 256.0).exp(), 22.71, 0.01, "n_ctx 512, chunk 0 vs numpy f32 reference");
}

#[test]
fn ppl_512_first_20_chunks() {
    let got = ppl(512, Some(20));
    eprintln!("n_ctx 512 x 20: PPL {got:.4} (llama.cpp b4748: {LLAMA_CPP_PPL_512_20})");
    assert_within(got, 19.80, 0.01, "n_ctx 512 over 20 chunks");
}

#[test]
fn ppl_2048_first_4_chunks() {
    let got = ppl(2048, Some(4));
    eprintln!("n_ctx 2048 x 4: PPL {got:.4} (llama.cpp b4748 over all 51: {LLAMA_CPP_PPL_2048_ALL})");
    // Longer context must help a working model: lower than the 512-token value.
    assert!(got < 19.80, "PPL at 2048 ({got:.4}) is not below PPL at 512");
    assert!(got > 5.0, "PPL at 2048 ({got:.4}) is implausibly low: a causality leak?");
}
