//! KVzip's scores of stored contexts computed in idle time (issue 37): a server that calls
//! [`crate::ContextReuse::score_kvzip_in_idle_time`] offers contexts with their token ids
//! instead of scores, and its idle hook scores them one at a time with a background
//! request, like profiling. The request loads the context's master (all but its last
//! token, which it computes again with the same bits on the CPU), runs the `kvzip` policy
//! at `shared` granularity, whose reconstruction passes score every token, and records the
//! mean over layers and KV heads: the scores the engine would have given when the context
//! was stored (`engine/store_scores.rs`), without stalling the streams batched with it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context as _, Result};
use pk_engine::{Engine, GenerateParams, Request, SeqEvent};
use pk_tiers::ChunkKey;

use crate::contexts::ContextReuse;
use crate::prefix_kv::PrefixKv;

/// One context's scoring request in flight; the scores are attached to the store when it
/// finishes (or the context stays a candidate when it fails).
pub struct KvzipScoring {
    pub key: ChunkKey,
    done: Arc<AtomicBool>,
}

impl KvzipScoring {
    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

/// A server's idle hook: if nothing runs or waits and a stored context waits for KVzip
/// scores, submits its scoring request.
pub fn maybe_start_kvzip_scoring(e: &mut Engine, contexts: &ContextReuse) -> Option<KvzipScoring> {
    // Only on an idle engine: the passes need about two contexts' worth of free blocks.
    if e.num_waiting() > 0 || e.num_running() > 0 {
        return None;
    }
    let (key, ids) = contexts.store().kvzip_candidates(1).into_iter().next()?;
    match start_kvzip_scoring(e, contexts, key, &ids) {
        Ok(s) => Some(s),
        Err(err) => {
            // Not tried again: an idle loop must not spin on a context it cannot score.
            tracing::warn!("KVzip scoring of a stored context not started: {err}");
            contexts.store().kvzip_scoring_failed(&key, false);
            None
        }
    }
}

/// Submits the scoring request of stored context `key`, whose tokens are `ids`.
pub fn start_kvzip_scoring(
    e: &mut Engine,
    contexts: &ContextReuse,
    key: ChunkKey,
    ids: &[u32],
) -> Result<KvzipScoring> {
    let store = contexts.store().clone();
    let master = store.load_master(&key).map_err(anyhow::Error::msg)?;
    let n = ids.len();
    if master.n_tokens() != n || master.n_original_tokens != n || n < 2 {
        bail!("the master holds {} tokens, not {n}", master.n_tokens());
    }
    let mut prefix = master.retain_tokens(&(0..n - 1).collect::<Vec<_>>());
    prefix.n_original_tokens = n - 1;
    let params = GenerateParams {
        // The passes run once the prompt is in and a second token is due.
        max_tokens: 2,
        ignore_eos: true,
        kv_policy: Some("kvzip".parse().map_err(|e| anyhow::anyhow!("{e}"))?),
        // Any budget below the context makes the passes run; the kept set is not used.
        kv_budget: Some(48),
        kv_granularity: Some(pk_kv::KvGranularity::Shared),
        record_prefill_keeps: true,
        prefix_kv: Some(Arc::new(PrefixKv { kv: prefix })),
        background: true,
        ..Default::default()
    };
    let done = Arc::new(AtomicBool::new(false));
    let finished = done.clone();
    let sink = Box::new(move |ev: SeqEvent| {
        match ev {
            SeqEvent::Finished(o) => {
                let scores = o
                    .prefill_keeps
                    .and_then(|k| k.into_iter().next())
                    .map(|k| k.prior_scores);
                let attached = scores.context("no KVzip selection recorded").and_then(|s| {
                    store
                        .attach_kvzip_scores(&key, s)
                        .map_err(anyhow::Error::msg)
                });
                if let Err(err) = attached {
                    tracing::warn!("KVzip scores of a stored context: {err}");
                    store.kvzip_scoring_failed(&key, false);
                }
                finished.store(true, Ordering::Release);
            }
            SeqEvent::Error(err) => {
                // A pass that found no free block (requests arrived meanwhile) may fit
                // another time; the store gives up after a few tries.
                tracing::warn!("KVzip scoring of a stored context failed: {err}");
                store.kvzip_scoring_failed(&key, true);
                finished.store(true, Ordering::Release);
            }
            _ => {}
        }
        true
    });
    e.submit(Request {
        prompt_ids: ids.to_vec(),
        params,
        cache_salt: None,
        sink,
    })
    .map_err(|err| anyhow::anyhow!("{err}"))?;
    Ok(KvzipScoring { key, done })
}

/// Scores every stored context waiting for KVzip scores, one after the other, to
/// completion (a bench or a test standing in for a server's idle time). Returns how many.
pub fn score_pending_blocking(e: &mut Engine, contexts: &ContextReuse) -> Result<usize> {
    let mut n = 0;
    while let Some((key, ids)) = contexts.store().kvzip_candidates(1).into_iter().next() {
        let s = start_kvzip_scoring(e, contexts, key, &ids)?;
        while !s.is_done() {
            if !e.has_work() {
                bail!("the KVzip scoring request ended without a result");
            }
            e.step();
        }
        contexts.store().flush();
        if contexts.store().kvzip_scores_of(&key).is_none() {
            bail!("KVzip scoring of a stored context gave no scores (see the warning)");
        }
        n += 1;
    }
    Ok(n)
}
