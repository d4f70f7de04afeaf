//! Helpers shared by the GPU tests: opening the device, random data, and comparisons with
//! tolerances that say what they allow.

#![allow(dead_code)]

use pk_cuda::{ActDtype, CudaError, Gpu};
use rand::{Rng, SeedableRng};

/// The GPU, or a panic saying why there is none. The tests that call this are `#[ignore]`d
/// because they need a GPU, so they only run when asked to (`--ignored`, `--include-ignored`);
/// once asked, a missing device is a failure, never a pass that checked nothing.
pub fn gpu(act: ActDtype) -> Gpu {
    match Gpu::new(0, act) {
        Ok(g) => g,
        Err(CudaError::NoDevice(why)) => panic!(
            "no CUDA device ({why}): this test needs an NVIDIA GPU with libcuda, libnvrtc and \
             libcublas on the library path (scripts/gpu/check.sh finds them)"
        ),
        Err(e) => panic!("CUDA device unusable: {e}"),
    }
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
