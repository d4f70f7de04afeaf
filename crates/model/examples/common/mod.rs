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

/// Builds rayon's global pool with `threads` threads (an example's `--threads`), so that
/// the kernels run on as many as asked and no more.
pub fn build_rayon_pool(threads: usize) {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
}
