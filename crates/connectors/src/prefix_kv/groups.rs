//! Contexts in and out of an engine that keeps KV cache groups (`pk_kv::window`): a whole
//! context placed by group, and a context stored by group (`KvContext::window`: every
//! full-attention layer of its kept tokens, the sliding-window layers' tail window only)
//! read out of the pool and placed back, dropped tokens and all.

use pk_codec::{KvContext, WindowKv};
use pk_engine::block_ids as table_of;
use pk_kv::{KvCacheManager, SeqId};
use pk_model::{KvBlocks, KvGroupLayout};

use super::is_whole;
use crate::tiering::groups::{
    all_held, layers_by_kind, read_layers, window_layer_tables, write_layers, LayerTable,
};

/// Writes a whole context (`is_whole`) into `seq` (empty) on an engine with the KV cache
/// groups of `layout`: every token's full-attention layers into the main table, and the
/// window layers of the positions the next token sees into the window tables (the blocks
/// behind are released first, so every window block still held is written). Returns
/// false, having written nothing the caller would use, when the pool has no room or `ctx`
/// is not a whole context of this model.
pub(super) fn place_grouped(
    ctx: &KvContext,
    layout: &KvGroupLayout,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
) -> bool {
    let g = store.geometry();
    let n = ctx.n_tokens();
    let shape = (ctx.n_layers, ctx.n_kv_heads, ctx.head_dim);
    if ctx.validate().is_err() || !is_whole(ctx) || shape != (g.n_layers, g.n_kv_heads, g.head_dim)
    {
        return false;
    }
    // In steps, so that the window tables release what falls behind as they go.
    let step_tokens = layout.window_tokens.max(g.block_size_tokens);
    for first in (0..n).step_by(step_tokens) {
        if kv
            .allocate_slots(seq, (n - first).min(step_tokens) as u32)
            .is_none()
        {
            return false;
        }
    }
    kv.release_window_blocks_behind(seq, n as u64);
    let (full, window) = layers_by_kind(layout);
    let table = table_of(kv, seq);
    let full_tables: Vec<LayerTable<'_>> = full.iter().map(|&l| (l, &table[..])).collect();
    let (k, v) = layer_rows(ctx, &full, 0, n);
    write_layers(store, &full_tables, 0, n, &k, &v);
    let bs = g.block_size_tokens;
    let tail = (n + 1).saturating_sub(layout.window_tokens) / bs * bs;
    let window_tables = window_layer_tables(&window, kv, seq);
    let window_ids: Vec<usize> = window.iter().map(|&(l, _)| l).collect();
    let (k, v) = layer_rows(ctx, &window_ids, tail, n - tail);
    write_layers(store, &window_tables, tail, n - tail, &k, &v);
    true
}

/// K and V of `layers` (in that order) for stored tokens `[first, first + count)` of `ctx`,
/// in a stored context's layout.
fn layer_rows(
    ctx: &KvContext,
    layers: &[usize],
    first: usize,
    count: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (n, hd) = (ctx.n_tokens(), ctx.head_dim);
    let mut k = Vec::with_capacity(layers.len() * ctx.n_kv_heads * count * hd);
    let mut v = Vec::with_capacity(k.capacity());
    for &l in layers {
        for h in 0..ctx.n_kv_heads {
            let row0 = (l * ctx.n_kv_heads + h) * n + first;
            k.extend_from_slice(&ctx.k[row0 * hd..(row0 + count) * hd]);
            v.extend_from_slice(&ctx.v[row0 * hd..(row0 + count) * hd]);
        }
    }
    (k, v)
}

/// The first position of the tail window a token at `next_position` sees.
fn tail_start(layout: &KvGroupLayout, next_position: usize) -> usize {
    (next_position + 1).saturating_sub(layout.window_tokens)
}

/// Writes a context stored by group (`ctx.window` set) into `seq` (empty): its kept
/// tokens' full-attention layers into the main table at their original positions, its
/// window part into the window tables, which hold only the window of the next token
/// (`KvCacheManager::allocate_placed`). Returns false, having written nothing the caller
/// would use, when the pool has no room or `ctx` is not stored by this layout.
pub(super) fn place_by_group(
    ctx: &KvContext,
    layout: &KvGroupLayout,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
) -> bool {
    let Some(w) = ctx.window.as_deref() else {
        return false;
    };
    let g = store.geometry();
    let (full, window) = layers_by_kind(layout);
    let next = ctx.n_original_tokens;
    let fits = ctx.validate().is_ok()
        && (ctx.n_layers, ctx.n_kv_heads, ctx.head_dim) == (full.len(), g.n_kv_heads, g.head_dim)
        && w.layers
            .iter()
            .map(|&l| l as usize)
            .eq(window.iter().map(|&(l, _)| l))
        && w.kv.n_tokens() >= next - tail_start(layout, next)
        && ctx.positions.last().is_none_or(|&p| (p as usize) < next);
    if !fits || !kv.allocate_placed(seq, ctx.positions.clone(), next as u64) {
        return false;
    }
    let table = table_of(kv, seq);
    let full_tables: Vec<LayerTable<'_>> = full.iter().map(|&l| (l, &table[..])).collect();
    write_layers(store, &full_tables, 0, ctx.n_tokens(), &ctx.k, &ctx.v);
    let window_tables = window_layer_tables(&window, kv, seq);
    let first = w.kv.positions[0] as usize;
    write_layers(
        store,
        &window_tables,
        first,
        w.kv.n_tokens(),
        &w.kv.k,
        &w.kv.v,
    );
    true
}

/// The first `n_tokens` positions of `seq` (not evicted, so stored index = position) read
/// out by group: every full-attention layer, and the sliding-window layers' tail window that
/// a token at `n_tokens` sees. `None` when a block of that window has already left the
/// window tables (the caller read too late: the pool releases them as prefill moves on) or
/// the read fails.
pub(crate) fn read_by_group(
    kv: &KvCacheManager,
    store: &dyn KvBlocks,
    layout: &KvGroupLayout,
    seq: SeqId,
    n_tokens: usize,
) -> Option<KvContext> {
    let g = store.geometry();
    let stored = kv
        .block_table(seq)
        .map_or(0, |t| t.num_stored_tokens() as usize);
    if stored < n_tokens || n_tokens == 0 {
        return None;
    }
    let (full, window) = layers_by_kind(layout);
    let first = tail_start(layout, n_tokens);
    let window_tables = window_layer_tables(&window, kv, seq);
    if !all_held(&window_tables, first, n_tokens - first, g.block_size_tokens) {
        return None;
    }
    let table = table_of(kv, seq);
    let full_tables: Vec<LayerTable<'_>> = full.iter().map(|&l| (l, &table[..])).collect();
    let read = |layers: &[LayerTable<'_>], first: usize, n: usize| {
        let len = layers.len() * g.n_kv_heads * n * g.head_dim;
        let (mut k, mut v) = (vec![0f32; len], vec![0f32; len]);
        match read_layers(store, layers, first, n, &mut k, &mut v) {
            Ok(()) => Some((k, v)),
            Err(e) => {
                tracing::warn!("reading a context out of the KV pool failed: {e}");
                None
            }
        }
    };
    let (k, v) = read(&full_tables, 0, n_tokens)?;
    let (wk, wv) = read(&window_tables, first, n_tokens - first)?;
    let d = (g.n_kv_heads, g.head_dim);
    let tail = KvContext::new(
        window.len(),
        d.0,
        d.1,
        (first as u32..n_tokens as u32).collect(),
        wk,
        wv,
    )
    .ok()?;
    let mut ctx =
        KvContext::new(full.len(), d.0, d.1, (0..n_tokens as u32).collect(), k, v).ok()?;
    ctx.window = Some(Box::new(WindowKv {
        layers: window.iter().map(|&(l, _)| l as u32).collect(),
        kv: tail,
    }));
    ctx.validate().ok()?;
    Some(ctx)
}
