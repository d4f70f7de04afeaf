//! EVICPRESS profiling (spec "Profiling"): how well each configuration of the grid
//! answers a stored context's queries, measured on the engine itself.
//!
//! Quality metric (the spec's **decision**): token-level F1 between the greedy answer
//! generated from the compressed KV and the greedy answer generated from the full KV, the
//! same measure `pk-eval` uses for answer agreement, averaged over the profiling queries.
//!
//! All answers of one context (every configuration × every query, the full-KV ones
//! included) are submitted at once and run by the ordinary scheduler, so profiling is
//! batched with whatever else the engine is doing, and a server can start a profile when
//! it is idle and poll it between steps ([`Profiling::is_done`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use pk_tiers::ChunkKey;

use crate::contexts::PrefixKv;
use crate::engine::{Engine, GenerateParams};
use crate::request::{Request, SeqEvent};

/// Token-level F1 of two answers (bags of token ids); 1 when both are empty.
pub fn token_f1(answer: &[u32], reference: &[u32]) -> f64 {
    if answer.is_empty() && reference.is_empty() {
        return 1.0;
    }
    let mut counts: HashMap<u32, i64> = HashMap::new();
    for &t in reference {
        *counts.entry(t).or_default() += 1;
    }
    let mut overlap = 0i64;
    for &t in answer {
        if let Some(c) = counts.get_mut(&t) {
            if *c > 0 {
                *c -= 1;
                overlap += 1;
            }
        }
    }
    if overlap == 0 {
        return 0.0;
    }
    let p = overlap as f64 / answer.len() as f64;
    let r = overlap as f64 / reference.len() as f64;
    2.0 * p * r / (p + r)
}

/// A profile in flight: answers arrive through the requests' sinks.
pub struct Profiling {
    pub key: ChunkKey,
    n_configs: usize,
    n_queries: usize,
    answers: Arc<Mutex<HashMap<(usize, usize), Vec<u32>>>>,
    remaining: Arc<AtomicUsize>,
}

impl Profiling {
    pub fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// Quality per configuration (index 0, the full KV, is 1 by definition).
    pub fn qualities(&self) -> Vec<f32> {
        let answers = self.answers.lock().unwrap();
        (0..self.n_configs)
            .map(|c| {
                let mut sum = 0.0;
                for q in 0..self.n_queries {
                    let reference = answers.get(&(0, q)).map(Vec::as_slice).unwrap_or(&[]);
                    let answer = answers.get(&(c, q)).map(Vec::as_slice).unwrap_or(&[]);
                    sum += token_f1(answer, reference);
                }
                (sum / self.n_queries.max(1) as f64) as f32
            })
            .collect()
    }
}

impl Engine {
    /// Submits the profiling requests of one stored context: for every configuration of
    /// the store's grid and every query (tokens that follow the context), a greedy answer
    /// of at most `max_answer_tokens` from the configuration's KV.
    pub fn start_profile(&mut self, key: ChunkKey, queries: &[Vec<u32>], max_answer_tokens: usize) -> Result<Profiling> {
        let Some(store) = self.context_store() else { bail!("no context store configured") };
        if queries.is_empty() {
            bail!("profiling needs at least one query");
        }
        let full = store.load_master(&key).map_err(anyhow::Error::msg)?;
        let n_configs = store.grid().len();
        let room = self.config.max_waiting_requests.saturating_sub(self.num_waiting());
        if n_configs * queries.len() > room {
            bail!("profiling needs {} requests; the queue has room for {room}", n_configs * queries.len());
        }
        let answers = Arc::new(Mutex::new(HashMap::new()));
        let remaining = Arc::new(AtomicUsize::new(n_configs * queries.len()));
        for c in 0..n_configs {
            let kv = if c == 0 { full.clone() } else { store.compress(&key, &full, c).map_err(anyhow::Error::msg)? };
            let prefix = Arc::new(PrefixKv { kv });
            for (q, query) in queries.iter().enumerate() {
                // The context's own token ids are not needed: its KV is given.
                let mut prompt = vec![0u32; prefix.n_tokens()];
                prompt.extend_from_slice(query);
                let params = GenerateParams { max_tokens: max_answer_tokens, prefix_kv: Some(prefix.clone()), background: true, ..Default::default() };
                let (answers, remaining) = (answers.clone(), remaining.clone());
                let mut done = false;
                let sink = Box::new(move |e: SeqEvent| {
                    let finished = match e {
                        SeqEvent::Finished(o) => {
                            answers.lock().unwrap().insert((c, q), o.token_ids);
                            true
                        }
                        SeqEvent::Error(_) => true,
                        _ => false,
                    };
                    if finished && !done {
                        done = true;
                        remaining.fetch_sub(1, Ordering::AcqRel);
                    }
                    true
                });
                self.submit(Request { prompt_ids: prompt, params, cache_salt: None, sink }).map_err(|e| anyhow::anyhow!("{e}"))?;
            }
        }
        Ok(Profiling { key, n_configs, n_queries: queries.len(), answers, remaining })
    }

    /// Profiles one context to completion and records the curve in the store. Returns it.
    pub fn profile_blocking(&mut self, key: ChunkKey, queries: &[Vec<u32>], max_answer_tokens: usize) -> Result<Vec<f32>> {
        let p = self.start_profile(key, queries, max_answer_tokens)?;
        while !p.is_done() {
            if !self.has_work() {
                bail!("profiling requests ended without results");
            }
            self.step();
        }
        let q = p.qualities();
        self.context_store().expect("checked").set_profile(&key, q.clone()).map_err(anyhow::Error::msg)?;
        Ok(q)
    }

    /// A server's idle hook: if nothing waits and a stored context wants a (re)profile with
    /// queries seen for it, starts profiling it.
    pub fn maybe_start_background_profile(&mut self, max_answer_tokens: usize) -> Option<Profiling> {
        if self.num_waiting() > 0 || self.num_running() * 2 > self.config.max_running_seqs {
            return None;
        }
        let store = self.context_store()?;
        let (key, queries) = store.profiling_candidates(1).into_iter().next()?;
        match self.start_profile(key, &queries, max_answer_tokens) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::debug!("background profiling not started: {e}");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::token_f1;

    #[test]
    fn f1_counts_multisets() {
        assert_eq!(token_f1(&[], &[]), 1.0);
        assert_eq!(token_f1(&[1, 2], &[3]), 0.0);
        assert!((token_f1(&[1, 2, 2], &[2, 1]) - 0.8).abs() < 1e-12);
    }
}
