//! The bulk token-range operations of `KvBlocks` on the CPU store against the per-token
//! and per-row loops the engine used before them, side by side in one process:
//!
//! - write: a tier chunk restored with one `write_token` per (token, layer) — the tiering
//!   path before `write_tokens` — vs `write_tokens` (one run of rows per layer, KV head and
//!   block);
//! - read: a context read out token by token through a one-block cache per (side, layer,
//!   KV head) — the `StoreView` loop before `read_tokens` — vs `read_tokens`.
//!
//!   cargo run --release -p pk-model --example bulk_kv_bench
//!
//! Shape: the default model's KV (30 layers, 3 KV heads, head_dim 64, blocks of 16), f16
//! store, ranges of 256 tokens (a tier chunk) and 1,536 tokens (a stored context).

use std::time::Instant;

use clap::Parser;
use pk_model::{KvBlocks, KvDtype, KvGeometry, KvStore};

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(|a, b| a.total_cmp(b));
    x[x.len() / 2]
}

/// The CPU store's bulk token-range writes and reads against per-token loops; no arguments.
#[derive(Parser)]
#[command(name = "bulk_kv_bench")]
struct Args {}

fn main() {
    Args::parse();
    let quiet = std::process::Command::new("../shared/tools/host-quiet")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!("host-quiet: {quiet}");
    let (n_layers, n_kv_heads, hd, bs) = (30, 3, 64, 16);
    for n in [256usize, 1536] {
        let g = KvGeometry {
            n_layers,
            n_kv_heads,
            head_dim: hd,
            block_size_tokens: bs,
            num_blocks: n / bs + 4,
        };
        let table: Vec<u32> = (0..n / bs).map(|b| (n / bs + 3 - b) as u32).collect();
        let len = n_layers * n_kv_heads * n * hd;
        let k: Vec<f32> = (0..len)
            .map(|i| ((i * 7919 % 2003) as f32 - 1000.0) / 256.0)
            .collect();
        let v: Vec<f32> = (0..len)
            .map(|i| ((i * 104_729 % 1999) as f32 - 1000.0) / 512.0)
            .collect();
        let mut store = KvStore::new(g, KvDtype::F16);
        let kvd = n_kv_heads * hd;
        let (mut old_w, mut new_w, mut old_r, mut new_r) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut kb, mut vb) = (vec![0f32; len], vec![0f32; len]);
        let (mut k2, mut v2) = (vec![0f32; len], vec![0f32; len]);
        for _ in 0..15 {
            let t = Instant::now();
            let (mut kt, mut vt) = (vec![0f32; kvd], vec![0f32; kvd]);
            for tok in 0..n {
                for layer in 0..n_layers {
                    for h in 0..n_kv_heads {
                        let at = ((layer * n_kv_heads + h) * n + tok) * hd;
                        kt[h * hd..(h + 1) * hd].copy_from_slice(&k[at..at + hd]);
                        vt[h * hd..(h + 1) * hd].copy_from_slice(&v[at..at + hd]);
                    }
                    store.write_token(layer, table[tok / bs], tok % bs, &kt, &vt);
                }
            }
            old_w.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            KvBlocks::write_tokens(&mut store, &table, 0, &k, &v);
            new_w.push(t.elapsed().as_secs_f64());

            let t = Instant::now();
            KvBlocks::read_tokens(&store, &table, 0, &mut kb, &mut vb).unwrap();
            new_r.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let mut cache: Vec<(Option<u32>, Vec<f32>)> =
                vec![(None, vec![0f32; bs * hd]); 2 * n_layers * n_kv_heads];
            for layer in 0..n_layers {
                for h in 0..n_kv_heads {
                    for tok in 0..n {
                        let at = ((layer * n_kv_heads + h) * n + tok) * hd;
                        let block = table[tok / bs];
                        for (side, out) in [(0usize, &mut k2), (1, &mut v2)] {
                            let e = &mut cache[(side * n_layers + layer) * n_kv_heads + h];
                            if e.0 != Some(block) {
                                if side == 0 {
                                    store.read_k(layer, block, h, &mut e.1);
                                } else {
                                    store.read_v(layer, block, h, &mut e.1);
                                }
                                e.0 = Some(block);
                            }
                            out[at..at + hd]
                                .copy_from_slice(&e.1[(tok % bs) * hd..(tok % bs + 1) * hd]);
                        }
                    }
                }
            }
            old_r.push(t.elapsed().as_secs_f64());
        }
        assert!(kb == k2 && vb == v2, "the two reads differ");
        let (ow, nw, or, nr) = (median(old_w), median(new_w), median(old_r), median(new_r));
        let mb = (4 * len) as f64 / 1e6; // f16 K and V
        println!(
            "{n} tokens ({mb:.1} MB f16): write per-token {:.2} ms | write_tokens {:.2} ms | {:.2}×   read per-token {:.2} ms | read_tokens {:.2} ms | {:.2}×",
            ow * 1e3, nw * 1e3, ow / nw, or * 1e3, nr * 1e3, or / nr
        );
    }
}
