//! The chunk tiers for an engine with KV cache groups (Gemma 3: full-attention layers in the
//! sequence's main table, sliding-window layers in position-indexed tables of their own
//! that release every block behind the window, `pk_kv::window`).
//!
//! What is stored: every chunk's full-attention layers under its chunk key, as one payload
//! of those layers; the sliding-window layers only where a hit can use them, under the
//! chunk key's `window_layers()` key. A hit of `k` chunks (the next token to compute at
//! position `k·C`) needs the window layers of the positions that token sees,
//! `[k·C + 1 − W, k·C)`: the chunks from `first_window_chunk(k)` to `k − 1`. Those are
//! stored for the prompt's last whole chunk (its trailing window) and at checkpoints every
//! `checkpoint_chunks` chunks, so that a later prompt sharing only a prefix (the same
//! document with another question) still hits at the last checkpoint inside it.
//!
//! The hit rule: the longest `k` for which every chunk `0..k` has its full-attention
//! payload and every chunk its window needs has its window payload. Missing window KV
//! makes a hit shorter, never wrong.
//!
//! The pool releases window blocks as the prompt advances, so the connector copies a
//! checkpoint's window out after the prefill step that computed it, before the next step
//! allocates (and releases): it asks to be called after every prefill step
//! (`saves_during_prefill`). A window block that was released before it could be copied (a
//! prefix adopted from the pool's own cache holds only the blocks its first new token
//! sees) is never read: that checkpoint is skipped and counted.

use pk_engine::block_ids as table_of;
use pk_kv::{KvCacheManager, SeqId, RELEASED};
use pk_model::{BackendError, KvBlocks, KvGroupLayout};
use pk_tiers::ChunkKey;

use super::{lock, Queued, RequestChunks, Tiering};

/// The stored layout for one engine's KV cache groups and chunk size.
#[derive(Clone, Debug)]
pub(crate) struct GroupedChunks {
    /// The full-attention layers, in layer order (group 0, the main table).
    pub full_layers: Vec<usize>,
    /// The sliding-window layers, in layer order, each with its window group (1..).
    pub window_layers: Vec<(usize, usize)>,
    pub window_tokens: usize,
    pub chunk_tokens: usize,
    /// Checkpoints every this many chunks (a multiple of no other setting).
    pub checkpoint_chunks: usize,
}

impl GroupedChunks {
    /// The stored layout for `layout`, in chunks of `chunk_tokens` with window checkpoints
    /// every `checkpoint_tokens` (a positive multiple of the chunk size).
    pub fn new(
        layout: &KvGroupLayout,
        chunk_tokens: usize,
        checkpoint_tokens: usize,
    ) -> Result<GroupedChunks, String> {
        if !layout.window_tokens.is_multiple_of(chunk_tokens) {
            // A hit needs whole chunks of window KV from `k·C − W` on; a chunk that starts
            // before the first position a prefill step still holds could never be copied.
            return Err(format!(
                "with KV cache groups the chunk size (--tier-chunk-tokens, {chunk_tokens} tokens) must divide the sliding window ({} tokens), or use --disable-hybrid-kv-cache-manager",
                layout.window_tokens
            ));
        }
        if checkpoint_tokens == 0 || !checkpoint_tokens.is_multiple_of(chunk_tokens) {
            return Err(format!(
                "the window checkpoint interval ({checkpoint_tokens} tokens) must be a positive multiple of the chunk size ({chunk_tokens} tokens)"
            ));
        }
        let (full_layers, window_layers) = layers_by_kind(layout);
        Ok(GroupedChunks {
            full_layers,
            window_layers,
            window_tokens: layout.window_tokens,
            chunk_tokens,
            checkpoint_chunks: checkpoint_tokens / chunk_tokens,
        })
    }

    /// The first chunk whose window layers a hit of `k` chunks needs.
    pub fn first_window_chunk(&self, k: usize) -> usize {
        (k * self.chunk_tokens + 1).saturating_sub(self.window_tokens) / self.chunk_tokens
    }

    /// The hits a prompt of `n` whole chunks stores the window for: every checkpoint inside
    /// it and its end, in increasing order.
    pub fn hit_points(&self, n: usize) -> Vec<usize> {
        let mut points: Vec<usize> = (1..=n)
            .filter(|k| k.is_multiple_of(self.checkpoint_chunks))
            .collect();
        if n > 0 && points.last() != Some(&n) {
            points.push(n);
        }
        points
    }

    /// The longest hit of at most `found` chunks (whose full-attention payloads are all
    /// stored) for which every window chunk it needs is present (`window_present[j]`).
    pub fn longest_hit(&self, found: usize, window_present: &[bool]) -> usize {
        (1..=found)
            .rev()
            .find(|&k| {
                window_present[self.first_window_chunk(k)..k]
                    .iter()
                    .all(|&p| p)
            })
            .unwrap_or(0)
    }
}

/// The full-attention layers of `layout` (group 0, the main table), in layer order, and
/// the sliding-window layers with their window group (1..).
pub(crate) fn layers_by_kind(layout: &KvGroupLayout) -> (Vec<usize>, Vec<(usize, usize)>) {
    let groups = layout.layer_group.iter().copied().enumerate();
    let full = groups
        .clone()
        .filter(|&(_, g)| g == 0)
        .map(|(l, _)| l)
        .collect();
    (full, groups.filter(|&(_, g)| g > 0).collect())
}

/// The payload a grouped load could not fetch or decode: a chunk's window layers or its
/// full-attention layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failed {
    Window(usize),
    Full(usize),
}

/// One layer and the block table (position-indexed, `RELEASED` where a block left) that
/// holds it.
pub(crate) type LayerTable<'a> = (usize, &'a [u32]);

/// Each sliding-window layer of `window_layers` (layer, window group) with `seq`'s table of
/// its group.
pub(crate) fn window_layer_tables<'a>(
    window_layers: &[(usize, usize)],
    kv: &'a KvCacheManager,
    seq: SeqId,
) -> Vec<LayerTable<'a>> {
    let tables = kv
        .window_tables(seq)
        .expect("an engine with KV cache groups");
    window_layers
        .iter()
        .map(|&(l, group)| (l, &tables[group - 1][..]))
        .collect()
}

/// Whether every block of positions `[first, first + n)` is held in each table.
pub(crate) fn all_held(layers: &[LayerTable<'_>], first: usize, n: usize, bs: usize) -> bool {
    let blocks = first / bs..(first + n).div_ceil(bs);
    layers.iter().all(|(_, table)| {
        blocks.end <= table.len() && table[blocks.clone()].iter().all(|&b| b != RELEASED)
    })
}

/// Reads positions `[first, first + n)` of `layers` into `k` and `v` in a stored context's
/// layout (`[layer][kv_head][token][head_dim]`, layers in the given order). Every block
/// must be held (`all_held`). It reads through `KvBlocks::read_k`/`read_v`, which cannot
/// report a device failure: only the CPU store keeps KV cache groups today (a GPU backend
/// refuses `use_kv_groups`); one that keeps them must get a fallible grouped read first.
pub(crate) fn read_layers(
    store: &dyn KvBlocks,
    layers: &[LayerTable<'_>],
    first: usize,
    n: usize,
    k: &mut [f32],
    v: &mut [f32],
) -> Result<(), BackendError> {
    let g = store.geometry();
    let (hd, bs) = (g.head_dim, g.block_size_tokens);
    debug_assert!(all_held(layers, first, n, bs));
    let mut buf = vec![0f32; bs * hd];
    for (i, (layer, table)) in layers.iter().enumerate() {
        for h in 0..g.n_kv_heads {
            let lh = i * g.n_kv_heads + h;
            for (t0, t1) in pk_model::block_runs(first, n, bs) {
                let (s0, s1) = (t0 % bs, t0 % bs + (t1 - t0));
                let out = (lh * n + t0 - first) * hd..(lh * n + t1 - first) * hd;
                store.read_k(*layer, table[t0 / bs], h, &mut buf[..s1 * hd]);
                k[out.clone()].copy_from_slice(&buf[s0 * hd..s1 * hd]);
                store.read_v(*layer, table[t0 / bs], h, &mut buf[..s1 * hd]);
                v[out].copy_from_slice(&buf[s0 * hd..s1 * hd]);
            }
        }
    }
    Ok(())
}

/// Writes positions `[first, first + n)` of `layers` from `k` and `v` (the layout of
/// `read_layers`), skipping every block a table no longer holds (no later token reads
/// it). Returns the blocks written, over all layers.
pub(crate) fn write_layers(
    store: &mut dyn KvBlocks,
    layers: &[LayerTable<'_>],
    first: usize,
    n: usize,
    k: &[f32],
    v: &[f32],
) -> usize {
    let g = store.geometry();
    let (hd, bs) = (g.head_dim, g.block_size_tokens);
    let mut scratch = Vec::new();
    let mut written = 0;
    for (i, (layer, table)) in layers.iter().enumerate() {
        for (t0, t1) in pk_model::block_runs(first, n, bs) {
            let block = table[t0 / bs];
            if block == RELEASED {
                continue;
            }
            written += 1;
            for h in 0..g.n_kv_heads {
                let lh = i * g.n_kv_heads + h;
                let rows = (lh * n + t0 - first) * hd..(lh * n + t1 - first) * hd;
                store.write_head_rows(
                    *layer,
                    block,
                    h,
                    t0 % bs,
                    &k[rows.clone()],
                    &v[rows],
                    &mut scratch,
                );
            }
        }
    }
    written
}

impl Tiering {
    /// The longest hit for `r`'s keys, of which the tiers hold the full-attention layers of
    /// the first `found` chunks: asks which of those chunks' window layers are stored (one
    /// batch per tier) and keeps the answer in `r` for the saves.
    pub(super) fn grouped_lookup(
        &self,
        g: &GroupedChunks,
        r: &mut RequestChunks,
        found: usize,
    ) -> usize {
        let window_keys: Vec<ChunkKey> = r.keys[..found]
            .iter()
            .map(ChunkKey::window_layers)
            .collect();
        let mut present = self.store.contains_each(&window_keys);
        present.resize(r.keys.len(), false);
        let hit = g.longest_hit(found, &present);
        if hit < found {
            lock(&self.stats).hits_shortened_by_window += 1;
            metrics::counter!("pagekeeper:tier_hits_shortened_by_window_total").increment(1);
        }
        r.window_present = present;
        hit
    }

    /// Loads a hit of `k` chunks into `seq` (empty): the window layers it needs first
    /// (without them the rest is useless), then every chunk's full-attention layers into
    /// the main table, then, once the window tables hold only what the next token sees,
    /// the window layers into them. `Err`: the first payload that could not be fetched or
    /// decoded (nothing usable is in `seq`; the engine frees it).
    pub(super) fn load_grouped(
        &self,
        g: &GroupedChunks,
        keys: &[ChunkKey],
        k: usize,
        kv: &mut KvCacheManager,
        store: &mut dyn KvBlocks,
        seq: SeqId,
    ) -> Result<usize, Failed> {
        let c = g.chunk_tokens;
        let first_w = g.first_window_chunk(k);
        let mut windows = Vec::with_capacity(k - first_w);
        for (j, key) in keys.iter().enumerate().take(k).skip(first_w) {
            windows.push(
                self.fetch(&key.window_layers(), g.window_layers.len(), store)
                    .ok_or(Failed::Window(j))?,
            );
        }
        for (j, key) in keys.iter().enumerate().take(k) {
            let ctx = self
                .fetch(key, g.full_layers.len(), store)
                .ok_or(Failed::Full(j))?;
            if kv.allocate_slots(seq, c as u32).is_none() {
                return Ok(0);
            }
            let table = table_of(kv, seq);
            let layers: Vec<LayerTable<'_>> =
                g.full_layers.iter().map(|&l| (l, &table[..])).collect();
            write_layers(store, &layers, j * c, c, &ctx.k, &ctx.v);
        }
        // Window blocks allocated on the way and behind the next token's window hold
        // nothing: released before anything can cache them.
        kv.release_window_blocks_behind(seq, (k * c) as u64);
        let layers = window_layer_tables(&g.window_layers, kv, seq);
        for (j, ctx) in (first_w..k).zip(&windows) {
            write_layers(store, &layers, j * c, c, &ctx.k, &ctx.v);
        }
        let mut stats = lock(&self.stats);
        stats.chunks_loaded += k as u64;
        stats.window_chunks_loaded += windows.len() as u64;
        metrics::counter!("pagekeeper:tier_chunks_loaded_total", "layers" => "full")
            .increment(k as u64);
        metrics::counter!("pagekeeper:tier_chunks_loaded_total", "layers" => "window")
            .increment(windows.len() as u64);
        Ok(k * c)
    }

    /// One stored payload of `n_layers` layers of a whole chunk, decoded and checked
    /// against the pool's shape; `None` (counted) when no tier has it or it is corrupted.
    fn fetch(
        &self,
        key: &ChunkKey,
        n_layers: usize,
        store: &dyn KvBlocks,
    ) -> Option<pk_codec::KvContext> {
        let geo = store.geometry();
        let chunk = self.chunk_size_tokens();
        let Some(loaded) = self.store.load(key) else {
            lock(&self.stats).load_failures += 1;
            return None;
        };
        match pk_codec::decode(&loaded.payload, &self.fingerprint) {
            Ok(c)
                if c.positions.len() == chunk
                    && c.n_layers == n_layers
                    && c.n_kv_heads == geo.n_kv_heads
                    && c.head_dim == geo.head_dim =>
            {
                Some(c)
            }
            other => {
                self.discard_corrupt(key, other.err());
                None
            }
        }
    }

    /// Queues what `r` has not stored of the `computed` positions of `seq`: the
    /// full-attention layers of every whole chunk, and the window layers of the chunks
    /// each hit point reached by now needs (while the pool still holds them).
    pub(super) fn save_grouped(
        &self,
        g: &GroupedChunks,
        r: &mut RequestChunks,
        computed: usize,
        kv: &KvCacheManager,
        store: &dyn KvBlocks,
        seq: SeqId,
    ) {
        let (c, n) = (g.chunk_tokens, r.keys.len());
        let geo = store.geometry();
        let table = table_of(kv, seq);
        let full: Vec<LayerTable<'_>> = g.full_layers.iter().map(|&l| (l, &table[..])).collect();
        while r.saved < n && (r.saved + 1) * c <= computed {
            if self.queue_layers(&full, r.keys[r.saved], r.saved * c, c, store, "full")
                == Queued::Closed
            {
                r.saved = n;
                r.hits_done = usize::MAX;
                return;
            }
            r.saved += 1;
        }
        let window = window_layer_tables(&g.window_layers, kv, seq);
        let points = g.hit_points(n);
        while r.hits_done < points.len() && points[r.hits_done] * c <= computed {
            let k = points[r.hits_done];
            r.hits_done += 1;
            let first_w = g.first_window_chunk(k);
            let missing: Vec<usize> = (first_w..k).filter(|&j| !r.window_present[j]).collect();
            // Half a hit point's window is of no use: store it whole or not at all.
            if !all_held(
                &window,
                first_w * c,
                (k - first_w) * c,
                geo.block_size_tokens,
            ) {
                lock(&self.stats).window_chunks_unavailable += missing.len() as u64;
                continue;
            }
            for j in missing {
                let key = r.keys[j].window_layers();
                match self.queue_layers(&window, key, j * c, c, store, "window") {
                    Queued::Yes => r.window_present[j] = true,
                    Queued::Skipped => {}
                    Queued::Closed => {
                        r.hits_done = usize::MAX;
                        return;
                    }
                }
            }
        }
    }

    /// Reads `n` positions from `first` of `layers` out of the pool and queues them under
    /// `key`. `Closed` when nothing more can be stored (the writer is gone, or the pool
    /// failed a read: the next forward pass fails too).
    fn queue_layers(
        &self,
        layers: &[LayerTable<'_>],
        key: ChunkKey,
        first: usize,
        n: usize,
        store: &dyn KvBlocks,
        kind: &'static str,
    ) -> Queued {
        let geo = store.geometry();
        let floats = layers.len() * geo.n_kv_heads * n * geo.head_dim;
        let (mut k, mut v) = (vec![0f32; floats], vec![0f32; floats]);
        if let Err(e) = read_layers(store, layers, first, n, &mut k, &mut v) {
            tracing::warn!("reading a KV chunk out of the pool failed: {e}");
            return Queued::Closed;
        }
        let positions = (first as u32..(first + n) as u32).collect();
        let ctx =
            pk_codec::KvContext::new(layers.len(), geo.n_kv_heads, geo.head_dim, positions, k, v);
        self.queue(key, ctx, kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gemma-3-270M's groups: 18 layers, every 6th global, windows of 512.
    fn layout() -> KvGroupLayout {
        let windows: Vec<Option<usize>> = (0..18)
            .map(|l| (!(l + 1usize).is_multiple_of(6)).then_some(512))
            .collect();
        KvGroupLayout::for_windows(&windows).unwrap()
    }

    fn gemma3_270m(checkpoint_tokens: usize) -> GroupedChunks {
        GroupedChunks::new(&layout(), 256, checkpoint_tokens).unwrap()
    }

    #[test]
    fn a_hit_needs_the_chunks_its_next_token_sees() {
        let g = gemma3_270m(2048);
        assert_eq!((g.full_layers.len(), g.window_layers.len()), (3, 15));
        // The token at position 2·256 sees positions 1..=512: chunks 0 and 1.
        assert_eq!(g.first_window_chunk(2), 0);
        assert_eq!(g.first_window_chunk(1), 0);
        // At 16 chunks (position 4,096) it sees 3,585..=4,096: chunks 14 and 15.
        assert_eq!(g.first_window_chunk(16), 14);
        // 8,191 tokens leave 31 whole chunks (the last token is computed): checkpoints at
        // 8, 16 and 24 chunks, and the end.
        assert_eq!(g.hit_points(31), vec![8, 16, 24, 31]);
        assert_eq!(g.hit_points(16), vec![8, 16]);
        assert_eq!(g.hit_points(0), Vec::<usize>::new());
        assert!(GroupedChunks::new(&layout(), 256, 1000).is_err());
        assert!(GroupedChunks::new(&layout(), 256, 0).is_err());
        // A chunk that does not divide the window could start before what a prefill step
        // still holds.
        assert!(GroupedChunks::new(&layout(), 384, 768).is_err());
        assert!(GroupedChunks::new(&layout(), 64, 2048).is_ok());
    }

    #[test]
    fn the_longest_hit_is_cut_where_window_chunks_are_missing() {
        let g = gemma3_270m(2048);
        // A prompt of 31 chunks stored its checkpoints' windows and its end's.
        let mut present = vec![false; 31];
        for k in g.hit_points(31) {
            for p in &mut present[g.first_window_chunk(k)..k] {
                *p = true;
            }
        }
        assert_eq!(g.longest_hit(31, &present), 31);
        // A prompt sharing 23 chunks of it hits at the checkpoint at 16 chunks.
        assert_eq!(g.longest_hit(23, &present[..23]), 16);
        // Without chunk 15's window, the checkpoint at 8 chunks.
        present[15] = false;
        assert_eq!(g.longest_hit(23, &present[..23]), 8);
        // No window at all: no hit, whatever the full-attention layers.
        assert_eq!(g.longest_hit(31, &[false; 31]), 0);
    }

    #[test]
    fn released_blocks_are_never_held() {
        let table = [RELEASED, RELEASED, 7, 8];
        let layers: [LayerTable<'_>; 1] = [(0, &table)];
        assert!(all_held(&layers, 32, 32, 16));
        assert!(!all_held(&layers, 16, 32, 16));
        assert!(!all_held(&layers, 48, 32, 16), "past the table's end");
    }
}
