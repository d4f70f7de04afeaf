//! Elementwise and reduction kernels over contiguous f32 slices.
//!
//! These are written as plain loops over slices so that the compiler vectorises them;
//! they are not the bottleneck (matmul and attention are).

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

/// SwiGLU's gate: `gate = silu(gate) * up`.
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// GeGLU's gate (Gemma): `gate = gelu(gate) * up`, GELU in its tanh approximation, as
/// llama.cpp's `ggml_gelu` (which tabulates it in f16 on the CPU; this computes it in f32).
pub fn gelu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044_715;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh()) * u;
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
