//! This machine's DRAM read bandwidth, the bound on memory-bound decode: read-only passes
//! over a buffer far larger than the caches, on huge pages as the weight arena is, with 1
//! and 2 threads each reading its own half. Two plans (`kernels::stream`): the hardware
//! prefetcher alone, and decode's own software prefetches ahead of every line; the bound is
//! the faster. Prints the best of several passes, which is what the host gives when it is
//! not busy (print `host-quiet` beside it).
//!
//! Decode reads every weight once per token, so `bytes read per token ÷ this bandwidth`
//! is the fastest decode this machine allows (BENCHMARKS.md, issue 17); `decode_bench
//! --vs-stream` measures decode against it token by token.
//!
//! Usage: `cargo run --release -p pk-model --example stream_bench [MiB]` (default 1024).

use clap::Parser;
use pk_model::kernels::hugebuf::HugeBuf;
use pk_model::kernels::stream::{best_seconds, read_pass_plain, read_pass_prefetched};

/// This machine's DRAM read bandwidth, the bound on memory-bound decode.
#[derive(Parser)]
#[command(name = "stream_bench")]
struct Args {
    /// Size of the buffer read, far larger than the caches.
    #[arg(value_name = "MiB", default_value_t = 1024)]
    mib: usize,
}

fn main() {
    let mib = Args::parse().mib;
    let mut buf = HugeBuf::zeroed(mib << 20);
    for (i, v) in buf.iter_mut().enumerate() {
        *v = i as u8;
    }
    let gbs = |s: f64| buf.len() as f64 / s / 1e9;
    println!(
        "decode weight prefetch: {}",
        pk_model::kernels::stream::decode_prefetch()
    );
    for threads in [1, 2] {
        let plain = gbs(best_seconds(&buf, threads, 5, read_pass_plain));
        let ahead = gbs(best_seconds(&buf, threads, 5, read_pass_prefetched));
        println!(
            "stream read {mib} MiB, {threads} thread(s): {:.1} GB/s (best of 5; hardware prefetch {plain:.1}, decode's prefetches {ahead:.1})",
            plain.max(ahead)
        );
    }
}
