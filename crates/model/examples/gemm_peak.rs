//! Prefill GEMM against the host's peak (issue 39): the int8 multiply-accumulate rate of
//! this CPU's widest integer path, measured on one core with independent chains of its
//! instruction (AVX2 `vpmaddubsw`, AVX-512 VNNI `vpdpbusd` on 256 and 512 bits), then the
//! packed GEMM's rate at Qwen2.5-Coder-1.5B's shapes (Q4_K, Q6_K, and the Q4_1 and Q6S
//! they were converted to before, 512 tokens) per core at 1 and
//! 2 threads, each as a fraction of that peak. An op is one multiply or one add, so a
//! multiply-accumulate is 2 (as GFLOP/s counts them).
//!
//! Run: `cargo run --release -p pk-model --example gemm_peak [-- --tokens 512] [--cold]`.
//! `--cold`: each timed call takes the next of enough random matrices of the shape to fill
//! [`cold_bytes`], so that its weights come from DRAM as in the model's forward pass;
//! without it one matrix is repeated and stays in L2 or L3.
//! Weights are random but valid; the kernels' speed does not depend on the values. On a
//! host with AMX the peak is that of `tdpbsud` on full 16 × 64-byte tiles in four
//! independent accumulators (16,384 multiply-accumulates an instruction), and the GEMM runs
//! the AMX kernel (`PK_AMX=0` runs the VNNI one, `PK_ISA=avx2` the AVX2 one, for
//! side-by-side figures; the fractions printed are against the host's widest peak, and
//! under `PK_ISA=avx2` also against the AVX2 peak, the one an AVX2-only host would have).

mod common;
use clap::Parser;
use common::best_of;
use std::time::Duration;

use pk_gguf::GgmlType;
use pk_model::kernels::{matmul, place_in_arena, QMatrix};
use rand::{Rng, SeedableRng};

/// Qwen2.5-Coder-1.5B's matrices of one layer: (name, rows, cols, format). Its Q4_K_M file
/// has Q4_K (run natively) for most and Q6_K (run as Q6S) for `attn_v` and about half the
/// layers' `ffn_down`, both run natively; the Q4_1 and Q6S rows are the formats they were
/// converted to before, for comparison.
const SHAPES: [(&str, usize, usize, GgmlType); 10] = [
    ("q/o 1536->1536", 1536, 1536, GgmlType::Q4K),
    ("k/v 1536->256", 256, 1536, GgmlType::Q4K),
    ("gate/up 1536->8960", 8960, 1536, GgmlType::Q4K),
    ("down 8960->1536", 1536, 8960, GgmlType::Q4K),
    ("v 1536->256", 256, 1536, GgmlType::Q6K),
    ("down 8960->1536", 1536, 8960, GgmlType::Q6K),
    ("v 1536->256", 256, 1536, GgmlType::Q6S),
    ("down 8960->1536", 1536, 8960, GgmlType::Q6S),
    ("gate/up 1536->8960", 8960, 1536, GgmlType::Q4_1),
    ("down 8960->1536", 1536, 8960, GgmlType::Q4_1),
];

/// The least `--cold` cycles through per shape: several times the L3 of most of these hosts.
const COLD_BYTES_MIN: usize = 256 << 20;

/// The weights `--cold` cycles through per shape: three times the L3 that sysfs reports for
/// CPU 0, and at least [`COLD_BYTES_MIN`]. A fixed 256 MiB was L3-resident on an Intel host
/// that reports 480 MiB of L3 (2026-12-08), where its "cold" rates were partly L3 rates.
fn cold_bytes() -> usize {
    let l3_bytes = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let (digits, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
            let scale = match unit {
                "K" => 1 << 10,
                "M" => 1 << 20,
                _ => return None,
            };
            digits.parse::<usize>().ok().map(|n| n * scale)
        })
        .unwrap_or(0);
    (3 * l3_bytes).max(COLD_BYTES_MIN)
}

fn random_matrix(rng: &mut impl Rng, ty: GgmlType, rows: usize, cols: usize) -> QMatrix {
    let mut data = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
    rng.fill(&mut data[..]);
    let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
    for blk in data.chunks_exact_mut(ty.block_bytes()) {
        if ty == GgmlType::Q6K {
            blk[208..210].copy_from_slice(&h(rng.gen_range(0.001..0.01)));
            continue;
        }
        blk[0..2].copy_from_slice(&h(rng.gen_range(0.001..0.01)));
        if ty == GgmlType::Q4_1 {
            blk[2..4].copy_from_slice(&h(rng.gen_range(-0.01..0.0)));
        }
        if ty == GgmlType::Q6S || ty == GgmlType::Q4K {
            blk[2..4].copy_from_slice(&h(rng.gen_range(0.001..0.01)));
        }
    }
    QMatrix::new(ty, rows, cols, data)
}

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;

    /// Iterations of the measured loops; each runs `CHAINS` independent instructions.
    pub const ITERS: usize = 1 << 22;
    const CHAINS: usize = 12;

    /// `vpmaddubsw` on 256 bits in `CHAINS` independent chains, each instruction's result
    /// its chain's next input (so nothing can be hoisted out of the loop): 32
    /// multiply-accumulates an instruction.
    #[target_feature(enable = "avx2")]
    pub unsafe fn avx2_maddubs(iters: usize) -> i64 {
        let w = _mm256_set1_epi8(3);
        let mut x = [_mm256_setzero_si256(); CHAINS];
        for (i, v) in x.iter_mut().enumerate() {
            *v = _mm256_set1_epi8(i as i8 - 6);
        }
        for _ in 0..iters {
            for v in x.iter_mut() {
                *v = _mm256_maddubs_epi16(w, *v);
            }
        }
        fold(&x)
    }

    /// `vpdpbusd` on 256 bits, chained likewise: 32 multiply-accumulates an instruction.
    #[target_feature(enable = "avx512f,avx512vl,avx512vnni")]
    pub unsafe fn vnni_256(iters: usize) -> i64 {
        let w = _mm256_set1_epi8(3);
        let mut x = [_mm256_setzero_si256(); CHAINS];
        for (i, v) in x.iter_mut().enumerate() {
            *v = _mm256_set1_epi8(i as i8);
        }
        for _ in 0..iters {
            for v in x.iter_mut() {
                *v = _mm256_dpbusd_epi32(*v, w, *v);
            }
        }
        fold(&x)
    }

    /// `vpdpbusd` on 512 bits: 64 multiply-accumulates an instruction.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn vnni_512(iters: usize) -> i64 {
        let w = _mm512_set1_epi8(3);
        let mut x = [_mm512_setzero_si512(); CHAINS];
        for (i, v) in x.iter_mut().enumerate() {
            *v = _mm512_set1_epi8(i as i8);
        }
        for _ in 0..iters {
            for v in x.iter_mut() {
                *v = _mm512_dpbusd_epi32(*v, w, *v);
            }
        }
        let mut s = 0i64;
        for v in x {
            s += _mm512_reduce_add_epi32(v) as i64;
        }
        s
    }

    /// `tdpbsud` on full tiles (16 rows × 64 bytes) into four independent accumulators:
    /// 16 × 16 × 64 multiply-accumulates an instruction. The caller has checked that AMX is
    /// usable (`pk_model::kernels::amx_permitted()`, which also asked Linux for the tile
    /// state).
    pub unsafe fn amx(iters: usize) -> i64 {
        use std::arch::asm;
        #[repr(C, align(64))]
        struct Cfg([u8; 64]);
        let mut cfg = Cfg([0; 64]);
        cfg.0[0] = 1;
        for i in 0..6 {
            cfg.0[16 + 2 * i..18 + 2 * i].copy_from_slice(&64u16.to_le_bytes());
            cfg.0[48 + i] = 16;
        }
        let ones = [1u8; 1024];
        let mut out = [0i32; 256];
        asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack));
        asm!("tileloadd tmm4, [{p} + {s}*1]", "tileloadd tmm5, [{p} + {s}*1]",
             "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
             p = in(reg) ones.as_ptr(), s = in(reg) 64usize, options(nostack));
        for _ in 0..iters / CHAINS {
            asm!(
                "tdpbsud tmm0, tmm4, tmm5",
                "tdpbsud tmm1, tmm4, tmm5",
                "tdpbsud tmm2, tmm4, tmm5",
                "tdpbsud tmm3, tmm4, tmm5",
                options(nostack, nomem)
            );
        }
        asm!("tilestored [{p} + {s}*1], tmm0", "tilerelease",
             p = in(reg) out.as_mut_ptr(), s = in(reg) 64usize, options(nostack));
        out[0] as i64
    }

    #[target_feature(enable = "avx2")]
    unsafe fn fold(acc: &[__m256i]) -> i64 {
        let mut lanes = [0i32; 8];
        let mut s = 0i64;
        for x in acc {
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, *x);
            s += lanes.iter().map(|&v| v as i64).sum::<i64>();
        }
        s
    }

    /// MACs one loop iteration performs with an instruction of `macs_per_instr`.
    pub fn macs(iters: usize, macs_per_instr: usize) -> f64 {
        (iters * CHAINS * macs_per_instr) as f64
    }
}

/// (path name, GOPS on one core) of the widest int8 path this CPU has.
#[cfg(target_arch = "x86_64")]
fn measure_peak() -> Option<(&'static str, f64)> {
    let rate = |f: &dyn Fn() -> i64, macs_per_instr: usize| {
        let t = best_of(Duration::from_millis(500), || {
            std::hint::black_box(f());
        });
        2.0 * peak::macs(peak::ITERS, macs_per_instr) / t.as_secs_f64() / 1e9
    };
    println!("matmul kernel: {}", pk_model::kernels::matmul_isa());
    // The AMX peak is measured wherever the CPU and OS allow it, even under `PK_AMX=0`.
    if pk_model::kernels::amx_permitted() {
        // `iters / CHAINS` loop trips of 4 instructions: `iters / 3` instructions in all.
        let instrs = (peak::ITERS / 12 * 4) as f64;
        let t = best_of(Duration::from_millis(500), || {
            // SAFETY: AMX is usable (see `peak::amx`).
            std::hint::black_box(unsafe { peak::amx(peak::ITERS) });
        });
        let r = 2.0 * instrs * 16384.0 / t.as_secs_f64() / 1e9;
        println!("peak AMX tdpbsud (full tiles): {r:.1} GOPS/core");
        return Some(("AMX int8", r));
    }
    if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
        // SAFETY: the features were detected just above.
        let r256 = rate(&|| unsafe { peak::vnni_256(peak::ITERS) }, 32);
        // SAFETY: as above.
        let r512 = rate(&|| unsafe { peak::vnni_512(peak::ITERS) }, 64);
        println!("peak AVX-512 VNNI vpdpbusd: 256-bit {r256:.1} GOPS/core, 512-bit {r512:.1}");
        return Some(("AVX-512 VNNI (512-bit)", r512.max(r256)));
    }
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        let r = rate(&|| unsafe { peak::avx2_maddubs(peak::ITERS) }, 32);
        println!("peak AVX2 vpmaddubsw: {r:.1} GOPS/core");
        return Some(("AVX2", r));
    }
    None
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_peak() -> Option<(&'static str, f64)> {
    None
}

/// The AVX2 `vpmaddubsw` peak on one core when `PK_ISA=avx2` narrows the kernels on a wider
/// CPU (on an AVX2-only host `measure_peak` already is that peak).
#[cfg(target_arch = "x86_64")]
fn narrowed_to_avx2_peak() -> Option<f64> {
    let narrowed = pk_model::kernels::matmul_isa() == "avx2"
        && (is_x86_feature_detected!("avx512vnni") || pk_model::kernels::amx_permitted());
    narrowed.then(|| {
        let t = best_of(Duration::from_millis(500), || {
            // SAFETY: the kernels run AVX2, so the CPU has it.
            std::hint::black_box(unsafe { peak::avx2_maddubs(peak::ITERS) });
        });
        let r = 2.0 * peak::macs(peak::ITERS, 32) / t.as_secs_f64() / 1e9;
        println!("peak AVX2 vpmaddubsw: {r:.1} GOPS/core");
        r
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn narrowed_to_avx2_peak() -> Option<f64> {
    None
}

/// Prefill GEMM against the host's int8 multiply-accumulate peak, per core.
#[derive(Parser)]
#[command(name = "gemm_peak")]
struct Args {
    /// Tokens each GEMM multiplies (prefill's batch).
    #[arg(long, default_value_t = 512)]
    tokens: usize,
    /// Cycle each shape through enough matrices that its weights come from DRAM.
    #[arg(long)]
    cold: bool,
}

fn main() {
    let Args { tokens, cold } = Args::parse();
    let peak = measure_peak();
    let avx2_peak = narrowed_to_avx2_peak();
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mats: Vec<QMatrix> = SHAPES
        .iter()
        .map(|&(_, rows, cols, ty)| random_matrix(&mut rng, ty, rows, cols))
        .collect();
    if cold {
        println!(
            "cold: each shape cycles through {} MiB of matrices (three times the L3, at least {} MiB)",
            cold_bytes() >> 20,
            COLD_BYTES_MIN >> 20
        );
    }
    for threads in [1usize, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (mut macs, mut secs) = (0f64, 0f64);
        for ((name, rows, cols, ty), w) in SHAPES.iter().zip(&mats) {
            let x: Vec<f32> = (0..tokens * cols)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let mut out = vec![0f32; tokens * rows];
            let copies = if cold {
                (cold_bytes() / w.stored_bytes()).max(1)
            } else {
                1
            };
            let mut extra: Vec<QMatrix> = (1..copies)
                .map(|_| random_matrix(&mut rng, *ty, *rows, *cols))
                .collect();
            // In huge pages, as the model's weights are: 256 MiB over 4 KiB pages would
            // measure TLB misses the model does not have.
            place_in_arena(&mut extra.iter_mut().collect::<Vec<_>>());
            let ws: Vec<&QMatrix> = std::iter::once(w).chain(&extra).collect();
            let mut call = 0;
            let t = pool.install(|| {
                best_of(Duration::from_millis(400), || {
                    matmul(ws[call % ws.len()], &x, tokens, &mut out);
                    call += 1;
                })
            });
            let gops = 2.0 * (rows * cols * tokens) as f64 / t.as_secs_f64() / 1e9;
            println!(
                "threads {threads} {ty:<4} {name:<20} n={tokens}{} {gops:>7.1} GOPS ({:.1} per core)",
                if cold { " cold" } else { "" },
                gops / threads as f64
            );
            // The model's formats only: the Q4_1 and Q6S rows are there for comparison.
            if !matches!(ty, GgmlType::Q4_1 | GgmlType::Q6S) {
                macs += (rows * cols * tokens) as f64;
                secs += t.as_secs_f64();
            }
        }
        let per_core = 2.0 * macs / secs / 1e9 / threads as f64;
        if let Some(p) = avx2_peak {
            println!(
                "threads {threads} all shapes: {per_core:.1} GOPS per core = {:.0} % of the \
                 AVX2 peak ({p:.1})",
                100.0 * per_core / p
            );
        }
        match peak {
            Some((path, p)) => println!(
                "threads {threads} all shapes: {per_core:.1} GOPS per core = {:.0} % of the \
                 {path} peak ({p:.1})",
                100.0 * per_core / p
            ),
            None => println!("threads {threads} all shapes: {per_core:.1} GOPS per core"),
        }
    }
}
