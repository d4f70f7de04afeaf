//! Read access to one sequence's keys, values and recent queries, without a tensor type.
//!
//! The engine owns the K/V bytes (`pk-model`'s `KvStore`, f16 or f32, laid out
//! `[block][kv_head][slot][head_dim]` per layer) and implements `KvView` over a sequence's
//! block table; policies read one vector at a time into an `f32` buffer they own. The
//! queries are not stored anywhere: the engine keeps the few a policy asks for
//! (`QueryNeed`) while it computes them, and hands them over through `QueryView`.
//!
//! `DenseKv` and `DenseQueries` are plain `Vec`-backed implementations, for tests and for
//! callers that already hold dense arrays.

/// The stored keys and values of one sequence, in stored order (stored token `i` lives in
/// slot `(block_table[i / B], i % B)`; see the crate docs).
pub trait KvView {
    fn n_layers(&self) -> usize;
    fn n_kv_heads(&self) -> usize;
    fn head_dim(&self) -> usize;
    /// Stored tokens visible to the policy: `0 .. n_tokens()`.
    fn n_tokens(&self) -> usize;
    /// Writes the key of stored token `token` (post-RoPE, as stored) into `out`
    /// (`head_dim` floats).
    fn key(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]);
    /// Writes the value of stored token `token` into `out` (`head_dim` floats).
    fn value(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]);
}

/// Some query vectors (post-RoPE, as the attention kernel used them) of one sequence, for
/// the policies that score tokens by attention (SnapKV, H2O, TOVA, ExpectedAttention).
/// The layer count and head dimension are the `KvView`'s.
pub trait QueryView {
    fn n_queries(&self) -> usize;
    /// Query heads; the GQA group size is `n_heads() / KvView::n_kv_heads()`, and query
    /// head `h` reads KV head `h / group`.
    fn n_heads(&self) -> usize;
    /// Writes query `q` of head `head` in `layer` into `out` (`head_dim` floats).
    fn query(&self, layer: usize, head: usize, q: usize, out: &mut [f32]);
    /// Stored index of query `q`'s own token, in the same numbering as the `KvView` it is
    /// passed with. Attention is causal: the query sees stored tokens `0 ..= position`.
    fn query_position(&self, q: usize) -> usize;
}

/// Keys and values in plain vectors, laid out `[layer][kv_head][token][head_dim]`.
#[derive(Clone, Debug)]
pub struct DenseKv {
    n_layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    n_tokens: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl DenseKv {
    /// Fills every key and value with `fill(layer, kv_head, token, key, value)`.
    pub fn from_fn(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        n_tokens: usize,
        mut fill: impl FnMut(usize, usize, usize, &mut [f32], &mut [f32]),
    ) -> Self {
        let len = n_layers * n_kv_heads * n_tokens * head_dim;
        let mut keys = vec![0.0; len];
        let mut values = vec![0.0; len];
        for layer in 0..n_layers {
            for kv_head in 0..n_kv_heads {
                for token in 0..n_tokens {
                    let start = ((layer * n_kv_heads + kv_head) * n_tokens + token) * head_dim;
                    let range = start..start + head_dim;
                    fill(
                        layer,
                        kv_head,
                        token,
                        &mut keys[range.clone()],
                        &mut values[range],
                    );
                }
            }
        }
        DenseKv {
            n_layers,
            n_kv_heads,
            head_dim,
            n_tokens,
            keys,
            values,
        }
    }

    fn offset(&self, layer: usize, kv_head: usize, token: usize) -> usize {
        assert!(
            layer < self.n_layers && kv_head < self.n_kv_heads && token < self.n_tokens,
            "DenseKv: (layer {layer}, kv head {kv_head}, token {token}) out of range"
        );
        ((layer * self.n_kv_heads + kv_head) * self.n_tokens + token) * self.head_dim
    }
}

impl KvView for DenseKv {
    fn n_layers(&self) -> usize {
        self.n_layers
    }
    fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    fn head_dim(&self) -> usize {
        self.head_dim
    }
    fn n_tokens(&self) -> usize {
        self.n_tokens
    }
    fn key(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let start = self.offset(layer, kv_head, token);
        out.copy_from_slice(&self.keys[start..start + self.head_dim]);
    }
    fn value(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let start = self.offset(layer, kv_head, token);
        out.copy_from_slice(&self.values[start..start + self.head_dim]);
    }
}

/// Queries in a plain vector, laid out `[layer][head][query][head_dim]`, with the stored
/// position of each query's token.
#[derive(Clone, Debug)]
pub struct DenseQueries {
    n_layers: usize,
    n_heads: usize,
    head_dim: usize,
    positions: Vec<usize>,
    data: Vec<f32>,
}

impl DenseQueries {
    /// One query per entry of `positions`; fills query `q` of `head` in `layer` with
    /// `fill(layer, head, positions[q], out)`.
    pub fn from_fn(
        n_layers: usize,
        n_heads: usize,
        head_dim: usize,
        positions: Vec<usize>,
        mut fill: impl FnMut(usize, usize, usize, &mut [f32]),
    ) -> Self {
        let n_queries = positions.len();
        let mut data = vec![0.0; n_layers * n_heads * n_queries * head_dim];
        for layer in 0..n_layers {
            for head in 0..n_heads {
                for (q, &position) in positions.iter().enumerate() {
                    let start = ((layer * n_heads + head) * n_queries + q) * head_dim;
                    fill(layer, head, position, &mut data[start..start + head_dim]);
                }
            }
        }
        DenseQueries {
            n_layers,
            n_heads,
            head_dim,
            positions,
            data,
        }
    }
}

impl QueryView for DenseQueries {
    fn n_queries(&self) -> usize {
        self.positions.len()
    }
    fn n_heads(&self) -> usize {
        self.n_heads
    }
    fn query(&self, layer: usize, head: usize, q: usize, out: &mut [f32]) {
        assert!(
            layer < self.n_layers && head < self.n_heads && q < self.positions.len(),
            "DenseQueries: (layer {layer}, head {head}, query {q}) out of range"
        );
        let start = ((layer * self.n_heads + head) * self.positions.len() + q) * self.head_dim;
        out.copy_from_slice(&self.data[start..start + self.head_dim]);
    }
    fn query_position(&self, q: usize) -> usize {
        self.positions[q]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_kv_reads_back_what_it_was_filled_with() {
        let kv = DenseKv::from_fn(2, 3, 2, 5, |layer, head, token, k, v| {
            k[0] = (layer * 100 + head * 10 + token) as f32;
            k[1] = -k[0];
            v[0] = token as f32;
            v[1] = 0.5;
        });
        let mut out = [0.0; 2];
        kv.key(1, 2, 4, &mut out);
        assert_eq!(out, [124.0, -124.0]);
        kv.value(0, 1, 3, &mut out);
        assert_eq!(out, [3.0, 0.5]);
        assert_eq!(
            (kv.n_layers(), kv.n_kv_heads(), kv.head_dim(), kv.n_tokens()),
            (2, 3, 2, 5)
        );
    }

    #[test]
    fn dense_queries_keep_positions() {
        let queries = DenseQueries::from_fn(1, 2, 1, vec![7, 9], |_, head, position, out| {
            out[0] = (head * 100 + position) as f32;
        });
        let mut out = [0.0; 1];
        queries.query(0, 1, 1, &mut out);
        assert_eq!(out, [109.0]);
        assert_eq!(queries.query_position(0), 7);
        assert_eq!(queries.n_queries(), 2);
    }
}
