//! The eviction pass of a step's update: prefill selection once a budgeted prompt is in,
//! then a block score per filled block and whole-block evictions while over budget.

use super::Engine;
use crate::eviction;
use crate::eviction::kvzip::{self, KvzipPrompts};
use crate::request::{RequestError, SeqEvent};
use crate::scheduler::Chunk;

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
        if let (false, true, false, Some(chunk)) = (
            ev.initialised,
            prefill_done,
            finished,
            ev.spec.reconstruction_chunk_tokens(),
        ) {
            if let Err(why) = self.kvzip_prior(i, chunk) {
                let s = &mut self.sched.running[i];
                s.aborted = true;
                (s.req.sink)(SeqEvent::Error(RequestError::CacheFull(why)));
                return true;
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
            "the KV cache is full: no block to compact the pruned prompt into".into(),
        )));
        true
    }

    /// KVzip's reconstruction passes over sequence `i`'s stored context, then each unit's
    /// scores handed to its policy. A context within the budget is kept whole at prefill
    /// and needs no passes: its tokens all score 1, and decode then evicts the oldest
    /// blocks first. `Err`: no block for a pass, or the pass failed.
    fn kvzip_prior(&mut self, i: usize, chunk_tokens: usize) -> Result<(), String> {
        let seq = self.sched.running[i].kv.seq.expect("running");
        let n_stored = self
            .sched
            .kv
            .block_table(seq)
            .expect("live")
            .num_stored_tokens() as usize;
        let budget = self.sched.running[i]
            .eviction
            .as_ref()
            .expect("evicting")
            .budget_tokens;
        let n_kv_heads = self.backend.config().n_kv_heads;
        let context = self.sched.running[i].all_ids[..n_stored].to_vec();
        let exact = !self.sched.running[i].reuse.inexact;
        let cached = exact
            .then(|| self.kvzip_scores.get(chunk_tokens, &context))
            .flatten();
        let scores = if n_stored <= budget as usize {
            vec![1.0; self.backend.config().n_layers * n_kv_heads * n_stored]
        } else if let Some(scores) = cached {
            scores
        } else {
            let prompts = KvzipPrompts::new(&self.tokenizer, &self.chat_template)?;
            let child = self.sched.new_seq_id();
            let mut seconds = kvzip::PassSeconds::default();
            let scores = kvzip::reconstruction_scores(
                &mut *self.backend,
                &mut self.sched.kv,
                (seq, child),
                &context,
                (&prompts, chunk_tokens),
                &mut seconds,
            );
            let spec = self.sched.running[i]
                .eviction
                .as_ref()
                .expect("evicting")
                .spec;
            let stats = self
                .eviction_stats
                .entry(spec.name().to_string())
                .or_default();
            stats.reconstruction_forward_seconds += seconds.forward;
            stats.reconstruction_scoring_seconds += seconds.scoring;
            let scores = scores?;
            if exact {
                self.kvzip_scores.insert(chunk_tokens, &context, &scores);
            }
            scores
        };
        let ev = self.sched.running[i].eviction.as_mut().expect("evicting");
        let unit_scores: Vec<Vec<f32>> = ev
            .units
            .iter()
            .map(|u| kvzip::unit_scores(&scores, &u.unit, n_kv_heads, n_stored))
            .collect();
        if ev.spec.ragged() && n_stored > budget as usize {
            let floor = ev.spec.ragged_floor_tokens(self.config.block_size_tokens);
            ev.unit_budgets = Some(kvzip::ragged_budgets(&unit_scores, budget, n_stored, floor));
        }
        if ev.record_keeps {
            ev.recorded_prior_scores = unit_scores.clone();
        }
        for (u, scores) in ev.units.iter_mut().zip(unit_scores) {
            u.policy.set_prior_scores(scores);
        }
        Ok(())
    }
}
