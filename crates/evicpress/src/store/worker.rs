//! The store's worker thread: inserts, placement decisions and the moves they imply
//! (write the new copy, update the index, delete the old), so that none of it runs on the
//! engine's thread.

use super::*;

impl Drop for ContextStore {
    fn drop(&mut self) {
        self.tx.lock().unwrap().take();
        if let Some(w) = self.worker.lock().unwrap().take() {
            // The last handle may be the worker's own (a job in progress when the others
            // went): a thread cannot join itself, and it ends once its channel is empty.
            if w.thread().id() != std::thread::current().id() {
                let _ = w.join();
            }
        }
    }
}

pub(super) fn worker_loop(rx: Receiver<Job>, store: std::sync::Weak<ContextStore>) {
    while let Ok(job) = rx.recv() {
        let Some(store) = store.upgrade() else { return };
        match job {
            Job::Insert(key, kv, supplied) => {
                let bytes = (kv.n_elements() * 4 + supplied.bytes()) as u64;
                let mut scores = HashMap::new();
                match supplied.snapkv {
                    Some(SnapKvSource::Scores(s)) => {
                        scores.insert(DropScore::SnapKv, s);
                    }
                    Some(SnapKvSource::Window(w)) if !store.contains(&key) => {
                        if let Some(s) = snapkv_scores(&kv, &w) {
                            scores.insert(DropScore::SnapKv, s);
                        }
                    }
                    _ => {}
                }
                if let Some(s) = supplied.kvzip {
                    scores.insert(DropScore::KvZip, s);
                }
                if let Err(e) = store.insert(key, &kv, scores, supplied.context_ids) {
                    tracing::warn!("EVICPRESS: storing a context failed: {e}");
                }
                store.pending_bytes.fetch_sub(bytes, Ordering::Relaxed);
            }
            Job::Place(key) => store.place(key, None),
            Job::SaveMeta(key) => store.save_meta(&key),
        }
        // The strong reference goes before the job counts as done: once `flush` returns,
        // the caller's handle is the last, so dropping it closes the tiers there and then
        // (a disk tier's directory lock included) instead of at the end of this iteration.
        let in_flight = store.in_flight.clone();
        drop(store);
        super::job_done(&in_flight);
    }
}

impl ContextStore {
    /// Worker: writes the master (unless the store keeps one copy), registers the context,
    /// places it.
    pub(super) fn insert(
        &self,
        key: ChunkKey,
        kv: &KvContext,
        supplied: HashMap<DropScore, Vec<f32>>,
        context_ids: Option<Vec<u32>>,
    ) -> Result<(), StoreError> {
        if self.contains(&key) {
            return Ok(());
        }
        if self.copies == Copies::PlacedOnly {
            self.register(key, kv, supplied);
            self.state.lock().unwrap().stats.inserted += 1;
            self.place(key, Some(kv));
            return Ok(());
        }
        let last = self.tiers.len() - 1;
        let master = pk_codec::encode(kv, &pk_codec::Method::None, None, &self.fingerprint)?;
        let master_bytes = master.len() as u64;
        if master_bytes > self.last_capacity_bytes {
            tracing::warn!(
                "EVICPRESS: a context's master ({master_bytes} bytes) exceeds the {} tier's \
                 capacity ({} bytes); not stored",
                self.tiers[last].name(),
                self.last_capacity_bytes
            );
            self.state.lock().unwrap().stats.skipped_too_large += 1;
            return Ok(());
        }
        self.tiers[last].store(&copy_key(&key, 0), &Payload::from(master))?;
        count_master_bytes(kv, master_bytes);
        // Supplied scores cannot be recomputed from the master: write them beside it now,
        // not only with the first profile, so that a restart before it keeps them.
        let keep_scores = supplied.keys().any(|s| self.grid_drops_by(*s));
        self.register(key, kv, supplied);
        if let Some(ids) = context_ids {
            let mut st = self.state.lock().unwrap();
            if let Some(e) = st.entries.get_mut(&key) {
                if !e.scores.contains_key(&DropScore::KvZip) {
                    e.pending_kvzip_ids = Some(ids);
                }
            }
        }
        if keep_scores {
            self.save_meta(&key);
        }
        self.state.lock().unwrap().stats.inserted += 1;
        self.place(key, Some(kv));
        Ok(())
    }

    /// Adds an index entry for a context whose master is on the last tier; `supplied`: the
    /// scores the engine gave with it (SnapKV's, KVzip's), where known (a configuration
    /// that drops by a score it lacks is unavailable for this context).
    pub(super) fn register(
        &self,
        key: ChunkKey,
        kv: &KvContext,
        supplied: HashMap<DropScore, Vec<f32>>,
    ) {
        let last = self.tiers.len() - 1;
        let shape = kv.shape();
        let mut scores: HashMap<DropScore, Vec<f32>> = self
            .grid
            .configs()
            .iter()
            .filter_map(|c| c.drop_score())
            .filter_map(|s| Some((s, token_scores(kv, s)?)))
            .collect();
        for (score, s) in supplied {
            if score.is_supplied() && s.len() == kv.n_tokens() && self.grid_drops_by(score) {
                scores.insert(score, s);
            }
        }
        {
            let mut st = self.state.lock().unwrap();
            let quality = st.prior.curve(&self.grid);
            let now = self.now_s();
            let mut freq = DecayedCount::default();
            freq.bump(now, self.half_life_s);
            let ghost = st.ghosts.take(&key);
            let item = Item {
                bytes: self.grid.configs().iter().map(|c| c.bytes_of(kv)).collect(),
                kept_tokens: self
                    .grid
                    .configs()
                    .iter()
                    .map(|c| match c.method().drop_spec() {
                        Some(d) => pk_codec::drop::n_kept_tokens(shape.n_tokens, &d),
                        None => shape.n_tokens,
                    })
                    .collect(),
                quality: quality.by_config.clone(),
                frequency: 1.0,
                last_access_s: now,
                tier: last,
                config: 0,
                master: true,
            };
            let mut entry = Entry {
                n_tokens: kv.n_tokens(),
                item,
                quality,
                freq,
                served_quality: None,
                hits: 0,
                scores,
                queries: Vec::new(),
                needs_profile: true,
                hits_since_profile: 0,
                window_bytes: window_bytes(&self.grid, kv),
                pending_kvzip_ids: None,
                kvzip_failures: 0,
            };
            if let Some(g) = ghost {
                entry.remember(g, now, self.half_life_s);
            }
            st.entries.insert(key, entry);
        }
    }

    /// Worker: runs the placement after `key` arrived or was hit, then executes the moves.
    pub(super) fn place(&self, key: ChunkKey, full: Option<&KvContext>) {
        let cpu0 = Instant::now();
        let (keys, before, after) = {
            let mut st = self.state.lock().unwrap();
            let now = self.now_s();
            let keys: Vec<ChunkKey> = st.entries.keys().copied().collect();
            let Some(arrived) = keys.iter().position(|k| *k == key) else {
                return;
            };
            let mut items: Vec<Item> = keys
                .iter()
                .map(|k| {
                    let e = &st.entries[k];
                    self.placement_item(e, e.freq.value_at(now, self.half_life_s).max(1e-9))
                })
                .collect();
            let mut before: Vec<(usize, usize)> =
                items.iter().map(|i| (i.tier, i.config)).collect();
            if self.copies == Copies::PlacedOnly && full.is_some() {
                // Registered but not written anywhere yet ("nowhere", distinct from the
                // dropped tier): its copy is made, or, dropped at once, it is forgotten.
                before[arrived] = (usize::MAX, 0);
            }
            let placer = Placer {
                delay: &st.delay,
                policy: &self.policy,
                capacities_bytes: &self.capacities_bytes,
            };
            placer.place(&mut items, Some(arrived));
            let cpu_s = cpu0.elapsed().as_secs_f64();
            st.stats.placement_decisions += 1;
            st.stats.placement_cpu_s_total += cpu_s;
            st.stats.placement_cpu_s_max = st.stats.placement_cpu_s_max.max(cpu_s);
            (
                keys,
                before,
                items.iter().map(|i| (i.tier, i.config)).collect::<Vec<_>>(),
            )
        };
        // Demotions and compressions first (they free room), the arrival last.
        let mut order: Vec<usize> = (0..keys.len()).filter(|&i| before[i] != after[i]).collect();
        order.sort_by_key(|&i| keys[i] == key);
        for i in order {
            if let Err(e) = self.execute_move(
                &keys[i],
                before[i],
                after[i],
                if keys[i] == key { full } else { None },
            ) {
                tracing::warn!("EVICPRESS: moving a context failed: {e}");
                if before[i].0 == usize::MAX {
                    // A one-copy arrival whose copy was never written is not stored.
                    let mut st = self.state.lock().unwrap();
                    self.forget(&mut st, &keys[i]);
                }
            }
        }
        if self.copies == Copies::MasterAndPlaced {
            self.enforce_last_capacity(&key);
        }
        self.publish_metrics();
    }

    /// Worker: makes copy `to` of a context exist, points the index at it, deletes `from`.
    pub(super) fn execute_move(
        &self,
        key: &ChunkKey,
        from: (usize, usize),
        to: (usize, usize),
        full: Option<&KvContext>,
    ) -> Result<(), StoreError> {
        let n_tiers = self.tiers.len();
        let single = self.copies == Copies::PlacedOnly;
        let is_master = |p: (usize, usize)| !single && p == (n_tiers - 1, 0);
        if to.0 >= n_tiers {
            self.drop_single_copy(key, from);
            return Ok(());
        }
        let mut moved = 0u64;
        if !is_master(to) {
            // A copy of the same configuration can be moved as bytes; others are re-encoded
            // from the full KV (the master, unless the caller still holds it).
            let existing = if from.1 == to.1 && from.0 < n_tiers {
                self.tiers[from.0]
                    .load(&copy_key(key, from.1))
                    .ok()
                    .flatten()
            } else {
                None
            };
            let payload = match existing {
                Some(p) => p,
                None => {
                    let loaded;
                    let full = match full {
                        Some(f) => f,
                        None => {
                            loaded = self.load_master(key)?;
                            &loaded
                        }
                    };
                    Payload::from(self.encode(key, full, to.1)?)
                }
            };
            moved = payload.len() as u64;
            let evicted = self.tiers[to.0].store(&copy_key(key, to.1), &payload)?;
            if !evicted.is_empty() {
                tracing::warn!(
                    "EVICPRESS: tier {} evicted {} entries on its own; give it more slack",
                    self.tiers[to.0].name(),
                    evicted.len()
                );
            }
        }
        let indexed = {
            let mut st = self.state.lock().unwrap();
            st.stats.moves += 1;
            st.stats.bytes_moved += moved;
            st.entries.get_mut(key).map(|e| {
                e.item.tier = to.0;
                e.item.config = to.1;
                // With one copy, only an uncompressed one can be re-encoded.
                e.item.master = !single || to.1 == 0;
            })
        };
        if indexed.is_none() && !is_master(to) {
            // Forgotten while it moved (its only copy was unreadable): no orphan is left.
            let _ = self.tiers[to.0].delete(&copy_key(key, to.1));
            return Ok(());
        }
        if !is_master(from) && from != to && from.0 < n_tiers {
            let _ = self.tiers[from.0].delete(&copy_key(key, from.1));
        }
        Ok(())
    }

    pub(super) fn publish_metrics(&self) {
        let st = self.state.lock().unwrap();
        let mut counts: HashMap<(usize, usize), u64> = HashMap::new();
        for e in st.entries.values() {
            *counts.entry((e.item.tier, e.item.config)).or_default() += 1;
        }
        for t in 0..self.tiers.len() {
            for c in 0..self.grid.len() {
                let n = counts.get(&(t, c)).copied().unwrap_or(0);
                metrics::gauge!("pagekeeper:evicpress_contexts", "tier" => self.tiers[t].name().to_string(), "config" => self.grid.configs()[c].to_string()).set(n as f64);
            }
        }
        // The delay model placement decides with, as measured (`delay_report` says where
        // each figure comes from).
        metrics::gauge!("pagekeeper:evicpress_prefill_tokens_per_second")
            .set(st.delay.prefill_tokens_per_s);
        for (t, spec) in st.delay.tiers.iter().enumerate() {
            metrics::gauge!("pagekeeper:evicpress_tier_read_bytes_per_second", "tier" => self.tiers[t].name().to_string())
                .set(spec.read_bytes_per_s);
        }
    }
}

/// Per configuration of `grid`, the bytes of `kv`'s sliding-window part as stored (with
/// the container around the two parts), or `None` for a context of one block table.
fn window_bytes(grid: &Grid, kv: &KvContext) -> Option<Vec<u64>> {
    kv.window.as_ref()?;
    let by_config = grid.configs().iter().map(|c| {
        let all = pk_codec::context_bytes_estimate(&c.method(), kv);
        (all - pk_codec::compressed_bytes_estimate(&c.method(), &kv.shape())) as u64
    });
    Some(by_config.collect())
}

/// Counts a stored master's bytes by the layers they hold: `all` for one block table;
/// `full` (the full-attention layers) and `window` (the sliding-window layers' tail, with
/// the container) for a context stored by KV cache group.
fn count_master_bytes(kv: &KvContext, master_bytes: u64) {
    const NAME: &str = "pagekeeper:evicpress_master_bytes_total";
    if kv.window.is_none() {
        metrics::counter!(NAME, "layers" => "all").increment(master_bytes);
        return;
    }
    let full = pk_codec::compressed_bytes_estimate(&pk_codec::Method::None, &kv.shape()) as u64;
    metrics::counter!(NAME, "layers" => "full").increment(full);
    metrics::counter!(NAME, "layers" => "window").increment(master_bytes - full);
}
