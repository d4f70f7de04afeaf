//! Perplexity by llama.cpp's method on the Verne text against llama.cpp's reference.

mod common;

use pk_engine::perplexity::perplexity;
use pk_engine::EngineConfig;

fn check(n_ctx: usize, chunks: Option<usize>, want: f64) {
    let mut engine = common::engine(EngineConfig { kv_capacity_tokens: Some(n_ctx), ..Default::default() });
    let ids = common::book_ids();
    let r = perplexity(&mut engine, &ids, n_ctx, chunks, &mut |_, _| {}).unwrap();
    let rel = (r.ppl - want).abs() / want;
    eprintln!("n_ctx {n_ctx}: PPL {:.4} vs llama.cpp {want} ({:.2}%)", r.ppl, rel * 100.0);
    assert!(rel < 0.01, "n_ctx {n_ctx}: PPL {:.4} is not within 1% of llama.cpp's {want}", r.ppl);
    engine.check_invariants();
}

#[test]
fn ppl_512_first_20_chunks() {
    check(512, Some(20), 277.5967);
}

#[test]
fn ppl_2048_all_chunks() {
    check(2048, None, 321.8246);
}
