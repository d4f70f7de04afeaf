//! The eviction pass of a step's update: prefill selection once a budgeted prompt is in,
//! then a block score per filled block and whole-block evictions while over budget.

use super::Engine;
use crate::eviction;
use crate::eviction::kvzip::{self, KvzipPrompts};
use crate::eviction::kvzip_run::KvzipRun;
use crate::request::{RequestError, SeqEvent};
use crate::scheduler::Chunk;

/// Why a request fails when its pruned prompt has no block to be compacted into (a
/// copy-on-write of a shared block), at prefill or after KVzip's passes.
pub(super) const NO_BLOCK_TO_COMPACT: &str =
    "the KV cache is full: no block to compact the pruned prompt into";

impl Engine {
    /// The eviction part of `apply`: prefill selection once the prompt is in, then a block
    /// score per filled block and evictions while over budget. Returns whether the
    /// sequence is finished (it is, failed, when its pruned prompt has no block to go to).
    pub(super) fn apply_eviction(
        &mut self,
        i: usize,
        c: &Chunk,
        queries: Option<eviction::CapturedQueries>,
        prefill_done: bool,
        finished: bool,
    ) -> bool {
        let n_heads = self.backend.config().n_heads;
        let ev = self.sched.running[i]
            .eviction
            .as_ref()
            .expect("an evicting sequence");
        if let (false, true, false, Some(pass)) = (
            ev.initialised,
            prefill_done,
            finished,
            ev.spec.reconstruction_pass(),
        ) {
            match self.kvzip_prior(i, pass) {
                Err(why) => {
                    let s = &mut self.sched.running[i];
                    s.aborted = true;
                    (s.req.sink)(SeqEvent::Error(RequestError::CacheFull(why)));
                    return true;
                }
                // The passes run over the next steps; selection follows them
                // (`finish_kvzip_run`), with the queries this step captured.
                Ok(Some(run)) => {
                    let ev = self.sched.running[i].eviction.as_mut().expect("evicting");
                    let mut run = run;
                    run.queries = queries;
                    ev.kvzip_run = Some(run);
                    return false;
                }
                Ok(None) => {}
            }
        }
        let s = &mut self.sched.running[i];
        let seq = s.kv.seq.expect("running");
        let ev = s.eviction.as_mut().expect("an evicting sequence");
        let stats = self
            .eviction_stats
            .entry(ev.spec.name().to_string())
            .or_default();
        let (kv, store) = (&mut self.sched.kv, self.backend.kv_mut());
        if ev.initialised {
            if c.to - c.from == 1 {
                if let Some(q) = queries {
                    ev.recent_queries.push((q.positions[0], q.data));
                }
                eviction::after_decode(ev, kv, store, seq, n_heads, stats);
            }
            return finished;
        }
        if !prefill_done {
            // A prompt pruned as its chunks arrive: at each multiple of the interval (the
            // plan ends chunks there), select over what is stored so far.
            let at_point = ev
                .prune_interval_tokens
                .is_some_and(|n| c.to.is_multiple_of(n));
            if finished || !at_point || eviction::prune_prompt_so_far(ev, kv, store, seq, stats) {
                return finished;
            }
        } else {
            // The whole prompt (or, after preemption, everything) is in the cache and its
            // attention is done: select, compact, and from now on evict.
            if finished {
                return finished;
            }
            let q = queries.as_ref();
            if eviction::after_prefill(ev, kv, store, seq, q, stats) {
                return false;
            }
        }
        // No block for a copy-on-write during compaction: give up on this request rather
        // than corrupt a shared block.
        s.aborted = true;
        (s.req.sink)(SeqEvent::Error(RequestError::CacheFull(
            NO_BLOCK_TO_COMPACT.into(),
        )));
        true
    }

    /// KVzip's scores of sequence `i`'s stored context handed to its policy at once where
    /// they need no pass (a context within the budget: every token scores 1, and decode
    /// evicts the oldest blocks first) or are in the score cache; otherwise the run of its
    /// reconstruction passes, for the engine to advance (`Ok(Some)`). `Err`: no prompts.
    fn kvzip_prior(
        &mut self,
        i: usize,
        pass: pk_kv::KvzipPass,
    ) -> Result<Option<Box<KvzipRun>>, String> {
        let n_stored = self.stored_tokens(i);
        let seq = self.sched.running[i].kv.seq.expect("running");
        let s = &self.sched.running[i];
        let budget = s.eviction.as_ref().expect("evicting").budget_tokens;
        let context = s.all_ids[..n_stored].to_vec();
        let exact = !s.reuse.inexact;
        let cached = exact
            .then(|| self.kvzip_scores.get(pass, &context))
            .flatten();
        let c = self.backend.config();
        let scores = if n_stored <= budget as usize {
            vec![1.0; c.n_layers * c.n_kv_heads * n_stored]
        } else if let Some(scores) = cached {
            scores
        } else {
            let prompts = KvzipPrompts::new(&self.tokenizer, &self.chat_template)?;
            let child = self.sched.new_seq_id();
            let run = KvzipRun::new(&*self.backend, (seq, child), context, (prompts, pass));
            return Ok(Some(Box::new(run)));
        };
        self.set_kvzip_prior(i, &scores);
        Ok(None)
    }

    /// Each unit's scores from KVzip's `[layer][kv_head][token]` scores handed to its
    /// policy, with the ragged budget (`kvzip:global`) they give.
    pub(super) fn set_kvzip_prior(&mut self, i: usize, scores: &[f32]) {
        let n_stored = self.stored_tokens(i);
        let n_kv_heads = self.backend.config().n_kv_heads;
        let ev = self.sched.running[i].eviction.as_mut().expect("evicting");
        let unit_scores: Vec<Vec<f32>> = ev
            .units
            .iter()
            .map(|u| kvzip::unit_scores(scores, &u.unit, n_kv_heads, n_stored))
            .collect();
        if ev.spec.ragged() && n_stored > ev.budget_tokens as usize {
            let floor = ev.spec.ragged_floor_tokens(self.config.block_size_tokens);
            let budget = ev.budget_tokens;
            ev.unit_budgets = Some(kvzip::ragged_budgets(&unit_scores, budget, n_stored, floor));
        }
        if ev.record_keeps {
            ev.recorded_prior_scores = unit_scores.clone();
        }
        for (u, scores) in ev.units.iter_mut().zip(unit_scores) {
            u.policy.set_prior_scores(scores);
        }
    }

    /// Tokens `running[i]`'s main table stores.
    fn stored_tokens(&self, i: usize) -> usize {
        let seq = self.sched.running[i].kv.seq.expect("running");
        let table = self.sched.kv.block_table(seq).expect("live");
        table.num_stored_tokens() as usize
    }
}
