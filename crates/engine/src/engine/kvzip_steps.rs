//! KVzip's reconstruction passes run a piece per step (`eviction/kvzip_run.rs`): the
//! scheduler leaves a pending sequence out of the batch and gives its pass the step's
//! prompt allowance; once the last piece has run, the scores go to the sequence's policy,
//! its prompt is selected and compacted, and it decodes from the next step on.

use super::evict::NO_BLOCK_TO_COMPACT;
use super::Engine;
use crate::eviction;
use crate::eviction::kvzip_run::{KvzipRun, PassError};
use crate::request::RequestError;

impl Engine {
    /// Runs at most `max_tokens` pass tokens of `seq`, whose passes are pending (the
    /// scheduler's choice; it may have left the running set in this step's update).
    /// Returns how many ran. A pass with no free block preempts its own sequence, or
    /// fails its request when nothing else runs to give blocks back; a failed forward
    /// fails its request.
    pub(super) fn advance_kvzip_run(&mut self, seq: pk_kv::SeqId, max_tokens: usize) -> usize {
        let Some(i) = self.sched.index_of(seq) else {
            return 0;
        };
        if max_tokens == 0 || !self.sched.running[i].kvzip_pending() {
            return 0;
        }
        let ev = self.sched.running[i].eviction.as_mut().expect("evicting");
        let mut run = ev.kvzip_run.take().expect("pending");
        let result = run.advance(&mut *self.backend, &mut self.sched.kv, max_tokens);
        match result {
            Ok(n) if !run.is_done() => {
                let ev = self.sched.running[i].eviction.as_mut().expect("evicting");
                ev.kvzip_run = Some(run);
                n
            }
            Ok(n) => {
                self.finish_kvzip_run(i, run);
                n
            }
            // Decodes beside the passes took the blocks that admission set aside for
            // them: the sequence goes back to the queue, as a preempted one, and is
            // admitted again (prefill and passes anew) when blocks allow.
            Err(PassError::NoRoom(why)) if self.sched.running.len() == 1 => {
                self.record_pass_seconds(i, &run);
                let s = self.sched.running.remove(i);
                self.fail(s, RequestError::CacheFull(why));
                0
            }
            Err(PassError::NoRoom(why)) => {
                self.record_pass_seconds(i, &run);
                tracing::debug!("{why}: the sequence is preempted");
                self.sched.preempt_at(i);
                self.stats.preemptions = self.sched.stats.preemptions;
                0
            }
            Err(why @ PassError::Failed(_)) => {
                self.record_pass_seconds(i, &run);
                let s = self.sched.running.remove(i);
                self.fail(s, RequestError::Internal(why.to_string()));
                0
            }
        }
    }

    /// The passes are done: the scores go to the policy (and the score cache, for a
    /// context whose KV is what prefill computes), then selection and compaction.
    fn finish_kvzip_run(&mut self, i: usize, mut run: Box<KvzipRun>) {
        self.record_pass_seconds(i, &run);
        let queries = run.queries.take();
        let (pass, context) = (run.pass, run.context().to_vec());
        let scores = run.into_scores();
        if !self.sched.running[i].reuse.inexact {
            self.kvzip_scores.insert(pass, &context, &scores);
        }
        self.set_kvzip_prior(i, &scores);
        let s = &mut self.sched.running[i];
        let seq = s.kv.seq.expect("running");
        let ev = s.eviction.as_mut().expect("evicting");
        let stats = self
            .eviction_stats
            .entry(ev.spec.name().to_string())
            .or_default();
        let (kv, store) = (&mut self.sched.kv, self.backend.kv_mut());
        if eviction::after_prefill(ev, kv, store, seq, queries.as_ref(), stats) {
            self.record_kv_held(i);
            return;
        }
        // No block for a copy-on-write during compaction: give up on this request rather
        // than corrupt a shared block.
        let s = self.sched.running.remove(i);
        self.fail(s, RequestError::CacheFull(NO_BLOCK_TO_COMPACT.into()));
    }

    fn record_pass_seconds(&mut self, i: usize, run: &KvzipRun) {
        let ev = self.sched.running[i].eviction.as_ref().expect("evicting");
        let stats = self
            .eviction_stats
            .entry(ev.spec.name().to_string())
            .or_default();
        stats.reconstruction_forward_seconds += run.seconds.forward;
        stats.reconstruction_scoring_seconds += run.seconds.scoring;
    }
}
