//! This machine's DRAM read bandwidth, the bound on memory-bound decode: a read-only pass
//! over a buffer far larger than the caches, on huge pages as the weight arena is, with 1
//! and 2 threads each reading its own half. Prints the best of several passes, which is
//! what the host gives when it is not busy (print `host-quiet` beside it).
//!
//! Decode reads every weight once per token, so `bytes read per token ÷ this bandwidth`
//! is the fastest decode this machine allows (BENCHMARKS.md, issue 17).
//!
//! Usage: `cargo run --release -p pk-model --example stream_bench [MiB]` (default 1024).

use std::time::{Duration, Instant};

use pk_model::kernels::hugebuf::HugeBuf;

fn best_gbs(buf: &HugeBuf, threads: usize, passes: usize) -> f64 {
    let mut best = Duration::MAX;
    for _ in 0..passes {
        let t0 = Instant::now();
        let part = buf.len() / threads;
        let sums: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|i| s.spawn(move || fast_sum(&buf[i * part..(i + 1) * part])))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sums);
        best = best.min(t0.elapsed());
    }
    buf.len() as f64 / best.as_secs_f64() / 1e9
}

/// Eight independent accumulators over 64-byte lines, which the compiler vectorises; the
/// loop is bound by the loads, as a GEMV over streamed weights is.
fn fast_sum(b: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for line in b.chunks_exact(64) {
        for (a, w) in acc.iter_mut().zip(line.chunks_exact(8)) {
            *a = a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
        }
    }
    acc.iter().fold(0, |x, &y| x.wrapping_add(y))
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1024);
    let mut buf = HugeBuf::zeroed(mib << 20);
    for (i, v) in buf.iter_mut().enumerate() {
        *v = i as u8;
    }
    for threads in [1, 2] {
        println!(
            "stream read {mib} MiB, {threads} thread(s): {:.1} GB/s (best of 5)",
            best_gbs(&buf, threads, 5)
        );
    }
}
