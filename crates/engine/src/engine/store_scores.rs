//! KVzip's scores of a context that the connector stores (issue 37, `kvzip-R` in an
//! EVICPRESS grid): the same reconstruction passes as the `kvzip` policy, over the stored
//! prefix of a prompt whose KV is what prefill computed, run after the request's first
//! token is out (never on the path of a hit, whose context already has its scores).

use pk_kv::{KvzipPass, SelectionUnit};

use super::Engine;
use crate::eviction::kvzip::{self, KvzipPrompts};

impl Engine {
    /// Scores the first `n_tokens` of `running[i]`'s prompt and hands them to the
    /// connector. A prefix that cannot be scored (beyond what is computed, no free block
    /// for a pass) is counted and left without scores: its KVzip configurations are then
    /// unavailable in the store, and nothing else changes.
    pub(super) fn give_kvzip_scores(&mut self, i: usize, n_tokens: usize) {
        let started = std::time::Instant::now();
        match self.kvzip_prefix_scores(i, n_tokens) {
            Ok(scores) => {
                let request = self.sched.running[i].request_key;
                if let Some(c) = &self.connector {
                    c.give_kvzip_scores(request, scores);
                }
                self.stats.kvzip_store_scored += 1;
            }
            Err(why) => {
                tracing::warn!("KVzip scores of a stored context: {why}; stored without them");
                self.stats.kvzip_store_failed += 1;
            }
        }
        self.stats.kvzip_store_seconds += started.elapsed().as_secs_f64();
    }

    /// One score per token of the prompt's first `n_tokens`: the mean over every layer
    /// and KV head of KVzip's `[layer][kv_head][token]` scores. The passes run on a fork
    /// of the sequence cut back to those tokens, so the rest of the prompt (the question)
    /// is not part of the context they reconstruct; the sequence itself is untouched.
    fn kvzip_prefix_scores(&mut self, i: usize, n_tokens: usize) -> Result<Vec<f32>, String> {
        let s = &self.sched.running[i];
        if n_tokens == 0 || n_tokens > s.kv.num_computed {
            return Err(format!(
                "{n_tokens} tokens asked, {} computed",
                s.kv.num_computed
            ));
        }
        let seq = s.kv.seq.expect("running");
        let context = s.all_ids[..n_tokens].to_vec();
        let c = self.backend.config();
        let (n_layers, n_kv_heads) = (c.n_layers, c.n_kv_heads);
        let scores = match self.kvzip_scores.get(KvzipPass::default(), &context) {
            Some(scores) => scores,
            None => {
                let scores = self.prefix_passes(seq, &context)?;
                self.kvzip_scores
                    .insert(KvzipPass::default(), &context, &scores);
                scores
            }
        };
        let every = SelectionUnit {
            layers: (0..n_layers).collect(),
            kv_head: None,
        };
        Ok(kvzip::unit_scores(&scores, &every, n_kv_heads, n_tokens))
    }

    /// KVzip's passes over `context`, the first tokens of `seq`, on a fork of `seq` cut
    /// back to them (sharing its blocks: the cut falls on a chunk boundary, and a partial
    /// block is copied on write).
    fn prefix_passes(&mut self, seq: pk_kv::SeqId, context: &[u32]) -> Result<Vec<f32>, String> {
        let prompts = KvzipPrompts::new(&self.tokenizer, &self.chat_template)?;
        let no_room = || "no free KV block for the fork".to_string();
        let prefix = self.sched.new_seq_id();
        let copies = self.sched.kv.fork(seq, prefix).ok_or_else(no_room)?;
        for copy in copies {
            for slot in 0..copy.num_tokens as usize {
                self.backend
                    .kv_mut()
                    .copy_slot((copy.src.0, slot), (copy.dst.0, slot));
            }
        }
        let Some(moves) = self.sched.kv.truncate(prefix, context.len() as u32) else {
            self.sched.kv.free(prefix);
            return Err(no_room());
        };
        for m in moves {
            self.backend.kv_mut().copy_slot(
                (m.src.block_id.0, m.src.offset_tokens as usize),
                (m.dst.block_id.0, m.dst.offset_tokens as usize),
            );
        }
        let child = self.sched.new_seq_id();
        let mut seconds = kvzip::PassSeconds::default();
        let scores = kvzip::reconstruction_scores(
            &mut *self.backend,
            &mut self.sched.kv,
            (prefix, child),
            context,
            (&prompts, KvzipPass::default()),
            &mut seconds,
        );
        self.sched.kv.free(prefix);
        scores
    }
}
