//! Matrix multiplication of quantised weights by f32 activations.
//!
//! `out[t][r] = Σ_c W[r][c] · x[t][c]` for a weight matrix W stored row-major in one of
//! the GGML block formats (each row a whole number of blocks). The reference path
//! dequantises one weight row at a time into a small buffer and reuses it for every
//! token of the batch, so a batch of n tokens reads the weights once.

use pk_gguf::{dequantize, GgmlType};
use rayon::prelude::*;

use super::ops::dot_f32;
use super::q8::{self, Q8Acts};

/// A weight matrix in a GGML block format: `rows` output features of `cols` inputs each.
#[derive(Clone)]
pub struct QMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
}

impl QMatrix {
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> QMatrix {
        let row_bytes = ty.row_bytes(cols).expect("row length is a whole number of blocks");
        assert_eq!(data.len(), rows * row_bytes, "weight data size");
        QMatrix { ty, rows, cols, data }
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows
    }

    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Dequantises row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize(self.ty, self.row(r), out);
    }
}

/// Rows per parallel work item: large enough to amortise scheduling, small enough that
/// the two threads of this machine stay balanced when one of them is descheduled.
const ROWS_PER_TASK: usize = 64;

/// `out[t * w.rows + r] = dot(W[r], x[t * w.cols ..])` for t in 0..n_tokens.
///
/// Formats with 32-element blocks take llama.cpp's path: activations quantised to 8-bit
/// blocks once per call, then integer dot products; other formats dequantise.
pub fn matmul(w: &QMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let dot: fn(&[u8], &Q8Acts, usize) -> f32 = match w.ty {
        GgmlType::Q4_0 => q8::dot_q4_0,
        GgmlType::Q4_1 => q8::dot_q4_1,
        GgmlType::Q5_0 => q8::dot_q5_0,
        GgmlType::Q8_0 => q8::dot_q8_0,
        _ => return matmul_reference(w, x, n_tokens, out),
    };
    assert_eq!(x.len(), n_tokens * w.cols);
    assert_eq!(out.len(), n_tokens * w.rows);
    let mut acts = Q8Acts::default();
    acts.quantize(x);
    let blocks_per_row = w.cols / q8::QK;
    let n_tasks = w.rows.div_ceil(ROWS_PER_TASK);
    let tiles: Vec<Vec<f32>> = (0..n_tasks)
        .into_par_iter()
        .map(|task| {
            let r0 = task * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(w.rows);
            let mut tile = vec![0f32; (r1 - r0) * n_tokens];
            for r in r0..r1 {
                let row = w.row(r);
                for t in 0..n_tokens {
                    tile[(r - r0) * n_tokens + t] = dot(row, &acts, t * blocks_per_row);
                }
            }
            tile
        })
        .collect();
    scatter(&tiles, w.rows, n_tokens, out);
}

/// Writes row-major `[rows_in_task × n_tokens]` tiles into the token-major output.
fn scatter(tiles: &[Vec<f32>], rows: usize, n_tokens: usize, out: &mut [f32]) {
    for (task, tile) in tiles.iter().enumerate() {
        let r0 = task * ROWS_PER_TASK;
        let nr = tile.len() / n_tokens.max(1);
        for i in 0..nr {
            for t in 0..n_tokens {
                out[t * rows + r0 + i] = tile[i * n_tokens + t];
            }
        }
    }
}

/// The portable reference: dequantise a row, dot it with every token.
pub fn matmul_reference(w: &QMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    assert_eq!(x.len(), n_tokens * w.cols);
    assert_eq!(out.len(), n_tokens * w.rows);
    let n_tasks = w.rows.div_ceil(ROWS_PER_TASK);
    // Each task computes a [rows_in_task × n_tokens] tile (transposed), then the tiles are
    // scattered into the token-major output; the scatter is O(output) and cheap.
    let tiles: Vec<Vec<f32>> = (0..n_tasks)
        .into_par_iter()
        .map(|task| {
            let r0 = task * ROWS_PER_TASK;
            let r1 = (r0 + ROWS_PER_TASK).min(w.rows);
            let mut row = vec![0f32; w.cols];
            let mut tile = vec![0f32; (r1 - r0) * n_tokens];
            for r in r0..r1 {
                w.dequantize_row(r, &mut row);
                for t in 0..n_tokens {
                    tile[(r - r0) * n_tokens + t] = dot_f32(&row, &x[t * w.cols..(t + 1) * w.cols]);
                }
            }
            tile
        })
        .collect();
    scatter(&tiles, w.rows, n_tokens, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random Q4_1 / Q8_0 weights with valid f16 scales.
    fn random_weights(rng: &mut impl Rng, ty: GgmlType, rows: usize, cols: usize) -> QMatrix {
        let mut data = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
        rng.fill(&mut data[..]);
        let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for blk in data.chunks_exact_mut(ty.block_bytes()) {
            blk[0..2].copy_from_slice(&h(rng.gen_range(0.001..0.02)));
            if ty == GgmlType::Q4_1 {
                blk[2..4].copy_from_slice(&h(rng.gen_range(-0.1..0.0)));
            }
        }
        QMatrix::new(ty, rows, cols, data)
    }

    /// The 8-bit activation path agrees with exact dequantise-and-dot up to the activation
    /// rounding (half a step of amax/127 per element), including rows with one large outlier
    /// like SmolLM2's attention-sink token.
    #[test]
    fn q8_path_matches_reference_within_activation_rounding() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
            let (rows, cols, n) = (70, 96, 5);
            let w = random_weights(&mut rng, ty, rows, cols);
            let mut x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            x[2 * cols + 7] = 300.0;
            let (mut got, mut want) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            matmul(&w, &x, n, &mut got);
            matmul_reference(&w, &x, n, &mut want);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.dequantize_row(r, &mut row);
                for t in 0..n {
                    // |Σ w·δx| ≤ Σ|w|·(step/2), step = block amax/127 (plus f16 rounding of d and s).
                    let xt = &x[t * cols..(t + 1) * cols];
                    let tol: f32 = row.chunks(32).zip(xt.chunks(32)).map(|(wb, xb)| {
                        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                        wb.iter().map(|v| v.abs()).sum::<f32>() * amax / 127.0 * 0.51 + 2e-3 * amax
                    }).sum::<f32>() + 1e-4;
                    let (g, e) = (got[t * rows + r], want[t * rows + r]);
                    assert!((g - e).abs() <= tol, "{ty:?} row {r} token {t}: {g} vs {e} (tol {tol})");
                }
            }
        }
    }
}
