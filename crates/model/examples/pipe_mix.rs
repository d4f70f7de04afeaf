//! What bounds the AVX2 integer prefill tiles (`x86.rs` NOTE 7): the issue rate of
//! `vpmaddubsw`, `vpmaddwd` and `vpaddw` alone and mixed as the tiles mix them, and whether a
//! broadcast load (`vpbroadcastd` from memory) costs a vector pipe, each as independent
//! chains on one core, in operations per cycle. The clock is measured beside them with a
//! chain of dependent scalar adds (one a cycle on every x86 core of the last decade).
//!
//! Run: `cargo run --release -p pk-model --example pipe_mix`. x86-64 with AVX2 only.

mod common;
use clap::Parser;
use common::best_of;
use std::arch::asm;
use std::time::Duration;

/// Loop iterations per timed call; each iteration issues a kernel's eight or twelve ops.
const ITERS: u64 = 10_000_000;

/// Cycles per second: four dependent `add`s an iteration.
fn clock_hz() -> f64 {
    // SAFETY: scalar adds on registers the asm declares; no memory is touched.
    let t = best_of(Duration::from_millis(300), || unsafe {
        let mut n = ITERS;
        asm!(
            "2:",
            "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
            "dec {n}", "jnz 2b",
            n = inout(reg) n, x = out(reg) _,
        );
        std::hint::black_box(n);
    });
    4.0 * ITERS as f64 / t.as_secs_f64()
}

/// Times one kernel: `body` is the loop's text (eight or twelve independent vector ops
/// writing ymm0..ymm7 and ymm10..ymm13 from ymm8, ymm9 and 32 bytes at `{p}`).
macro_rules! kernel {
    ($name:ident, $($line:literal),+) => {
        #[target_feature(enable = "avx2")]
        unsafe fn $name(buf: &[u8; 64]) {
            let mut n = ITERS;
            asm!(
                "vmovdqu ymm8, [{p}]",
                "vmovdqu ymm9, [{p} + 32]",
                "2:",
                $($line,)+
                "dec {n}",
                "jnz 2b",
                n = inout(reg) n,
                p = in(reg) buf.as_ptr(),
                out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
                out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
                out("ymm12") _, out("ymm13") _,
                options(nostack),
            );
            std::hint::black_box(n);
        }
    };
}

kernel!(
    maddubs_alone,
    "vpmaddubsw ymm0, ymm8, ymm9",
    "vpmaddubsw ymm1, ymm8, ymm9",
    "vpmaddubsw ymm2, ymm8, ymm9",
    "vpmaddubsw ymm3, ymm8, ymm9",
    "vpmaddubsw ymm4, ymm8, ymm9",
    "vpmaddubsw ymm5, ymm8, ymm9",
    "vpmaddubsw ymm6, ymm8, ymm9",
    "vpmaddubsw ymm7, ymm8, ymm9"
);
kernel!(
    maddwd_alone,
    "vpmaddwd ymm0, ymm8, ymm9",
    "vpmaddwd ymm1, ymm8, ymm9",
    "vpmaddwd ymm2, ymm8, ymm9",
    "vpmaddwd ymm3, ymm8, ymm9",
    "vpmaddwd ymm4, ymm8, ymm9",
    "vpmaddwd ymm5, ymm8, ymm9",
    "vpmaddwd ymm6, ymm8, ymm9",
    "vpmaddwd ymm7, ymm8, ymm9"
);
kernel!(
    paddw_alone,
    "vpaddw ymm0, ymm8, ymm9",
    "vpaddw ymm1, ymm8, ymm9",
    "vpaddw ymm2, ymm8, ymm9",
    "vpaddw ymm3, ymm8, ymm9",
    "vpaddw ymm4, ymm8, ymm9",
    "vpaddw ymm5, ymm8, ymm9",
    "vpaddw ymm6, ymm8, ymm9",
    "vpaddw ymm7, ymm8, ymm9"
);
kernel!(
    mix_one_to_one,
    "vpmaddubsw ymm0, ymm8, ymm9",
    "vpaddw ymm1, ymm8, ymm9",
    "vpmaddubsw ymm2, ymm8, ymm9",
    "vpaddw ymm3, ymm8, ymm9",
    "vpmaddubsw ymm4, ymm8, ymm9",
    "vpaddw ymm5, ymm8, ymm9",
    "vpmaddubsw ymm6, ymm8, ymm9",
    "vpaddw ymm7, ymm8, ymm9"
);
kernel!(
    mix_one_to_two,
    "vpmaddubsw ymm0, ymm8, ymm9",
    "vpaddw ymm1, ymm8, ymm9",
    "vpaddw ymm10, ymm8, ymm9",
    "vpmaddubsw ymm2, ymm8, ymm9",
    "vpaddw ymm3, ymm8, ymm9",
    "vpaddw ymm11, ymm8, ymm9",
    "vpmaddubsw ymm4, ymm8, ymm9",
    "vpaddw ymm5, ymm8, ymm9",
    "vpaddw ymm12, ymm8, ymm9",
    "vpmaddubsw ymm6, ymm8, ymm9",
    "vpaddw ymm7, ymm8, ymm9",
    "vpaddw ymm13, ymm8, ymm9"
);
// The tiles' chain: a product added into a 16-bit sum, its activation a register…
kernel!(
    chain_from_register,
    "vpmaddubsw ymm10, ymm8, ymm9",
    "vpaddw ymm0, ymm0, ymm10",
    "vpmaddubsw ymm11, ymm8, ymm9",
    "vpaddw ymm1, ymm1, ymm11",
    "vpmaddubsw ymm12, ymm8, ymm9",
    "vpaddw ymm2, ymm2, ymm12",
    "vpmaddubsw ymm13, ymm8, ymm9",
    "vpaddw ymm3, ymm3, ymm13",
    "vpmaddubsw ymm10, ymm8, ymm9",
    "vpaddw ymm4, ymm4, ymm10",
    "vpmaddubsw ymm11, ymm8, ymm9",
    "vpaddw ymm5, ymm5, ymm11",
    "vpmaddubsw ymm12, ymm8, ymm9",
    "vpaddw ymm6, ymm6, ymm12",
    "vpmaddubsw ymm13, ymm8, ymm9",
    "vpaddw ymm7, ymm7, ymm13"
);
// …or four bytes broadcast from memory, as the tiles load it.
kernel!(
    chain_from_broadcast,
    "vpbroadcastd ymm10, dword ptr [{p}]",
    "vpmaddubsw ymm10, ymm8, ymm10",
    "vpaddw ymm0, ymm0, ymm10",
    "vpbroadcastd ymm11, dword ptr [{p} + 4]",
    "vpmaddubsw ymm11, ymm8, ymm11",
    "vpaddw ymm1, ymm1, ymm11",
    "vpbroadcastd ymm12, dword ptr [{p} + 8]",
    "vpmaddubsw ymm12, ymm8, ymm12",
    "vpaddw ymm2, ymm2, ymm12",
    "vpbroadcastd ymm13, dword ptr [{p} + 12]",
    "vpmaddubsw ymm13, ymm8, ymm13",
    "vpaddw ymm3, ymm3, ymm13",
    "vpbroadcastd ymm10, dword ptr [{p} + 16]",
    "vpmaddubsw ymm10, ymm8, ymm10",
    "vpaddw ymm4, ymm4, ymm10",
    "vpbroadcastd ymm11, dword ptr [{p} + 20]",
    "vpmaddubsw ymm11, ymm8, ymm11",
    "vpaddw ymm5, ymm5, ymm11",
    "vpbroadcastd ymm12, dword ptr [{p} + 24]",
    "vpmaddubsw ymm12, ymm8, ymm12",
    "vpaddw ymm6, ymm6, ymm12",
    "vpbroadcastd ymm13, dword ptr [{p} + 28]",
    "vpmaddubsw ymm13, ymm8, ymm13",
    "vpaddw ymm7, ymm7, ymm13"
);

/// Issue rates of the AVX2 integer prefill tiles' instructions, alone and mixed; no arguments.
#[derive(Parser)]
#[command(name = "pipe_mix")]
struct Args {}

fn main() {
    Args::parse();
    if !is_x86_feature_detected!("avx2") {
        eprintln!("pipe_mix: this CPU has no AVX2");
        std::process::exit(2);
    }
    let buf = [7u8; 64];
    let hz = clock_hz();
    println!("clock: {:.2} GHz (dependent scalar adds)", hz / 1e9);
    type Kernel = unsafe fn(&[u8; 64]);
    // (name, kernel, vector ops an iteration, of which vpmaddubsw/vpmaddwd)
    let kernels: [(&str, Kernel, f64, f64); 7] = [
        ("vpmaddubsw alone", maddubs_alone, 8.0, 8.0),
        ("vpmaddwd alone", maddwd_alone, 8.0, 8.0),
        ("vpaddw alone", paddw_alone, 8.0, 0.0),
        ("vpmaddubsw : vpaddw 1:1", mix_one_to_one, 8.0, 4.0),
        ("vpmaddubsw : vpaddw 1:2", mix_one_to_two, 12.0, 4.0),
        (
            "product + 16-bit sum, register",
            chain_from_register,
            16.0,
            8.0,
        ),
        (
            "product + 16-bit sum, broadcast",
            chain_from_broadcast,
            16.0,
            8.0,
        ),
    ];
    for (name, kernel, ops, mults) in kernels {
        // SAFETY: AVX2 was detected above; the kernels read only `buf`'s 64 bytes.
        let t = best_of(Duration::from_millis(300), || unsafe { kernel(&buf) });
        let cycles = t.as_secs_f64() * hz / ITERS as f64;
        println!(
            "{name:<34} {:>5.2} vector ops/cycle, {:>5.2} multiplies/cycle",
            ops / cycles,
            mults / cycles
        );
    }
}
