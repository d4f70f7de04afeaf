//! Matrix multiplication of quantised weights by f32 activations.
//!
//! `out[t][r] = Σ_c W[r][c] · x[t][c]` for a weight matrix W stored row-major in one of
//! the GGML block formats (each row a whole number of blocks). The reference path
//! dequantises one weight row at a time into a small buffer and reuses it for every
//! token of the batch, so a batch of n tokens reads the weights once.

use pk_gguf::{dequantize, GgmlType};
use rayon::prelude::*;

use super::ops::dot_f32;

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
pub fn matmul(w: &QMatrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    matmul_reference(w, x, n_tokens, out)
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
    for (task, tile) in tiles.iter().enumerate() {
        let r0 = task * ROWS_PER_TASK;
        let nr = tile.len() / n_tokens.max(1);
        for i in 0..nr {
            for t in 0..n_tokens {
                out[t * w.rows + r0 + i] = tile[i * n_tokens + t];
            }
        }
    }
}
