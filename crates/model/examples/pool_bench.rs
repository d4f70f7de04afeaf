//! Cost and sharing of the decode pool (`kernels::pool`) on synthetic regions: each region
//! has `--chunks` chunks of `--work-us` microseconds of arithmetic (no memory traffic), and
//! regions run back to back, alternating between 1 and `--threads` active threads so both
//! see the same host load. Prints the median and mean time per region for each, and the
//! share of chunks the helpers computed.
//!
//! Run: `cargo run --release -p pk-model --example pool_bench [-- --threads 2 --chunks 16
//! --work-us 2 --regions 20000]`

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, d: f64| {
        args.iter()
            .position(|a| a == name)
            .map(|i| args[i + 1].parse().unwrap())
            .unwrap_or(d)
    };
    let threads = arg("--threads", 2.0) as usize;
    let chunks = arg("--chunks", 16.0) as usize;
    let work_us = arg("--work-us", 2.0);
    let regions = arg("--regions", 20000.0) as usize;
    let gap_us = arg("--gap-us", 0.0);
    // 0: alternate 1 and N threads region by region; 1: all regions at N threads.
    let only_n = arg("--only-n", 0.0) as usize == 1;
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
    let pool = pk_model::kernels::pool::global();
    // Calibrate a spin of work_us.
    let t = Instant::now();
    let mut x = 1u64;
    for i in 0..10_000_000u64 {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
    let per_us = 10_000_000.0 / (t.elapsed().as_secs_f64() * 1e6);
    let iters = (per_us * work_us) as u64;
    let gap_iters = (per_us * gap_us) as u64;
    let spin = |n: u64| {
        let mut x = 1u64;
        for i in 0..n {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
        }
        x
    };
    let mut times = [Vec::new(), Vec::new()];
    let h0 = pool.helper_chunks();
    let mut helper = 0;
    for r in 0..regions {
        let m = if only_n { 1 } else { r % 2 };
        pool.set_active_threads(if m == 0 { 1 } else { threads });
        let before = pool.helper_chunks();
        let t = Instant::now();
        pool.run(chunks, &|_| {
            std::hint::black_box(spin(iters));
        });
        times[m].push(t.elapsed().as_secs_f64() * 1e6);
        if m == 1 {
            helper += pool.helper_chunks() - before;
        }
        std::hint::black_box(spin(gap_iters));
    }
    let _ = h0;
    for (m, n) in [(0, 1), (1, threads)] {
        let t = &mut times[m];
        if t.is_empty() {
            continue;
        }
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mean = t.iter().sum::<f64>() / t.len() as f64;
        println!(
            "threads {n}: region median {:.1} us, mean {:.1} us, p90 {:.1} us",
            t[t.len() / 2],
            mean,
            t[t.len() * 9 / 10]
        );
    }
    println!(
        "helper share {:.1} % of chunks (counted lazily)",
        100.0 * helper as f64 / (chunks * times[1].len()) as f64
    );
}
