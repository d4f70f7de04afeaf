//! Bulk KV transfers on a GPU: a restored context into the device pool and a stored one out
//! of it, through `transfer.rs` (pinned staging, the copy stream, one scatter or gather
//! launch per piece) against the per-block path the backend used before (one pageable copy
//! per layer, KV head, block and side, each download waited for), side by side, with a
//! plain pinned copy of the same bytes as the link's bound.
//!
//!   cargo run --release -p pk-cuda --example transfer_bench [-- --repeats 5]
//!
//! Shapes: the default model restoring a 1,536-token context (EVICPRESS's contexts), and
//! Llama-3.1-8B's KV shape at 4,096 tokens. Prints one line per shape and direction with
//! GB/s of f16 KV moved, the ratio to the per-block path, and for writes the time until
//! the call returns (the host is free from then on) beside the time until the data is in
//! the pool. First, on any machine, the staged path's host side alone (packing and
//! unpacking every piece, no device); the rest skips (exit 0) without a GPU.

use std::time::Instant;

use clap::Parser;
use half::f16;
use half::slice::HalfFloatSliceExt;
use pk_cuda::kv_pool::Side;
use pk_cuda::transfer::{pack_piece, plan_pieces, unpack_piece, Transfers, DEFAULT_STAGING_BYTES};
use pk_cuda::{cuda_or_skip, ActDtype, Gpu, GpuKvPool};
use pk_model::{block_runs, KvGeometry};

/// The backend's former path: f32 → f16 on the host, one pageable upload per run of rows.
fn write_per_block(gpu: &Gpu, pool: &mut GpuKvPool, table: &[u32], n: usize, k: &[f32], v: &[f32]) {
    let g = pool.geometry;
    let hd = g.head_dim;
    let mut scratch: Vec<f16> = Vec::new();
    for lh in 0..g.n_layers * g.n_kv_heads {
        let (layer, h) = (lh / g.n_kv_heads, lh % g.n_kv_heads);
        for (t0, t1) in block_runs(0, n, g.block_size_tokens) {
            let at = pool.offset(
                layer,
                table[t0 / g.block_size_tokens],
                h,
                t0 % g.block_size_tokens,
            );
            for (side, src) in [(Side::K, k), (Side::V, v)] {
                let rows = &src[(lh * n + t0) * hd..(lh * n + t1) * hd];
                scratch.clear();
                scratch.resize(rows.len(), f16::ZERO);
                scratch.convert_from_f32_slice(rows);
                pool.upload_at(gpu, side, at, scratch.reinterpret_cast())
                    .unwrap();
            }
        }
    }
    gpu.synchronize().unwrap();
}

/// The former read path: one waited-for download per run of rows.
fn read_per_block(
    gpu: &Gpu,
    pool: &GpuKvPool,
    table: &[u32],
    n: usize,
    k: &mut [f32],
    v: &mut [f32],
) {
    let g = pool.geometry;
    let hd = g.head_dim;
    let mut bits = vec![0u16; g.block_size_tokens * hd];
    for lh in 0..g.n_layers * g.n_kv_heads {
        let (layer, h) = (lh / g.n_kv_heads, lh % g.n_kv_heads);
        for (t0, t1) in block_runs(0, n, g.block_size_tokens) {
            let at = pool.offset(layer, table[t0 / g.block_size_tokens], h, 0);
            for (side, dst) in [(Side::K, &mut *k), (Side::V, &mut *v)] {
                let len = (t1 - t0) * hd;
                pool.download_at(gpu, side, at, &mut bits[..len]).unwrap();
                for (o, &b) in dst[(lh * n + t0) * hd..(lh * n + t1) * hd]
                    .iter_mut()
                    .zip(&bits[..len])
                {
                    *o = f16::from_bits(b).to_f32();
                }
            }
        }
    }
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(|a, b| a.total_cmp(b));
    x[x.len() / 2]
}

/// The two shapes, as (name, layers, KV heads, head_dim, tokens).
const SHAPES: [(&str, usize, usize, usize, usize); 2] = [
    ("smollm2-135m", 30, 3, 64, 1536),
    ("llama-3.1-8b", 32, 8, 128, 4096),
];

/// The staged path's host side alone, no device: every piece of the plan packed (f32 → f16
/// into a staging-sized buffer, on rayon's threads) and unpacked, as
/// `write_tokens`/`read_tokens` do between copies. Its GB/s bound the staged path whatever
/// the link does.
fn host_side_only(repeats: usize) {
    for (name, n_layers, n_kv_heads, head_dim, n_tokens) in SHAPES {
        let g = KvGeometry {
            n_layers,
            n_kv_heads,
            head_dim,
            block_size_tokens: 16,
            num_blocks: n_tokens / 16,
        };
        let len = n_layers * n_kv_heads * n_tokens * head_dim;
        let k: Vec<f32> = (0..len).map(|i| (i % 2003) as f32 / 256.0).collect();
        let v = k.clone();
        let (mut k2, mut v2) = (vec![0f32; len], vec![0f32; len]);
        let cap = DEFAULT_STAGING_BYTES / 2;
        let pieces = plan_pieces(&g, n_tokens, cap);
        let mut staged = vec![f16::ZERO; cap];
        let (mut pack, mut unpack) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            let t = Instant::now();
            for &p in &pieces {
                pack_piece(&g, n_tokens, p, &k, &v, &mut staged);
            }
            pack.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            for &p in &pieces {
                unpack_piece(&g, n_tokens, p, &staged, &mut k2, &mut v2);
            }
            unpack.push(t.elapsed().as_secs_f64());
        }
        let bytes = (4 * len) as f64;
        println!(
            "{name}: host side alone ({} threads, {} pieces): pack f32 → f16 {:.2} GB/s, unpack {:.2} GB/s (of f16 K/V)",
            rayon::current_num_threads(),
            pieces.len(),
            bytes / median(pack) / 1e9,
            bytes / median(unpack) / 1e9
        );
    }
}

/// Bulk KV transfers to and from a GPU's pool: staged against per-block copies.
#[derive(Parser)]
#[command(name = "transfer_bench")]
struct Args {
    /// Timed runs of each path; the median is printed.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

fn main() {
    let repeats = Args::parse().repeats;
    host_side_only(repeats);
    let Some(gpu) = cuda_or_skip(ActDtype::F16) else {
        return;
    };
    println!(
        "GPU: {} | staging {} MiB × 2 | median of {repeats}",
        gpu.name,
        DEFAULT_STAGING_BYTES >> 20
    );
    for (name, n_layers, n_kv_heads, head_dim, n_tokens) in SHAPES {
        let bs = 16;
        let n_blocks = n_tokens / bs;
        // A table in reverse order with gaps, as a pool that has served for a while.
        let g = KvGeometry {
            n_layers,
            n_kv_heads,
            head_dim,
            block_size_tokens: bs,
            num_blocks: 2 * n_blocks + 1,
        };
        let table: Vec<u32> = (0..n_blocks).map(|b| (2 * (n_blocks - b)) as u32).collect();
        let len = n_layers * n_kv_heads * n_tokens * head_dim;
        let k: Vec<f32> = (0..len)
            .map(|i| ((i * 7919 % 2003) as f32 - 1000.0) / 256.0)
            .collect();
        let v: Vec<f32> = (0..len)
            .map(|i| ((i * 104_729 % 1999) as f32 - 1000.0) / 512.0)
            .collect();
        let bytes = (4 * len) as f64; // f16 K and V
        let mut pool = GpuKvPool::new(&gpu, g).unwrap();
        let mut transfers = Transfers::new(&gpu, &g, DEFAULT_STAGING_BYTES).unwrap();

        // The link's bound: one pinned host-to-device and device-to-host copy of the bytes.
        // SAFETY: the pinned buffer is left uninitialised, but the host never reads its values:
        // it is only the source and target of DMA copies (cudarc hands the driver its
        // address), any bits are a valid u16, and only the copies' times are measured.
        let mut pinned = unsafe { gpu.ctx.alloc_pinned_with_flags::<u16>(2 * len, 0).unwrap() };
        let mut dev = gpu.alloc::<u16>(2 * len).unwrap();
        let (mut up, mut down) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            let t = Instant::now();
            gpu.stream.memcpy_htod(&pinned, &mut dev).unwrap();
            gpu.synchronize().unwrap();
            up.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            gpu.stream.memcpy_dtoh(&dev, &mut pinned).unwrap();
            gpu.synchronize().unwrap();
            down.push(t.elapsed().as_secs_f64());
        }
        drop(dev);
        let gbs = |s: f64| bytes / s / 1e9;
        println!("{name}: {n_tokens} tokens, {:.1} MiB of f16 K/V | pinned memcpy bound: to device {:.1} GB/s, to host {:.1} GB/s", bytes / 1048576.0, gbs(median(up)), gbs(median(down)));

        let (mut old_w, mut new_ret, mut new_w, mut old_r, mut new_r) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut k_old, mut v_old) = (vec![0f32; len], vec![0f32; len]);
        let (mut k_new, mut v_new) = (vec![0f32; len], vec![0f32; len]);
        for _ in 0..repeats {
            let t = Instant::now();
            write_per_block(&gpu, &mut pool, &table, n_tokens, &k, &v);
            old_w.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            read_per_block(&gpu, &pool, &table, n_tokens, &mut k_old, &mut v_old);
            old_r.push(t.elapsed().as_secs_f64());

            let t = Instant::now();
            transfers
                .write_tokens(&gpu, &mut pool, &table, 0, &k, &v)
                .unwrap();
            new_ret.push(t.elapsed().as_secs_f64());
            gpu.synchronize().unwrap();
            new_w.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            transfers
                .read_tokens(&gpu, &pool, &table, 0, &mut k_new, &mut v_new)
                .unwrap();
            new_r.push(t.elapsed().as_secs_f64());
        }
        assert!(
            k_new == k_old && v_new == v_old,
            "{name}: the two paths read different values"
        );
        let (ow, nw, nr, or) = (median(old_w), median(new_w), median(new_r), median(old_r));
        println!(
            "{name} write: per-block {:.2} GB/s ({:.1} ms) | staged {:.2} GB/s ({:.1} ms; returns after {:.1} ms) | {:.1}×",
            gbs(ow), ow * 1e3, gbs(nw), nw * 1e3, median(new_ret) * 1e3, ow / nw
        );
        println!(
            "{name} read:  per-block {:.2} GB/s ({:.1} ms) | staged {:.2} GB/s ({:.1} ms) | {:.1}×",
            gbs(or),
            or * 1e3,
            gbs(nr),
            nr * 1e3,
            or / nr
        );
        println!("{name} stats: {:?}", transfers.stats);
    }
}
