//! The keys one chunk's pass pieces are scored against (`kvzip_run.rs`), read from the pool
//! once each: the sinks' and the chunk's when the chunk's pass starts, each piece's own
//! pass tokens after it has run. Every piece needs all of them in the kernels' order; a
//! piece that read them again would read the chunk once per piece (a device pool copies
//! them to the host each time).

use std::ops::Range;

use pk_model::KvBlocks;

/// Per (layer, KV head) unit, `[token][head_dim]` keys of the sinks, the chunk and the pass
/// tokens read so far.
pub(super) struct PieceKeys {
    head_dim: usize,
    sinks: Vec<Vec<f32>>,
    chunk: Vec<Vec<f32>>,
    pass: Vec<Vec<f32>>,
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
        Ok(PieceKeys {
            head_dim: g.head_dim,
            sinks: read_keys(store, table, sinks)?,
            chunk: read_keys(store, table, chunk)?,
            pass: vec![Vec::new(); g.n_layers * g.n_kv_heads],
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
        for (unit, keys) in self.pass.iter_mut().zip(read) {
            unit.extend_from_slice(&keys);
        }
        Ok(())
    }

    /// The keys of the piece of pass tokens `from..to` in the kernels' order, per unit
    /// (`[unit][span][head_dim]`): the sinks and the pass tokens before `from` (visible to
    /// every query of the piece, not scored), the chunk, then the piece's own. Returns them
    /// with how many come before the chunk.
    pub fn piece(&self, from: usize, to: usize) -> (Vec<f32>, usize) {
        let hd = self.head_dim;
        let n_sink = self.sinks.first().map_or(0, |s| s.len() / hd);
        let mut keys = Vec::new();
        for ((sinks, chunk), pass) in self.sinks.iter().zip(&self.chunk).zip(&self.pass) {
            keys.extend_from_slice(sinks);
            keys.extend_from_slice(&pass[..from * hd]);
            keys.extend_from_slice(chunk);
            keys.extend_from_slice(&pass[from * hd..to * hd]);
        }
        (keys, n_sink + from)
    }
}

/// The keys of stored indices `tokens` of `table`, one `[token][head_dim]` vector per
/// (layer, KV head).
fn read_keys(
    store: &dyn KvBlocks,
    table: &[u32],
    tokens: Range<usize>,
) -> Result<Vec<Vec<f32>>, String> {
    let g = store.geometry();
    let (units, hd, n) = (g.n_layers * g.n_kv_heads, g.head_dim, tokens.len());
    if n == 0 {
        return Ok(vec![Vec::new(); units]);
    }
    let (mut k, mut v) = (vec![0f32; units * n * hd], vec![0f32; units * n * hd]);
    store
        .read_tokens(table, tokens.start, &mut k, &mut v)
        .map_err(|e| format!("reading the keys KVzip's pass scores against: {e}"))?;
    Ok(k.chunks_exact(n * hd).map(<[f32]>::to_vec).collect())
}
