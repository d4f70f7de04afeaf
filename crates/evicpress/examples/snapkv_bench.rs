//! What a stored context's SnapKV scores cost the store's worker: `snapkv_scores` over a
//! context of SmolLM2-135M's shape (30 layers, 3 KV heads, 9 query heads, head_dim 64) with
//! a 64-query window, random values (the cost does not depend on them).
//!
//! Run: `cargo run --release -p pk-evicpress --example snapkv_bench [-- TOKENS...]`
//! (default 1024 1536 4096).

use std::time::Instant;

use clap::Parser;
use pk_codec::KvContext;
use pk_evicpress::{snapkv_scores, WindowQueries};

/// What a stored context's SnapKV scores cost, at SmolLM2-135M's shape.
#[derive(Parser)]
#[command(name = "snapkv_bench")]
struct Args {
    /// Context lengths in tokens, each timed in turn.
    #[arg(value_name = "TOKENS", default_values_t = [1024, 1536, 4096])]
    lengths: Vec<usize>,
}

fn main() {
    let lengths = Args::parse().lengths;
    let (layers, kv_heads, heads, d, window) = (30, 3, 9, 64, 64);
    let value = |i: usize| ((i.wrapping_mul(2654435761) >> 7) % 2000) as f32 / 1000.0 - 1.0;
    for n in lengths {
        let len = layers * kv_heads * n * d;
        let ctx = KvContext::new(
            layers,
            kv_heads,
            d,
            (0..n as u32).collect(),
            (0..len).map(value).collect(),
            (0..len).map(|i| value(i + 1)).collect(),
        )
        .unwrap();
        let queries = WindowQueries {
            n_heads: heads,
            positions: (n - window..n).collect(),
            data: (0..layers * window * heads * d)
                .map(|i| value(i + 7))
                .collect(),
        };
        let t = Instant::now();
        let scores = snapkv_scores(&ctx, &queries).unwrap();
        let s = t.elapsed().as_secs_f64();
        println!(
            "{n} tokens: SnapKV scores in {:.2} s ({:.0} µs per token), {} scores",
            s,
            s * 1e6 / n as f64,
            scores.len()
        );
    }
}
