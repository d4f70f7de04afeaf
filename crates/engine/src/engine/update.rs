//! The update: a step's model output applied to its sequences. Prompt logprobs are recorded,
//! choices forked, tokens sampled and streamed; then, as passes over what sampling left, the
//! eviction pass (`evict`) and the reuse pass (the connector's save and the prefix cache);
//! then finished sequences leave.

use pk_kv::{KvCacheManager, SeqId};

use super::Engine;
use crate::eviction;
use crate::executor::{first_logits_row, ModelOutput};
use crate::scheduler::Chunk;

/// One chunk's sequence after sampling, for the passes that follow.
struct Sampled {
    /// Index in `running`.
    i: usize,
    finished: bool,
    /// Queries captured for the sequence's eviction policy.
    queries: Option<eviction::CapturedQueries>,
}

impl Engine {
    /// Applies a step's model output to the sequences of `chunks` (chunk `k` is
    /// `running[index[k]]`'s). Returns the number of tokens run.
    pub(super) fn update(&mut self, chunks: &[Chunk], index: &[usize], out: ModelOutput) -> usize {
        let ModelOutput {
            logits,
            mut captured,
            capture,
        } = out;
        let vocab = self.backend.config().vocab_size;
        let mut row = 0;
        let mut sampled = Vec::with_capacity(chunks.len());
        for (k, c) in chunks.iter().enumerate() {
            let i = index[k];
            let rows = c.n_tokens() - first_logits_row(&self.sched.running[i], c);
            let seq_logits = &logits[row * vocab..(row + rows) * vocab];
            row += rows;
            let finished = self.sample(i, c, seq_logits);
            let queries = (capture[k] > 0).then(|| {
                let data = std::mem::take(&mut captured[k]);
                self.captured_queries(c.seq, capture[k], data)
            });
            sampled.push(Sampled {
                i,
                finished,
                queries,
            });
        }
        for (c, s) in chunks.iter().zip(&mut sampled) {
            s.finished = self.evict_or_save(c, s);
            self.record_kv_held(s.i);
        }
        let finished: Vec<SeqId> = chunks
            .iter()
            .zip(&sampled)
            .filter(|(_, s)| s.finished)
            .map(|(c, _)| c.seq)
            .collect();
        for seq in finished {
            if let Some(i) = self.sched.index_of(seq) {
                let s = self.sched.running.remove(i);
                self.finish(s);
            }
        }
        chunks.iter().map(Chunk::n_tokens).sum()
    }

    /// Applies chunk `c`'s logits rows to `running[i]`: prompt logprobs for rows before the
    /// last, then (when the chunk ends at the sequence's last token) forked choices and the
    /// next token, sampled and streamed. Returns whether the sequence is finished.
    fn sample(&mut self, i: usize, c: &Chunk, seq_logits: &[f32]) -> bool {
        let vocab = self.backend.config().vocab_size;
        let ctx = self.backend.config().context_length;
        let from_row = first_logits_row(&self.sched.running[i], c);
        // Rows before the sampling row are prompt positions (`prompt_logprobs`).
        for (r, pos) in (c.from + from_row..c.to).enumerate() {
            let l = &seq_logits[r * vocab..(r + 1) * vocab];
            self.sched.running[i].record_prompt_logprob(pos, l);
        }
        let logits = (c.to == self.sched.running[i].all_ids.len())
            .then(|| &seq_logits[seq_logits.len() - vocab..]);
        if let Some(l) = logits {
            if self.sched.running[i].choices_to_fork > 0 {
                self.fork_choices(i, c.to, l);
            }
        }
        let s = &mut self.sched.running[i];
        if s.is_prefilling() {
            self.stats.prompt_tokens += c.n_tokens() as u64;
        }
        s.kv.num_computed = c.to;
        let mut finished = false;
        if let Some(l) = logits {
            self.stats.prompt_tokens_served += s.prompt_tokens_to_serve();
            finished = s.sample_and_emit(l, &self.tokenizer, ctx);
            self.stats.generation_tokens += 1;
        }
        finished || s.aborted
    }

    /// The passes after sampling for one chunk's sequence: eviction for an evicting one;
    /// for one whose KV is what prefill computes, the connector's save once its prompt is
    /// in and the prefix cache. Returns whether the sequence is finished.
    fn evict_or_save(&mut self, c: &Chunk, sampled: &mut Sampled) -> bool {
        let i = sampled.i;
        let s = &self.sched.running[i];
        let prefill_done = !s.is_prefilling();
        if s.eviction.is_some() {
            // Evicting sequences never feed the prefix cache: their blocks are about to
            // be compacted or removed, and a cached block would force copies.
            let queries = sampled.queries.take();
            return self.apply_eviction(i, c, queries, prefill_done, sampled.finished);
        }
        if !s.reuse.inexact {
            let during_prefill = self
                .connector
                .as_ref()
                .is_some_and(|c| c.saves_during_prefill());
            if (prefill_done || during_prefill) && s.reuse.wants_save() {
                self.save_prompt(i);
            }
            if self.config.enable_prefix_caching {
                let s = &self.sched.running[i];
                self.sched
                    .kv
                    .cache_full_blocks(c.seq, &s.all_ids[..s.kv.num_computed]);
            }
        }
        sampled.finished
    }

    /// Records what `running[i]` holds in the cache after the step, for its final report.
    pub(super) fn record_kv_held(&mut self, i: usize) {
        let s = &mut self.sched.running[i];
        let seq = s.kv.seq.expect("running");
        let kv = &self.sched.kv;
        s.kv.stored_tokens = kv
            .block_table(seq)
            .map_or(0, |t| t.num_stored_tokens() as usize);
        s.kv.blocks = held_blocks(kv, seq);
    }

    /// The queries a step captured for `seq`: the last `n_captured` stored tokens'.
    fn captured_queries(
        &self,
        seq: SeqId,
        n_captured: usize,
        data: Vec<f32>,
    ) -> eviction::CapturedQueries {
        let c = self.backend.config();
        let stored_end = self
            .sched
            .kv
            .block_table(seq)
            .map_or(0, |t| t.num_stored_tokens() as usize);
        eviction::CapturedQueries {
            n_heads: c.n_heads,
            head_dim: c.head_dim,
            positions: (stored_end - n_captured..stored_end).collect(),
            data,
        }
    }

    /// Once a non-evicting sequence's prompt is in (or after each of its prefill steps, for
    /// a connector that asks), hands what the connector has not saved of it to the
    /// connector.
    fn save_prompt(&mut self, i: usize) {
        let Some(c) = &self.connector else {
            return;
        };
        let s = &self.sched.running[i];
        if !s.is_prefilling() {
            if let Some(n) = c.kvzip_scores_wanted(s.request_key) {
                self.give_kvzip_scores(i, n);
            }
        }
        let Some(c) = &self.connector else {
            return;
        };
        let s = &mut self.sched.running[i];
        let seq = s.kv.seq.expect("running");
        s.reuse.wants_save = c.save(
            s.request_key,
            &s.all_ids,
            s.kv.num_computed,
            &self.sched.kv,
            &mut *self.backend,
            seq,
        );
    }

    /// Starts choices 1..n of `running[i]`'s request (`n > 1`) once its prompt is computed
    /// (`to` tokens): each forks the prompt's blocks (copy-on-write of the partial last
    /// one), so the prompt runs once, and samples its first token from the same `logits`.
    /// A choice with no free block for its copies waits at the queue's head and recomputes
    /// its prompt (from the prefix cache where it can).
    fn fork_choices(&mut self, i: usize, to: usize, logits: &[f32]) {
        let ctx = self.backend.config().context_length;
        let n_more = std::mem::take(&mut self.sched.running[i].choices_to_fork);
        let parent = self.sched.running[i].kv.seq.expect("running");
        for index in 1..=n_more {
            let child = self.sched.running[i].new_choice(index);
            let Some((mut child, copies)) = self.sched.fork(parent, child, to) else {
                continue;
            };
            for copy in copies {
                for slot in 0..copy.num_tokens as usize {
                    self.backend
                        .kv_mut()
                        .copy_slot((copy.src.0, slot), (copy.dst.0, slot));
                }
            }
            self.stats.generation_tokens += 1;
            self.stats.prompt_tokens_served += child.prompt_tokens_to_serve();
            if child.sample_and_emit(logits, &self.tokenizer, ctx) || child.aborted {
                self.finish(child);
            } else {
                self.sched.running.push(child);
            }
        }
    }
}

/// Blocks `seq` holds: its main table's and its window groups'.
fn held_blocks(kv: &KvCacheManager, seq: SeqId) -> usize {
    kv.block_table(seq).map_or(0, |t| t.num_blocks()) + kv.num_window_blocks(seq)
}
