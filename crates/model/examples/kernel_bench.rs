//! Micro-benchmark of the hot kernels at SmolLM2-135M's shapes: quantised matmul (GFLOP/s,
//! counting a multiply-add as 2 flops) for decode (1 token) and prefill (512 tokens), and
//! paged attention over 512 / 2048 tokens of context (prefill of the whole context, and one
//! decode query at its end).
//!
//! Run: `cargo run --release -p pk-model --example kernel_bench [-- --threads N]`.
//! Weights are random but valid; the speed of these kernels does not depend on the values.

mod common;
use common::best_of;
use std::time::Duration;

use clap::Parser;
use pk_gguf::GgmlType;
use pk_model::attention::{paged_attention, AttnSeq, AttnShape};
use pk_model::kernels::{matmul, place_in_arena, QMatrix};
use pk_model::{KvDtype, KvGeometry, KvStore};
use rand::{Rng, SeedableRng};

fn random_matrix(rng: &mut impl Rng, ty: GgmlType, rows: usize, cols: usize) -> QMatrix {
    let mut data = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
    rng.fill(&mut data[..]);
    for blk in data.chunks_exact_mut(ty.block_bytes()) {
        blk[0..2].copy_from_slice(&half::f16::from_f32(rng.gen_range(0.001..0.01)).to_le_bytes());
        if ty == GgmlType::Q4_1 {
            blk[2..4]
                .copy_from_slice(&half::f16::from_f32(rng.gen_range(-0.01..0.0)).to_le_bytes());
        }
    }
    QMatrix::new(ty, rows, cols, data)
}

/// Micro-benchmark of the hot kernels (quantised matmul, paged attention) at SmolLM2-135M's
/// shapes.
#[derive(Parser)]
#[command(name = "kernel_bench")]
struct Args {
    /// Threads of rayon's pool, which the kernels run on.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Keep the decode stream's matrices on 4 KiB pages, not huge ones, to see the TLB's cost.
    #[arg(long)]
    small_pages: bool,
    /// Stop after the decode stream (all matmuls of one token); skip attention.
    #[arg(long)]
    stream_only: bool,
}

fn main() {
    let args = Args::parse();
    let threads = args.threads;
    common::build_rayon_pool(threads);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    println!("threads {threads}");
    let shapes = [
        ("q/o 576->576", GgmlType::Q4_1, 576, 576),
        ("k/v 576->192", GgmlType::Q4_1, 192, 576),
        ("gate/up 576->1536", GgmlType::Q4_1, 1536, 576),
        ("down 1536->576", GgmlType::Q4_1, 576, 1536),
        ("head 576->49152", GgmlType::Q8_0, 49152, 576),
    ];
    for (name, ty, rows, cols) in shapes {
        let w = random_matrix(&mut rng, ty, rows, cols);
        for n in [1usize, 512] {
            if rows > 10_000 && n > 64 {
                continue;
            }
            let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut out = vec![0f32; n * rows];
            let t = best_of(Duration::from_millis(300), || matmul(&w, &x, n, &mut out));
            let gflops = 2.0 * (rows * cols * n) as f64 / t.as_secs_f64() / 1e9;
            println!(
                "matmul {name:<18} {ty:?} n={n:<4} {:>9.1} us {gflops:>7.1} GFLOP/s",
                t.as_secs_f64() * 1e6
            );
        }
    }
    // One decode token's matmuls over the whole model: 30 layers of 7 Q4_1 matrices plus the
    // Q8_0 head (96.6 MB), far more than the 32 MB L3, so this streams weights from DRAM as
    // real decode does (the per-shape numbers above run from cache).
    let layer_shapes = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let mut mats: Vec<QMatrix> = Vec::new();
    for _ in 0..30 {
        for (rows, cols) in layer_shapes {
            mats.push(random_matrix(&mut rng, GgmlType::Q4_1, rows, cols));
        }
    }
    mats.push(random_matrix(&mut rng, GgmlType::Q8_0, 49152, 576));
    if !args.small_pages {
        place_in_arena(&mut mats.iter_mut().collect::<Vec<_>>());
    }
    let bytes: usize = mats.iter().map(|m| m.rows * m.row_bytes()).sum();
    let xs: Vec<Vec<f32>> = mats
        .iter()
        .map(|m| (0..m.cols).map(|_| rng.gen_range(-1.0..1.0)).collect())
        .collect();
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; m.rows]).collect();
    let t = best_of(Duration::from_millis(1500), || {
        for ((m, x), o) in mats.iter().zip(&xs).zip(outs.iter_mut()) {
            matmul(m, x, 1, o);
        }
    });
    println!(
        "decode stream: all matmuls of one token ({:.1} MB) {:>8.0} us {:>6.1} GB/s",
        bytes as f64 / 1e6,
        t.as_secs_f64() * 1e6,
        bytes as f64 / t.as_secs_f64() / 1e9
    );
    let head = mats.last().unwrap();
    let (hx, ho) = (&xs[xs.len() - 1], outs.last_mut().unwrap());
    let t = best_of(Duration::from_millis(300), || matmul(head, hx, 1, ho));
    println!(
        "decode stream: head alone (from L3) {:>8.0} us",
        t.as_secs_f64() * 1e6
    );
    if args.stream_only {
        return;
    }

    // SmolLM2-135M attention: 9 query heads, 3 KV heads, head_dim 64, 16-token blocks, f16.
    let shape = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    for ctx in [512usize, 2048] {
        let bs = 16;
        let g = KvGeometry {
            n_layers: 1,
            n_kv_heads: 3,
            head_dim: 64,
            block_size_tokens: bs,
            num_blocks: ctx / bs,
        };
        let mut store = KvStore::new(g, KvDtype::F16);
        let table: Vec<u32> = (0..(ctx / bs) as u32).collect();
        for t in 0..ctx {
            let k: Vec<f32> = (0..192).map(|_| rng.gen_range(-1.0..1.0)).collect();
            store.write_token(0, table[t / bs], t % bs, &k, &k);
        }
        for n_q in [ctx, 1] {
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
            println!(
                "attention ctx={ctx:<5} queries={n_q:<5} {:>10.1} us per layer",
                t.as_secs_f64() * 1e6
            );
        }
    }
}
