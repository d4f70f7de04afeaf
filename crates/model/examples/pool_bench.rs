//! Cost and sharing of the decode pool (`kernels::pool`) on synthetic regions: each region
//! has `--chunks` chunks of `--work-us` microseconds of arithmetic (no memory traffic), and
//! regions run back to back, alternating between 1 and `--threads` active threads so both
//! see the same host load. Prints the median and mean time per region for each, and the
//! share of chunks the helpers computed.
//!
//! Run: `cargo run --release -p pk-model --example pool_bench [-- --threads 2 --chunks 16
//! --work-us 2 --regions 20000]`

use std::time::Instant;

use clap::Parser;

/// Cost and sharing of the decode pool on synthetic regions of pure arithmetic.
#[derive(Parser)]
#[command(name = "pool_bench")]
struct Args {
    /// Threads (N) of every other region, or of all with `--only-n 1`; the rest run on one.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Chunks of work in each region.
    #[arg(long, default_value_t = 16)]
    chunks: usize,
    /// Microseconds of arithmetic in each chunk.
    #[arg(long, default_value_t = 2.0)]
    work_us: f64,
    /// Regions run, back to back.
    #[arg(long, default_value_t = 20000)]
    regions: usize,
    /// Microseconds of arithmetic on the calling thread alone between regions.
    #[arg(long, default_value_t = 0.0)]
    gap_us: f64,
    /// 1 runs every region on N threads; 0 alternates 1 and N, so both see the same host load.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    only_n: u8,
}

fn main() {
    let args = Args::parse();
    let (threads, chunks, work_us) = (args.threads, args.chunks, args.work_us);
    let (regions, gap_us, only_n) = (args.regions, args.gap_us, args.only_n == 1);
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
