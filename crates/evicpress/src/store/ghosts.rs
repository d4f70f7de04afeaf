//! What the store remembers of contexts it no longer holds ("ghosts", as in ARC's ghost
//! lists): frequency, measured profile and the scores the engine supplied.
//!
//! A context dropped from bounded tiers is recomputed when asked for again and offered
//! anew. Without a memory of it, it would come back as a stranger: a frequency of one, the
//! prior's quality curve until a re-profile, and no SnapKV or KVzip scores (so those
//! configurations unavailable, or a KVzip pass on the request path to get them back). The
//! simulator keeps all three for a dropped context, and so does the paper's design, where
//! profiles are per context and outlive its KV. A ghost costs its scores (4 bytes a token
//! each) and a few hundred bytes; the list is bounded in entries and in bytes, oldest
//! forgotten first.
//!
//! A profile known before a context is stored (computed offline, or by a benchmark's
//! setup) is recorded the same way ([`ContextStore::preset_profile`]), so that the first
//! placement already sees it: with one copy per context a compressed copy cannot be
//! re-encoded later, so placing on the prior and correcting on the profile is not possible.

use std::collections::VecDeque;

use super::*;

/// At most this many contexts are remembered.
pub const MAX_GHOSTS: usize = 4096;
/// At most this many bytes of remembered scores.
pub const MAX_GHOST_SCORE_BYTES: usize = 64 << 20;

/// One remembered context.
pub(crate) struct Ghost {
    n_tokens: Option<usize>,
    freq: Option<DecayedCount>,
    profile: Option<Vec<f32>>,
    /// Only the scores the engine supplied (the others are recomputed from the KV).
    scores: HashMap<DropScore, Vec<f32>>,
}

impl Ghost {
    fn score_bytes(&self) -> usize {
        self.scores.values().map(|s| s.len() * 4).sum()
    }
}

#[derive(Default)]
pub(crate) struct Ghosts {
    entries: VecDeque<(ChunkKey, Ghost)>,
    score_bytes: usize,
}

impl Ghosts {
    pub(crate) fn take(&mut self, key: &ChunkKey) -> Option<Ghost> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        let (_, g) = self.entries.remove(i)?;
        self.score_bytes -= g.score_bytes();
        Some(g)
    }

    fn has_scores(&self, key: &ChunkKey, score: DropScore) -> bool {
        self.entries
            .iter()
            .any(|(k, g)| k == key && g.scores.contains_key(&score))
    }

    fn push(&mut self, key: ChunkKey, ghost: Ghost) {
        self.take(&key);
        self.score_bytes += ghost.score_bytes();
        self.entries.push_back((key, ghost));
        while self.entries.len() > MAX_GHOSTS || self.score_bytes > MAX_GHOST_SCORE_BYTES {
            let Some((_, old)) = self.entries.pop_front() else {
                break;
            };
            self.score_bytes -= old.score_bytes();
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

impl ContextStore {
    /// Records `by_config` (one quality per grid configuration) as the measured profile of
    /// a context that is not stored yet: when it is stored, it is placed by this profile
    /// instead of the prior. For a stored context, [`ContextStore::set_profile`].
    pub fn preset_profile(&self, key: &ChunkKey, by_config: Vec<f32>) -> Result<(), StoreError> {
        self.check_profile_length(&by_config)?;
        let mut st = self.state.lock().unwrap();
        st.prior.add(&QualityCurve {
            by_config: by_config.clone(),
            source: QualitySource::Profiled,
        });
        let mut ghost = st.ghosts.take(key).unwrap_or(Ghost {
            n_tokens: None,
            freq: None,
            profile: None,
            scores: HashMap::new(),
        });
        ghost.profile = Some(by_config);
        st.ghosts.push(*key, ghost);
        Ok(())
    }

    /// Whether KVzip scores of `key` are known, stored or remembered: an offer of it needs
    /// none (the engine need not run the reconstruction pass).
    pub fn knows_kvzip_scores(&self, key: &ChunkKey) -> bool {
        let st = self.state.lock().unwrap();
        st.entries
            .get(key)
            .is_some_and(|e| e.scores.contains_key(&DropScore::KvZip))
            || st.ghosts.has_scores(key, DropScore::KvZip)
    }

    /// Contexts remembered without being stored.
    pub fn ghost_count(&self) -> usize {
        self.state.lock().unwrap().ghosts.len()
    }

    /// Removes `key` from the index (it is no longer stored anywhere) and remembers it.
    /// Returns the entry's last placement, if it was stored.
    pub(super) fn forget(&self, st: &mut State, key: &ChunkKey) -> Option<Item> {
        let e = st.entries.remove(key)?;
        let ghost = Ghost {
            n_tokens: Some(e.n_tokens),
            freq: Some(e.freq),
            profile: (e.quality.source == QualitySource::Profiled).then_some(e.quality.by_config),
            scores: e
                .scores
                .into_iter()
                .filter(|(s, _)| s.is_supplied())
                .collect(),
        };
        st.ghosts.push(*key, ghost);
        Some(e.item)
    }
}

impl Entry {
    /// Restores what was remembered of this context (it was dropped, or profiled before it
    /// was stored), where it fits: scores of another length are not taken.
    pub(super) fn remember(&mut self, ghost: Ghost, now_s: f64, half_life_s: f64) {
        if ghost.n_tokens.is_some_and(|n| n != self.n_tokens) {
            return;
        }
        if let Some(mut freq) = ghost.freq {
            freq.bump(now_s, half_life_s);
            self.freq = freq;
        }
        if let Some(profile) = ghost.profile {
            self.item.quality = profile.clone();
            self.quality = QualityCurve {
                by_config: profile,
                source: QualitySource::Profiled,
            };
            self.needs_profile = false;
        }
        for (score, s) in ghost.scores {
            if s.len() == self.n_tokens {
                self.scores.entry(score).or_insert(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ghost(score_tokens: usize) -> Ghost {
        let mut scores = HashMap::new();
        scores.insert(DropScore::KvZip, vec![0.5; score_tokens]);
        Ghost {
            n_tokens: Some(score_tokens),
            freq: None,
            profile: None,
            scores,
        }
    }

    fn key(i: usize) -> ChunkKey {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&(i as u64).to_le_bytes());
        ChunkKey(k)
    }

    #[test]
    fn ghosts_are_bounded_in_entries_and_bytes_oldest_forgotten_first() {
        let mut g = Ghosts::default();
        for i in 0..MAX_GHOSTS + 3 {
            g.push(key(i), ghost(1));
        }
        assert_eq!(g.len(), MAX_GHOSTS);
        assert!(g.take(&key(2)).is_none() && g.take(&key(3)).is_some());
        // Scores of a quarter of the byte bound each: the fifth push forgets the oldest.
        let mut g = Ghosts::default();
        let tokens = MAX_GHOST_SCORE_BYTES / 4 / 4;
        for i in 0..5 {
            g.push(key(i), ghost(tokens));
        }
        assert!(g.score_bytes <= MAX_GHOST_SCORE_BYTES);
        assert_eq!(g.len(), 4);
        assert!(g.take(&key(0)).is_none() && g.take(&key(4)).is_some());
        assert_eq!(g.score_bytes, 3 * tokens * 4);
    }
}
