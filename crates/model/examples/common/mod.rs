//! What the kernel benchmarks (cargo examples of `pk-model`) share.

// Each example uses what it needs of this module; the rest would be dead code there.
#![allow(dead_code)]

use std::time::{Duration, Instant};

/// The shortest of repeated runs of `f` over at least `min` (after one warm-up call): on a
/// shared host the minimum is the least noisy statistic.
pub fn best_of(min: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let (start, mut best) = (Instant::now(), Duration::MAX);
    while start.elapsed() < min {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
    }
    best
}

/// `--threads N` from the command line (1 without it), with rayon's global pool built to
/// that many threads.
pub fn rayon_threads_from_args() -> usize {
    let args: Vec<String> = std::env::args().collect();
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .map(|i| {
            let v = args.get(i + 1).expect("--threads needs a value");
            v.parse()
                .unwrap_or_else(|_| panic!("--threads {v}: not a count"))
        })
        .unwrap_or(1);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
    threads
}
