//! Long-context prefill attention at Qwen2.5-Coder-1.5B's shape (12 query heads, 2 KV
//! heads, head_dim 128, 16-token blocks, f16 K/V): the last 512 tokens of a 4K / 8K / 16K
//! context against everything before them, per layer, with each kernel this CPU runs. The
//! figure beside each time is the kernel's rate in multiply-adds of q·k and p·v per second
//! (the causal half counted once), to hold against the core's FMA peak.
//!
//! Run: `cargo run --release -p pk-model --example attn_long_bench [-- --threads N]`.

mod common;
use common::best_of;
use std::time::Duration;

use clap::Parser;
use pk_model::attention::{paged_attention_with, AttnSeq, AttnShape, Kernel};
use pk_model::{KvDtype, KvGeometry, KvStore};
use rand::{Rng, SeedableRng};

/// Long-context prefill attention at Qwen2.5-Coder-1.5B's shape, per kernel.
#[derive(Parser)]
#[command(name = "attn_long_bench")]
struct Args {
    /// Threads of rayon's pool, which the attention kernel runs on.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() {
    let threads = Args::parse().threads;
    common::build_rayon_pool(threads);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let (n_heads, n_kv, hd, bs, n_q) = (12usize, 2usize, 128usize, 16usize, 512usize);
    let shape = AttnShape {
        n_heads,
        n_kv_heads: n_kv,
        head_dim: hd,
    };
    // The AVX2 kernel runs on every x86 host these benchmarks meet; the AVX-512 one where
    // it is the best. The portable kernel is too slow to be the point at these lengths.
    let mut kernels = vec![Kernel::Avx2];
    if Kernel::best(hd) == Kernel::Avx512 {
        kernels.push(Kernel::Avx512);
    }
    println!(
        "threads {threads}; best kernel {:?}; times per layer",
        Kernel::best(hd)
    );
    for ctx in [4096usize, 8192, 16384] {
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: n_kv,
            head_dim: hd,
            block_size_tokens: bs,
            num_blocks: ctx / bs,
        };
        let table: Vec<u32> = (0..(ctx / bs) as u32).rev().collect();
        let mut store = KvStore::new(g, KvDtype::F16);
        for t in 0..ctx {
            let k: Vec<f32> = (0..n_kv * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let v: Vec<f32> = (0..n_kv * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
            store.write_token(0, table[t / bs], t % bs, &k, &v);
        }
        let q: Vec<f32> = (0..n_q * n_heads * hd)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let mut out = vec![0f32; q.len()];
        let seq = AttnSeq {
            block_table: &table,
            stored_start: ctx - n_q,
            n_queries: n_q,
            row_offset: 0,
            head_first_keys: &[],
        };
        // Visible keys summed over the 512 queries, times heads, times q·k and p·v.
        let keys: usize = (0..n_q).map(|i| ctx - n_q + i + 1).sum();
        let macs = (keys * n_heads * hd * 2) as f64;
        for &kernel in &kernels {
            let t = best_of(Duration::from_millis(1500), || {
                paged_attention_with(kernel, &store, 0, shape, &[seq], &q, &mut out)
            });
            println!(
                "ctx {ctx:>6} queries {n_q} {kernel:?}: {:>9.1} ms per layer, {:>6.1} GMAC/s",
                t.as_secs_f64() * 1e3,
                macs / t.as_secs_f64() / 1e9
            );
        }
    }
}
