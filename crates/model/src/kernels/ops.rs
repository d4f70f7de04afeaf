//! Elementwise and reduction kernels over contiguous f32 slices.
//!
//! These are written as plain loops over slices so that the compiler vectorises them;
//! they are not the bottleneck (matmul and attention are). The gated activations run on
//! rayon's threads in pieces when a prefill hands them whole batches: on one thread they
//! were a fifth of a two-thread 512-token prefill of Qwen2.5-Coder-1.5B once the GEMM ran
//! on AMX (each element is computed as before, so the bits do not change).

use rayon::prelude::*;

/// Elementwise work over at least this many elements is split across rayon's threads;
/// below it (decode's rows) one thread does it, as waking another would cost more.
pub(super) const PAR_MIN_ELEMS: usize = 1 << 16;
/// Elements per piece of such a split: 64 KiB of f32, a few µs of work.
pub(super) const PAR_CHUNK_ELEMS: usize = 1 << 14;

/// Applies `f` to matching pieces of `a` and `b`, in parallel when they are long enough.
fn par_zip(a: &mut [f32], b: &[f32], f: impl Fn(&mut [f32], &[f32]) + Sync) {
    assert_eq!(a.len(), b.len());
    if a.len() >= PAR_MIN_ELEMS && rayon::current_num_threads() > 1 {
        a.par_chunks_mut(PAR_CHUNK_ELEMS)
            .zip(b.par_chunks(PAR_CHUNK_ELEMS))
            .for_each(|(a, b)| f(a, b));
    } else {
        f(a, b);
    }
}

/// Dot product with four independent accumulators, so the loop vectorises and
/// the additions are not one long dependency chain.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) * weight`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mean_sq = dot_f32(x, x) / x.len() as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(weight) {
        *o = xi * scale * wi;
    }
}

/// In-place numerically stable softmax.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// SwiGLU's gate: `gate = silu(gate) * up` (`kernels::silu` says which exponential).
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    par_zip(gate, up, super::silu::silu_mul_serial);
}

/// GeGLU's gate (Gemma): `gate = gelu(gate) * up`, GELU in its tanh approximation, as
/// llama.cpp's `ggml_gelu` (which tabulates it in f16 on the CPU; this computes it in f32).
/// `0.5·(1 + tanh(u))` is computed as `1 / (1 + e^(−2u))`, the same function, because an
/// `exp` vectorises and libm's `tanhf` does not (it was an eighth of Gemma's prefill).
pub fn gelu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    par_zip(gate, up, gelu_mul_serial);
}

fn gelu_mul_serial(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if super::attn512::supported(64) {
        // SAFETY: the features were detected; both slices have the same length.
        unsafe { gelu_mul_avx512(gate, up) };
        return;
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_scalar(*g) * u;
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF_A: f32 = 0.044_715;

#[inline]
fn gelu_scalar(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x);
    x / (1.0 + (-2.0 * u).exp())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn gelu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n16 = gate.len() / 16 * 16;
    let (c, a, m2, one) = (
        _mm512_set1_ps(SQRT_2_OVER_PI),
        _mm512_set1_ps(GELU_COEF_A),
        _mm512_set1_ps(-2.0),
        _mm512_set1_ps(1.0),
    );
    for i in (0..n16).step_by(16) {
        let x = _mm512_loadu_ps(gate.as_ptr().add(i));
        let u = _mm512_mul_ps(
            _mm512_mul_ps(c, x),
            _mm512_fmadd_ps(_mm512_mul_ps(a, x), x, one),
        );
        let e = super::attn512::exp512(_mm512_mul_ps(m2, u));
        let g = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(
            gate.as_mut_ptr().add(i),
            _mm512_mul_ps(g, _mm512_loadu_ps(up.as_ptr().add(i))),
        );
    }
    for i in n16..gate.len() {
        gate[i] = gelu_scalar(gate[i]) * up[i];
    }
}

/// RMSNorm of `x` in place, one `weight.len()`-long row at a time (Gemma's per-head Q/K
/// norms over `n_heads` heads of a row).
pub fn rmsnorm_rows_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    let mut tmp = [0f32; 512];
    for row in x.chunks_exact_mut(n) {
        if n <= tmp.len() {
            rmsnorm(row, weight, eps, &mut tmp[..n]);
            row.copy_from_slice(&tmp[..n]);
        } else {
            let copy = row.to_vec();
            rmsnorm(&copy, weight, eps, row);
        }
    }
}

pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

#[cfg(test)]
mod gelu_tests {
    use super::*;

    /// Both paths agree with the tanh form of the approximation, including tails where
    /// `e^(−2u)` over- or underflows.
    #[test]
    fn gelu_matches_the_tanh_form() {
        let xs: Vec<f32> = (-4000..4000)
            .map(|i| i as f32 / 200.0)
            .chain([-100.0, -50.0, 50.0, 100.0, 0.0, -0.0])
            .collect();
        let up: Vec<f32> = xs
            .iter()
            .enumerate()
            .map(|(i, _)| 0.5 + (i % 7) as f32 / 7.0)
            .collect();
        let mut g = xs.clone();
        gelu_mul_in_place(&mut g, &up);
        for ((&x, &u), &got) in xs.iter().zip(&up).zip(&g) {
            let want =
                0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh()) * u;
            assert!(
                (got - want).abs() <= 2e-6 * want.abs().max(1.0),
                "x {x}: {got} vs {want}"
            );
            assert!(
                (gelu_scalar(x) * u - want).abs() <= 2e-6 * want.abs().max(1.0),
                "scalar x {x}"
            );
        }
    }
}
