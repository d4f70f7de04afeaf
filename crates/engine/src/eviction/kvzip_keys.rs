//! The keys one chunk's pass pieces are scored against (`kvzip_run.rs`), read from the pool
//! once each: the sinks' and the chunk's when the chunk's pass starts, each piece's own
//! pass tokens after it has run. Every piece needs all of them in the kernels' order; a
//! piece that read them again would read the chunk once per piece (a device pool copies
//! them to the host each time).
//!
//! The kernels' order puts the earlier pieces' keys before the chunk, so each piece's
//! keys are laid out anew; they go into one buffer that every piece of the run reuses.
//! A fresh buffer per piece cost more in page faults than the copy itself (SmolLM2 at
//! 2,048 tokens: scoring 1.13 s in pieces of 512 against 0.82 s in one pass).

use std::ops::Range;

use pk_model::KvBlocks;

/// Per (layer, KV head) unit, `[token][head_dim]` keys of the sinks, the chunk and the pass
/// tokens read so far.
pub(super) struct PieceKeys {
    head_dim: usize,
    n_units: usize,
    /// `[unit][sink][head_dim]` and `[unit][chunk token][head_dim]`.
    sinks: Vec<f32>,
    chunk: Vec<f32>,
    /// Per unit, the pass tokens' keys read so far.
    pass: Vec<Vec<f32>>,
    /// The last piece's keys in the kernels' order (see [`PieceKeys::piece`]).
    laid_out: Vec<f32>,
}

impl PieceKeys {
    /// Reads the keys of `sinks` and `chunk` (stored indices of `table`, a fork of the
    /// sequence whose context they are).
    pub fn for_chunk(
        store: &dyn KvBlocks,
        table: &[u32],
        sinks: Range<usize>,
        chunk: Range<usize>,
    ) -> Result<PieceKeys, String> {
        let g = store.geometry();
        let n_units = g.n_layers * g.n_kv_heads;
        Ok(PieceKeys {
            head_dim: g.head_dim,
            n_units,
            sinks: read_keys(store, table, sinks)?,
            chunk: read_keys(store, table, chunk)?,
            pass: vec![Vec::new(); n_units],
            laid_out: Vec::new(),
        })
    }

    /// Reads the keys of the pass tokens at stored indices `tokens` (the next ones).
    pub fn read_pass(
        &mut self,
        store: &dyn KvBlocks,
        table: &[u32],
        tokens: Range<usize>,
    ) -> Result<(), String> {
        let read = read_keys(store, table, tokens)?;
        let per_unit = read.len() / self.n_units.max(1);
        for (unit, keys) in self.pass.iter_mut().zip(read.chunks_exact(per_unit.max(1))) {
            unit.extend_from_slice(keys);
        }
        Ok(())
    }

    /// The keys of the piece of pass tokens `from..to` in the kernels' order, per unit
    /// (`[unit][span][head_dim]`): the sinks and the pass tokens before `from` (visible to
    /// every query of the piece, not scored), the chunk, then the piece's own. Returns them
    /// with how many come before the chunk.
    pub fn piece(&mut self, from: usize, to: usize) -> (&[f32], usize) {
        let hd = self.head_dim;
        let units = self.n_units.max(1);
        let (sink_len, chunk_len) = (self.sinks.len() / units, self.chunk.len() / units);
        self.laid_out.clear();
        for (u, pass) in self.pass.iter().enumerate() {
            self.laid_out
                .extend_from_slice(&self.sinks[u * sink_len..(u + 1) * sink_len]);
            self.laid_out.extend_from_slice(&pass[..from * hd]);
            self.laid_out
                .extend_from_slice(&self.chunk[u * chunk_len..(u + 1) * chunk_len]);
            self.laid_out.extend_from_slice(&pass[from * hd..to * hd]);
        }
        (&self.laid_out, sink_len / hd + from)
    }
}

/// The keys of stored indices `tokens` of `table`, `[unit][token][head_dim]` over every
/// (layer, KV head) unit.
fn read_keys(
    store: &dyn KvBlocks,
    table: &[u32],
    tokens: Range<usize>,
) -> Result<Vec<f32>, String> {
    let g = store.geometry();
    let (units, hd, n) = (g.n_layers * g.n_kv_heads, g.head_dim, tokens.len());
    if n == 0 {
        return Ok(Vec::new());
    }
    // `read_tokens` gives values too; the scores need keys only.
    let (mut k, mut v) = (vec![0f32; units * n * hd], vec![0f32; units * n * hd]);
    store
        .read_tokens(table, tokens.start, &mut k, &mut v)
        .map_err(|e| format!("reading the keys KVzip's pass scores against: {e}"))?;
    Ok(k)
}
