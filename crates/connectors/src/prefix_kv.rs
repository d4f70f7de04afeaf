//! A sequence whose first prompt tokens are not computed but written from a given, possibly
//! compressed, KV ([`PrefixKv`], the connector a request brings in
//! `GenerateParams::prefix_kv`): the primitive under profiling, evaluation of stored
//! contexts, and the EVICPRESS connector's loads. Also the reverse: a computed prefix copied
//! out of the pool.
//!
//! NOTE: a compressed KV keeps its tokens' original positions, so a dropped context leaves
//! the block table dense while the query is placed after the context's full length; such a
//! sequence never feeds the pool's prefix cache or a connector (it is not what prefill
//! computes).

use std::sync::Arc;

use pk_codec::KvContext;
use pk_engine::{block_ids as table_of, KvConnector, Loaded, Lookup, RequestKey};
use pk_kv::{KvCacheManager, SeqId};
use pk_model::{Backend, KvBlocks, KvGeometry};

mod groups;

pub(crate) use groups::read_by_group;
use groups::{place_by_group, place_grouped};

/// A given KV for the first `kv.n_original_tokens` prompt tokens (stored tokens carry their
/// positions). Used by profiling, evaluation and the context store.
#[derive(Debug, Clone)]
pub struct PrefixKv {
    pub kv: KvContext,
}

impl PrefixKv {
    /// Prompt tokens this KV stands for.
    pub fn n_tokens(&self) -> usize {
        self.kv.n_original_tokens
    }

    /// `kv` as the connector a request brings (`GenerateParams::prefix_kv`).
    pub fn given(kv: KvContext) -> Arc<dyn KvConnector> {
        Arc::new(PrefixKv { kv })
    }
}

/// A given prefix starts its request whatever the pool holds: it is what the caller wants
/// measured (a compressed context under profiling), so it is always "loadable", never
/// exact, and never saved.
impl KvConnector for PrefixKv {
    fn lookup(&self, _request: RequestKey, _ids: &[u32], _salt: Option<&str>) -> Lookup {
        Lookup {
            loadable_tokens: self.n_tokens(),
            wants_save: false,
        }
    }

    fn load(
        &self,
        _request: RequestKey,
        _tokens: usize,
        _query: &[u32],
        kv: &mut KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> Option<Loaded> {
        place_context(&self.kv, kv, backend, seq).then(|| Loaded {
            tokens: self.n_tokens(),
            exact: false,
            wants_save: false,
            origin: None,
        })
    }

    fn save(
        &self,
        _request: RequestKey,
        _ids: &[u32],
        _computed: usize,
        _kv: &KvCacheManager,
        _backend: &mut dyn Backend,
        _seq: SeqId,
    ) -> bool {
        false
    }

    /// A whole context (every position, whatever its precision) is placed by group: its
    /// full-attention layers into the main table, its window layers' tail into the window
    /// tables; so is one stored by group (a window part), dropped or not. One with dropped
    /// tokens in every layer is not: its window layers miss positions the window tables
    /// would read.
    fn supports_kv_groups(&self) -> bool {
        is_whole(&self.kv) || self.kv.window.is_some()
    }

    /// Every token at its own position, with no window part (an engine with KV cache
    /// groups refuses evicting policies on its own).
    fn given_is_whole(&self) -> bool {
        is_whole(&self.kv) && self.kv.window.is_none()
    }

    fn check_given(&self, prompt_tokens: usize, g: &KvGeometry) -> Result<(), String> {
        let n = self.n_tokens();
        if n >= prompt_tokens || self.kv.positions.last().is_some_and(|&x| x as usize >= n) {
            return Err(format!(
                "prefix_kv covers {n} tokens of a {prompt_tokens}-token prompt"
            ));
        }
        let n_layers = self.kv.n_layers + self.kv.window.as_ref().map_or(0, |w| w.layers.len());
        let shape = (n_layers, self.kv.n_kv_heads, self.kv.head_dim);
        if shape != (g.n_layers, g.n_kv_heads, g.head_dim) {
            return Err("prefix_kv has another model's shape".into());
        }
        Ok(())
    }
}

/// Writes `ctx`'s stored tokens into `seq` (which must be empty), in order. Returns false
/// if the pool has no room or the shape is another model's (nothing is half-written that
/// the caller would use: it frees the sequence).
fn write_prefix(
    ctx: &KvContext,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
) -> bool {
    let g = store.geometry();
    let n = ctx.n_tokens();
    if ctx.n_layers != g.n_layers || ctx.n_kv_heads != g.n_kv_heads || ctx.head_dim != g.head_dim {
        return false;
    }
    if n > 0 && kv.allocate_slots(seq, n as u32).is_none() {
        return false;
    }
    let table = table_of(kv, seq);
    store.write_tokens(&table, 0, &ctx.k, &ctx.v);
    true
}

/// Writes `ctx` into `seq` (empty) the way the engine keeps KV: into one table, or by KV
/// cache group (a whole context, or one stored by group with a window part). Returns
/// false, having written nothing the caller would use (it frees the sequence), when the
/// pool has no room or `ctx` does not fit the engine's layout (a context stored by group
/// on an engine with one table: its window layers lack the positions behind the tail).
pub(crate) fn place_context(
    ctx: &KvContext,
    kv: &mut KvCacheManager,
    backend: &mut dyn Backend,
    seq: SeqId,
) -> bool {
    let groups = kv
        .window_spec()
        .and_then(|_| backend.config().kv_group_layout());
    match (groups, &ctx.window) {
        (None, None) => place_prefix(ctx, kv, backend.kv_mut(), seq),
        (None, Some(_)) => false,
        (Some(layout), None) => place_grouped(ctx, &layout, kv, backend.kv_mut(), seq),
        (Some(layout), Some(_)) => place_by_group(ctx, &layout, kv, backend.kv_mut(), seq),
    }
}

/// Writes `ctx` into `seq` (empty) as [`write_prefix`] does, then gives the block table the
/// stored tokens' original positions and the next token's (`n_original_tokens`), so the
/// query is placed after the context's full length. Returns false, having written nothing
/// the caller would use (it frees the sequence), when the pool has no room or `ctx` breaks
/// its invariants (a caller's hand-made KV).
pub(crate) fn place_prefix(
    ctx: &KvContext,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
) -> bool {
    let next = ctx.n_original_tokens;
    if ctx.validate().is_err() || ctx.positions.last().is_some_and(|&p| p as usize >= next) {
        return false;
    }
    if !write_prefix(ctx, kv, store, seq) {
        return false;
    }
    kv.set_positions(seq, ctx.positions.clone(), next as u64);
    true
}

/// Whether `ctx` holds every position of its context, in order (a quantised context does;
/// one with dropped tokens does not).
pub(crate) fn is_whole(ctx: &KvContext) -> bool {
    ctx.n_tokens() == ctx.n_original_tokens
        && ctx
            .positions
            .iter()
            .enumerate()
            .all(|(i, &p)| p as usize == i)
}

/// Copies the first `n_tokens` stored tokens of `seq` (not evicted, so stored index =
/// position) out of the pool.
pub(crate) fn read_prefix(
    kv: &KvCacheManager,
    store: &dyn KvBlocks,
    seq: SeqId,
    n_tokens: usize,
) -> Option<KvContext> {
    let g = store.geometry();
    // The view trusts the count it is given; the sequence must really store that many.
    if kv
        .block_table(seq)
        .map_or(0, |t| t.num_stored_tokens() as usize)
        < n_tokens
    {
        return None;
    }
    let table = table_of(kv, seq);
    let d = g.head_dim;
    let len = g.n_layers * g.n_kv_heads * n_tokens * d;
    let (mut k, mut v) = (vec![0f32; len], vec![0f32; len]);
    if let Err(e) = store.read_tokens(&table, 0, &mut k, &mut v) {
        tracing::warn!("reading a context out of the KV pool failed, not offering it: {e}");
        return None;
    }
    KvContext::new(
        g.n_layers,
        g.n_kv_heads,
        d,
        (0..n_tokens as u32).collect(),
        k,
        v,
    )
    .ok()
}
