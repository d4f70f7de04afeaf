//! Paged attention speed per live KV dtype (f16, f32, q8, q4) at SmolLM2-135M's shape
//! (9 query heads, 3 KV heads, head_dim 64, 16-token blocks): one decode query at the end
//! of the context, and a prefill of the last 512 tokens, per layer, with the best kernel
//! this CPU runs. Blocks are scattered (reversed table), as after a while of serving.
//!
//! Run: `cargo run --release -p pk-model --example attn_dtype_bench [-- --threads N]`.

mod common;
use common::best_of;
use std::time::Duration;

use clap::Parser;
use pk_model::attention::{paged_attention, AttnSeq, AttnShape};
use pk_model::{KvDtype, KvGeometry, KvStore};
use rand::{Rng, SeedableRng};

/// Paged attention speed per live KV dtype at SmolLM2-135M's shape.
#[derive(Parser)]
#[command(name = "attn_dtype_bench")]
struct Args {
    /// Threads of rayon's pool, which the attention kernel runs on.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() {
    let threads = Args::parse().threads;
    common::build_rayon_pool(threads);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let shape = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let bs = 16;
    println!(
        "threads {threads}; kernel {:?}; times are per layer",
        pk_model::attention::Kernel::best(64)
    );
    println!(
        "{:<6} {:>7} {:>16} {:>18} {:>18}",
        "dtype", "context", "KV bytes/token", "decode 1 query us", "prefill 512 q us"
    );
    for ctx in [512usize, 2048, 8192] {
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: 3,
            head_dim: 64,
            block_size_tokens: bs,
            num_blocks: ctx / bs,
        };
        let table: Vec<u32> = (0..(ctx / bs) as u32).rev().collect();
        let tokens: Vec<(Vec<f32>, Vec<f32>)> = (0..ctx)
            .map(|_| {
                (
                    (0..192).map(|_| rng.gen_range(-1.0..1.0)).collect(),
                    (0..192).map(|_| rng.gen_range(-1.0..1.0)).collect(),
                )
            })
            .collect();
        for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Q8, KvDtype::Q4] {
            let mut store = KvStore::new(g, dtype);
            for (t, (k, v)) in tokens.iter().enumerate() {
                store.write_token(0, table[t / bs], t % bs, k, v);
            }
            let mut times = Vec::new();
            for n_q in [1usize, 512] {
                let q: Vec<f32> = (0..n_q * 576).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let mut out = vec![0f32; q.len()];
                let seq = AttnSeq {
                    block_table: &table,
                    stored_start: ctx - n_q,
                    n_queries: n_q,
                    row_offset: 0,
                    head_first_keys: &[],
                };
                let t = best_of(Duration::from_millis(300), || {
                    paged_attention(&store, 0, shape, &[seq], &q, &mut out)
                });
                times.push(t.as_secs_f64() * 1e6);
            }
            println!(
                "{:<6} {ctx:>7} {:>16} {:>18.1} {:>18.1}",
                dtype.to_string(),
                g.bytes_per_token(dtype) * 30,
                times[0],
                times[1]
            );
        }
    }
}
