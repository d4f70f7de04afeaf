//! Decode speed of the real model through `Llama::forward` alone (no engine, sampler or
//! tokenizer): a 512-token prefill, then 128 one-token steps, repeated; prints the best,
//! median and mean per-token time of the decode steps, and the process's CPU time per token.
//! On this shared host (other jobs take the cores for seconds at a time) wall-clock means
//! measure the host; the best step and the CPU time per token (at 1 thread: time actually
//! spent computing, though memory bandwidth is still shared) compare kernel changes.
//!
//! With `--compare 1,2` the decode pool (`kernels::pool`) switches between the listed thread
//! counts step by step in the same process (rayon and the pool are built with the largest),
//! so every count sees the same host load; each gets its own line.
//!
//! With `--vs-stream` every decode step is followed by read-only passes on as many threads,
//! with both of `kernels::stream`'s plans: over a buffer as large as the step's weights
//! (`Weights::decode_read_bytes`; `stream_bench`'s DRAM bound), and over the weights
//! themselves, matrix by matrix in decode's order. Each step's share of a bound is the
//! faster pass's time over the step's, so a host that slows down for a while slows both
//! sides of the ratio.
//!
//! Run: `cargo run --release -p pk-model --example decode_bench [-- --threads N --reps R
//! --context C --model PATH --compare 1,2 --vs-stream]` (default model: SmolLM2-135M-Instruct Q4_1 in
//! `~/.cache/pagekeeper`).

use std::time::Instant;

use clap::Parser;
use pk_gguf::GgufFile;
use pk_model::kernels::hugebuf::HugeBuf;
use pk_model::kernels::stream::{
    read_pass_plain, read_pass_prefetched, timed_pass, timed_pass_parts,
};
use pk_model::{KvDtype, KvGeometry, KvStore, Llama, SeqForward};

/// Decode speed of the real model through `Llama::forward` alone.
#[derive(Parser)]
#[command(name = "decode_bench")]
struct Args {
    /// Threads of rayon's pool and the decode pool (raised to the largest of `--compare`).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Rounds of 128 decode steps after the prefill.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Prompt tokens prefilled before the decode steps.
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Tokens the KV store holds; the engine sizes it to the model's context length.
    #[arg(long, default_value_t = 8192)]
    capacity: usize,
    /// The GGUF model; SmolLM2-135M-Instruct Q4_1 in `~/.cache/pagekeeper` without it.
    #[arg(long, value_name = "PATH")]
    model: Option<String>,
    /// Decode pool thread counts, comma-separated, switched step by step in one process.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<usize>,
    /// Follow every decode step with read passes as fast as DRAM allows, for its share.
    #[arg(long)]
    vs_stream: bool,
}

fn main() {
    let args = Args::parse();
    let compare = args.compare;
    let threads = args.threads.max(compare.iter().copied().max().unwrap_or(1));
    let modes: Vec<usize> = if compare.is_empty() {
        vec![threads]
    } else {
        compare.clone()
    };
    let (reps, context, capacity) = (args.reps, args.context, args.capacity);
    let decode = 128;
    let path = args.model.unwrap_or_else(|| {
        format!(
            "{}/.cache/pagekeeper/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap()
        )
    });
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
    let model = Llama::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let c = &model.config;
    let bs = 16;
    let total = context + decode;
    let g = KvGeometry {
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        block_size_tokens: bs,
        num_blocks: total.max(capacity).div_ceil(bs),
    };
    let mut store = KvStore::new(g, KvDtype::F16);
    let table: Vec<u32> = (0..g.num_blocks as u32).collect();
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| 1 + (i * 7919) % 40000)
        .collect();
    let t = Instant::now();
    let logits = model.forward(
        &mut store,
        &[SeqForward {
            tokens: &prompt,
            start_position: 0,
            stored_start: 0,
            block_table: &table,
            logits_from: context - 1,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        }],
    );
    let prefill = t.elapsed().as_secs_f64();
    let pool = pk_model::kernels::pool::global();
    let read_bytes = model.weights.decode_read_bytes();
    eprintln!(
        "decode weight prefetch: {}",
        pk_model::kernels::stream::decode_prefetch()
    );
    let stream_buf = args.vs_stream.then(|| {
        let mut b = HugeBuf::zeroed(read_bytes);
        b.iter_mut().enumerate().for_each(|(i, v)| *v = i as u8);
        b
    });
    let weights = model.weights.decode_read_data();
    // Per mode and step: the step's seconds, then the faster pass's over the buffer and over
    // the weights.
    let mut shares: Vec<Vec<[f64; 3]>> = vec![Vec::new(); modes.len()];
    let mut times = vec![Vec::new(); modes.len()];
    let mut cpus = vec![0f64; modes.len()];
    for _ in 0..reps {
        let mut tok = argmax(&logits);
        for i in 0..decode {
            let pos = context + i;
            let m = i % modes.len();
            pool.set_active_threads(modes[m]);
            let (t, c) = (Instant::now(), cpu_seconds());
            let l = model.forward(
                &mut store,
                &[SeqForward {
                    tokens: &[tok],
                    start_position: pos,
                    stored_start: pos,
                    block_table: &table,
                    logits_from: 0,
                    stored_positions: &[],
                    window_tables: &[],
                    head_first_keys: &[],
                }],
            );
            let step_s = t.elapsed().as_secs_f64();
            times[m].push(step_s);
            cpus[m] += cpu_seconds() - c;
            if let Some(buf) = &stream_buf {
                let n = modes[m];
                let plans = [read_pass_plain, read_pass_prefetched];
                let buf_s = plans.map(|p| timed_pass(buf, n, p));
                let weights_s = plans.map(|p| timed_pass_parts(&weights, n, p));
                shares[m].push([
                    step_s,
                    buf_s[0].min(buf_s[1]),
                    weights_s[0].min(weights_s[1]),
                ]);
            }
            tok = argmax(&l);
        }
    }
    for (m, &n) in modes.iter().enumerate() {
        let times = &mut times[m];
        let cpu = cpus[m] / times.len() as f64;
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let med = times[times.len() / 2];
        println!(
            "threads {n} context {context}: prefill {:.1} tok/s | decode best {:.1} median {:.1} mean {:.1} tok/s ({:.0} / {:.0} / {:.0} us per token) | CPU {:.0} us per token ({:.1} tok/s per CPU-second)",
            context as f64 / prefill,
            1.0 / times[0],
            1.0 / med,
            1.0 / mean,
            times[0] * 1e6,
            med * 1e6,
            mean * 1e6,
            cpu * 1e6,
            1.0 / cpu
        );
    }
    if stream_buf.is_some() {
        print_shares(&modes, &shares, read_bytes);
    }
    let (split, solo) = pool.step_counts();
    println!(
        "pool helper chunks: {} steps split: {split} solo: {solo}",
        pool.helper_chunks()
    );
}

fn argmax(x: &[f32]) -> u32 {
    x.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0 as u32
}

/// CPU time of the whole process (every thread), from `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`.
fn cpu_seconds() -> f64 {
    #[repr(C)]
    struct Timespec {
        sec: i64,
        nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: `t` is a valid timespec; the call only writes it.
    unsafe { clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

/// Each mode's decode against the read passes that followed its steps: the median (and
/// quartiles) of the per-step shares of each bound, and the median step's and the best
/// passes' bandwidths.
fn print_shares(modes: &[usize], shares: &[Vec<[f64; 3]>], read_bytes: usize) {
    let gbs = |s: f64| read_bytes as f64 / s / 1e9;
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v
    };
    for (&n, steps) in modes.iter().zip(shares) {
        let share = |k: usize| sorted(steps.iter().map(|s| s[k] / s[0]).collect());
        let (buf, own) = (share(1), share(2));
        let q = |v: &[f64], at: usize| 100.0 * v[at * v.len() / 4];
        let median_step = sorted(steps.iter().map(|s| s[0]).collect())[steps.len() / 2];
        let best = |k: usize| steps.iter().map(|s| s[k]).fold(f64::INFINITY, f64::min);
        println!(
            "threads {n} vs stream ({:.1} MB a step): share of the DRAM bound per step median {:.1} % (quartiles {:.1} / {:.1}), of the weights' own read {:.1} % ({:.1} / {:.1}) | median step {:.2} GB/s, best pass over a buffer {:.2}, over the weights {:.2}",
            read_bytes as f64 / 1e6,
            q(&buf, 2),
            q(&buf, 1),
            q(&buf, 3),
            q(&own, 2),
            q(&own, 1),
            q(&own, 3),
            gbs(median_step),
            gbs(best(1)),
            gbs(best(2)),
        );
    }
}
