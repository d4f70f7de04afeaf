//! Helpers shared by the GPU tests: opening the device (or skipping), random data, and
//! comparisons with tolerances that say what they allow.

#![allow(dead_code)]

use pk_cuda::{cuda_or_skip, ActDtype, Gpu};
use rand::{Rng, SeedableRng};

/// The GPU, or `None` after printing "skipped: no CUDA device" (tests then return).
pub fn gpu(act: ActDtype) -> Option<Gpu> {
    cuda_or_skip(act)
}

pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

pub fn uniform(rng: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

/// f32 values as act_t bits (what the GEMM and the kernels' act_t outputs hold).
pub fn to_act(act: ActDtype, x: &[f32]) -> Vec<u16> {
    match act {
        ActDtype::F16 => x
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect(),
        ActDtype::Bf16 => x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect(),
    }
}

pub fn from_act(act: ActDtype, x: &[u16]) -> Vec<f32> {
    match act {
        ActDtype::F16 => x
            .iter()
            .map(|&b| half::f16::from_bits(b).to_f32())
            .collect(),
        ActDtype::Bf16 => x
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect(),
    }
}

/// Relative precision of one act_t rounding.
pub fn act_eps(act: ActDtype) -> f32 {
    match act {
        ActDtype::F16 => 1.0 / 1024.0,
        ActDtype::Bf16 => 1.0 / 128.0,
    }
}

/// Asserts |got - want| <= abs + rel * |want| elementwise, naming the worst element.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], abs: f32, rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0usize, 0f32);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: element {i} is {g}");
        let excess = (g - w).abs() - (abs + rel * w.abs());
        if excess > worst.1 {
            worst = (i, excess);
        }
    }
    let (i, e) = worst;
    assert!(
        e <= 0.0,
        "{what}: element {i}: got {} want {} (beyond tolerance by {e})",
        got[i],
        want[i]
    );
}
