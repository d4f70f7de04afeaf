//! Saving and restoring a context's meta entry (`crate::meta`) beside its master.

use super::*;

impl ContextStore {
    pub(super) fn grid_names(&self) -> Vec<String> {
        self.grid.configs().iter().map(|c| c.to_string()).collect()
    }

    /// Worker: writes the context's meta entry beside its master. Best effort: a failure
    /// costs only what a restart would have to learn again. With one copy per context
    /// there is no master to write it beside (and nothing is adopted after a restart).
    pub(super) fn save_meta(&self, key: &ChunkKey) {
        if self.copies == Copies::PlacedOnly {
            return;
        }
        let meta = {
            let st = self.state.lock().unwrap();
            let Some(e) = st.entries.get(key) else { return };
            ContextMeta {
                version: META_VERSION,
                grid: self.grid_names(),
                profile: (e.quality.source == QualitySource::Profiled)
                    .then(|| e.quality.by_config.clone()),
                hits: e.hits,
                frequency: e.freq.value_at(self.now_s(), self.half_life_s),
                saved_unix_s: unix_now_s(),
                queries: e.queries.clone(),
                snapkv_scores: e.scores.get(&DropScore::SnapKv).cloned(),
                kvzip_scores: e.scores.get(&DropScore::KvZip).cloned(),
            }
        };
        let last = self.tiers.len() - 1;
        // Tiers are content-addressed (storing a present key only refreshes it), and this
        // entry changes: replace it. A crash in between loses the entry, which only costs
        // a re-profile.
        let mk = meta_key(key);
        let _ = self.tiers[last].delete(&mk);
        match self.tiers[last].store(&mk, &Payload::from(meta.encode())) {
            Ok(_) => self.state.lock().unwrap().stats.meta_saved += 1,
            Err(e) => tracing::warn!("EVICPRESS: saving a context's profile failed: {e}"),
        }
    }

    /// Restores an adopted context's persisted profile, hits, frequency (decayed by the
    /// wall-clock time since it was saved) and queries, when a valid entry exists.
    pub(super) fn restore_meta(&self, key: &ChunkKey) {
        let last = self.tiers.len() - 1;
        let bytes = match self.tiers[last].load(&meta_key(key)) {
            Ok(Some(p)) => p,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("EVICPRESS: reading a context's profile failed: {e}");
                return;
            }
        };
        let meta = match ContextMeta::decode(&bytes, &self.grid_names()) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!("EVICPRESS: ignoring a stored profile: {e}");
                return;
            }
        };
        let mut st = self.state.lock().unwrap();
        let now = self.now_s();
        let curve = meta.profile.map(|by_config| QualityCurve {
            by_config,
            source: QualitySource::Profiled,
        });
        if let Some(c) = &curve {
            st.prior.add(c);
        }
        let Some(e) = st.entries.get_mut(key) else {
            return;
        };
        if let Some(c) = curve {
            e.item.quality = c.by_config.clone();
            e.quality = c;
            e.needs_profile = false;
        }
        let elapsed_s = (unix_now_s() - meta.saved_unix_s).max(0.0);
        let restored = meta.frequency * 0.5f64.powf(elapsed_s / self.half_life_s.max(1e-9));
        e.freq = DecayedCount::new(e.freq.value_at(now, self.half_life_s) + restored, now);
        e.hits += meta.hits;
        e.queries = meta.queries.into_iter().take(self.max_queries).collect();
        let supplied = [
            (DropScore::SnapKv, meta.snapkv_scores),
            (DropScore::KvZip, meta.kvzip_scores),
        ];
        for (score, s) in supplied {
            if let Some(s) = s.filter(|s| s.len() == e.n_tokens && self.grid_drops_by(score)) {
                e.scores.insert(score, s);
            }
        }
        st.stats.meta_restored += 1;
    }
}
