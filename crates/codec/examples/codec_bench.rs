//! Micro-benchmark: encode and decode throughput of every codec at SmolLM2-135M's KV
//! shape (30 layers, 3 KV heads, head_dim 64) for one 256-token chunk, and the bytes per
//! token each stores. Throughput is in MB/s of the context's f16 KV (23,040 B/token), the
//! unit the EVICPRESS delay model compares with tier bandwidths.
//!
//! `decode` allocates a fresh context (its page faults included); `decode_into` reuses one.
//!
//! Run: `cargo run --release -p pk-codec --example codec_bench [n_tokens]`

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::Parser;
use pk_codec::{
    compressed_bytes_estimate, decode, decode_into, encode, DropSpec, KvContext, Method, Precision,
    QuantSpec,
};
use Precision::*;

/// Encode and decode throughput of every codec on one chunk of SmolLM2-135M's KV shape.
#[derive(Parser)]
#[command(name = "codec_bench")]
struct Args {
    /// Tokens in the chunk; 256 is the tiers' chunk size.
    #[arg(default_value_t = 256)]
    n_tokens: usize,
}

fn main() {
    let n_tokens = Args::parse().n_tokens;
    let (n_layers, n_kv_heads, head_dim) = (30, 3, 64);
    let n = n_layers * n_kv_heads * head_dim * n_tokens;
    // Deterministic pseudo-random KV (an LCG: no dependency, no allocation per element).
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
    };
    let k: Vec<f32> = (0..n).map(|_| next()).collect();
    let v: Vec<f32> = (0..n).map(|_| next()).collect();
    let scores: Vec<f32> = (0..n_tokens).map(|_| next()).collect();
    let ctx = KvContext::new(
        n_layers,
        n_kv_heads,
        head_dim,
        (0..n_tokens as u32).collect(),
        k,
        v,
    )
    .unwrap();
    let f16_bytes = ctx.shape().f16_bytes_per_token() * n_tokens;
    let fingerprint = [1u8; 32];

    let windowed = QuantSpec {
        fp_window_tokens: 32,
        ..QuantSpec::uniform(Q4)
    };
    let codecs: [(&str, Method); 9] = [
        ("f16", Method::None),
        ("q8", Method::Quant(QuantSpec::uniform(Q8))),
        ("k8v4", Method::Quant(QuantSpec::kv(Q8, Q4))),
        ("q4", Method::Quant(QuantSpec::uniform(Q4))),
        ("q4+fp32tok", Method::Quant(windowed)),
        ("q2", Method::Quant(QuantSpec::uniform(Q2))),
        ("drop0.5", Method::Drop(DropSpec::new(0.5))),
        (
            "drop0.5+q4",
            Method::DropQuant(DropSpec::new(0.5), QuantSpec::uniform(Q4)),
        ),
        (
            "drop0.8+q2",
            Method::DropQuant(DropSpec::new(0.8), QuantSpec::uniform(Q2)),
        ),
    ];
    println!(
        "SmolLM2-135M shape, {n_tokens} tokens, f16 baseline {} B/token ({:.2} MB)",
        f16_bytes / n_tokens,
        f16_bytes as f64 / 1e6
    );
    println!(
        "{:<12} {:>9} {:>10} {:>7} {:>12} {:>12} {:>12}",
        "codec", "bytes", "B/token", "ratio", "encode MB/s", "decode MB/s", "decode_into"
    );
    for (name, method) in codecs {
        let bytes = encode(&ctx, &method, Some(&scores), &fingerprint).unwrap();
        assert_eq!(
            bytes.len(),
            compressed_bytes_estimate(&method, &ctx.shape())
        );
        let enc =
            time(|| black_box(encode(&ctx, &method, Some(&scores), &fingerprint).unwrap()).len());
        let dec_fresh = time(|| black_box(decode(&bytes, &fingerprint).unwrap()).k.len());
        let mut reused = decode(&bytes, &fingerprint).unwrap();
        let dec = time(|| {
            decode_into(&bytes, &fingerprint, &mut reused).unwrap();
            black_box(&reused).k.len()
        });
        let mbps = |d: Duration| f16_bytes as f64 / d.as_secs_f64() / 1e6;
        println!(
            "{:<12} {:>9} {:>10.1} {:>6.2}x {:>12.0} {:>12.0} {:>12.0}",
            name,
            bytes.len(),
            bytes.len() as f64 / n_tokens as f64,
            f16_bytes as f64 / bytes.len() as f64,
            mbps(enc),
            mbps(dec_fresh),
            mbps(dec)
        );
    }
}

/// Fastest call over at least 0.3 s of calls (and at least 5): the minimum, not the
/// median, because the machine is shared and slower samples measure the neighbours.
fn time(mut f: impl FnMut() -> usize) -> Duration {
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || start.elapsed() < Duration::from_millis(300) {
        let t = Instant::now();
        black_box(f());
        samples.push(t.elapsed());
    }
    samples.into_iter().min().unwrap()
}
