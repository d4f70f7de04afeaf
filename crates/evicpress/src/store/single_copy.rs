//! One copy per context ([`Copies::PlacedOnly`]): what differs from a store with masters.
//!
//! The placer runs its bounded model as is: every tier's capacity, the last one's
//! included, is enforced by demotion, and a context demoted past the last tier is dropped
//! (its copy deleted, its index entry forgotten into a ghost, `store::ghosts`). A context
//! whose copy is compressed has no full KV left: the placer may move it, never re-encode
//! it (`Item::master` false). The full KV of a context whose copy is uncompressed is that
//! copy, so it can still be compressed later and profiled.
//!
//! What a store with masters does and this one deliberately does not: fall back to the
//! master when a copy is unreadable (the context is forgotten and its next request
//! recomputes it), adopt contexts from the last tier after a restart or from another
//! server (nothing there says which copies are whole), and write meta entries.

use super::*;

impl ContextStore {
    /// Worker: a context the placer demoted past the last tier. Its copy is deleted after
    /// the index forgets it, so that a load which read the index before either finds the
    /// copy or misses.
    pub(super) fn drop_single_copy(&self, key: &ChunkKey, from: (usize, usize)) {
        let forgotten = {
            let mut st = self.state.lock().unwrap();
            let item = self.forget(&mut st, key);
            if item.is_some() {
                st.stats.dropped += 1;
            }
            item
        };
        if forgotten.is_some() && from.0 < self.tiers.len() {
            let _ = self.tiers[from.0].delete(&copy_key(key, from.1));
        }
        metrics::counter!("pagekeeper:evicpress_dropped_total").increment(1);
    }

    /// The full KV of a stored context with one copy: the copy itself, when uncompressed.
    pub(super) fn load_single_copy_full(&self, key: &ChunkKey) -> Result<KvContext, StoreError> {
        let (tier, config) = self.placement_of(key).ok_or(StoreError::NotStored)?;
        if config != 0 {
            return Err(StoreError::NoFullKv);
        }
        let p = self.tiers[tier]
            .load(&copy_key(key, 0))?
            .ok_or(StoreError::CopyMissing)?;
        Ok(pk_codec::decode(&p, &self.fingerprint)?)
    }

    /// Whether `e`'s full KV can be read (always with masters).
    pub(super) fn has_full_kv(&self, e: &Entry) -> bool {
        self.copies == Copies::MasterAndPlaced || e.item.config == 0
    }

    /// An unreadable copy with no master behind it: the context is forgotten (its next
    /// request recomputes it) and its copy deleted. A copy that is missing because the
    /// worker moved the context after the load read the index is not a loss: the context
    /// stays, at its new place.
    pub(super) fn forget_unreadable(&self, key: &ChunkKey, at: (usize, usize)) {
        let mut st = self.state.lock().unwrap();
        let now_at = st.entries.get(key).map(|e| (e.item.tier, e.item.config));
        if now_at != Some(at) {
            return;
        }
        st.stats.unreadable_dropped += 1;
        self.forget(&mut st, key);
        drop(st);
        let _ = self.tiers[at.0].delete(&copy_key(key, at.1));
    }
}
