//! The eviction pass of a step's update: prefill selection once a budgeted prompt is in,
//! then a block score per filled block and whole-block evictions while over budget.

use super::Engine;
use crate::eviction;
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
}
