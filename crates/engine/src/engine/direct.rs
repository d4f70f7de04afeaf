//! Running one request to completion outside a server: `generate`, `teacher_force` and
//! `score`, for the CLI, benchmarks, evaluation and tests. Each drives the scheduler (or,
//! for `score`, the model directly) with nothing else in flight.

use std::time::Instant;

use anyhow::{bail, Result};
use pk_model::SeqForward;

use super::{Engine, GenerateOutput, GenerateParams};
use crate::eviction;
use crate::request::{Request, RequestOutput, SeqEvent};

impl Engine {
    /// Runs one request to completion (no other requests may be in flight), calling
    /// `on_text` with each piece of final text.
    pub fn generate(
        &mut self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        if params.n > 1 {
            bail!("generate() returns one choice; submit requests with n > 1 instead");
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let req = Request {
            prompt_ids: prompt_ids.to_vec(),
            params: params.clone(),
            cache_salt: None,
            sink: Box::new(move |e| tx.send(e).is_ok()),
        };
        self.submit(req).map_err(|e| anyhow::anyhow!("{e}"))?;
        let t0 = Instant::now();
        loop {
            self.step();
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    SeqEvent::Text { text, .. } => on_text(&text),
                    SeqEvent::Logits(_) => {}
                    SeqEvent::Error(e) => bail!("{e}"),
                    SeqEvent::Finished(o) => return Ok(self.to_generate_output(*o, t0)),
                }
            }
            if !self.has_work() {
                bail!("the request ended without a result");
            }
        }
    }

    fn to_generate_output(&self, o: RequestOutput, t0: Instant) -> GenerateOutput {
        let first = o.first_token_at.unwrap_or(o.finished_at);
        GenerateOutput {
            token_ids: o.token_ids,
            text: o.text,
            finish_reason: o.finish_reason,
            prompt_tokens: o.prompt_tokens,
            cached_prompt_tokens: o.cached_prompt_tokens,
            prefill_seconds: first.duration_since(t0).as_secs_f64(),
            decode_seconds: o.finished_at.duration_since(first).as_secs_f64(),
            kv_stored_tokens: o.kv_stored_tokens,
            kv_bytes: o.kv_blocks * self.kv_block_bytes(),
            logprobs: o.logprobs,
            context_load: o.context_load,
            prefill_keeps: o.prefill_keeps,
        }
    }

    /// Teacher-forces `continuation` after `prompt` under `params`' cache settings and
    /// returns the logits before each continuation token (`continuation.len()` rows): row i
    /// is the distribution the model predicted for `continuation[i]`. No other requests may
    /// be in flight.
    pub fn teacher_force(
        &mut self,
        prompt: &[u32],
        continuation: &[u32],
        params: &GenerateParams,
    ) -> Result<Vec<Vec<f32>>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut p = params.clone();
        p.forced_tokens = continuation.to_vec();
        p.max_tokens = continuation.len();
        p.ignore_eos = true;
        p.stop.clear();
        p.return_logits = true;
        let req = Request {
            prompt_ids: prompt.to_vec(),
            params: p,
            cache_salt: None,
            sink: Box::new(move |e| tx.send(e).is_ok()),
        };
        self.submit(req).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut rows = Vec::with_capacity(continuation.len());
        loop {
            self.step();
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    SeqEvent::Logits(l) => rows.push(l),
                    SeqEvent::Text { .. } => {}
                    SeqEvent::Error(e) => bail!("{e}"),
                    SeqEvent::Finished(_) => return Ok(rows),
                }
            }
            if !self.has_work() {
                bail!("the request ended without a result");
            }
        }
    }

    /// Runs `tokens` as a fresh sequence outside the scheduler and returns the logits rows
    /// for `tokens[logits_from..]`; the sequence is freed afterwards. For perplexity and
    /// evaluation (teacher forcing); no requests may be in flight.
    pub fn score(&mut self, tokens: &[u32], logits_from: usize) -> Result<Vec<f32>> {
        assert!(!self.has_work(), "score() runs outside the scheduler");
        let seq = self.sched.new_seq_id();
        let empty = self
            .sched
            .kv
            .get_computed_prefix(&[], self.cache_namespace.as_bytes());
        self.sched.kv.add_sequence(seq, &empty);
        let mut logits = Vec::new();
        let chunk = self.config.max_batch_tokens;
        let mut done = 0;
        let mut result = Ok(());
        while done < tokens.len() {
            let end = (done + chunk).min(tokens.len());
            let Some(slots) = self.sched.kv.allocate_slots(seq, (end - done) as u32) else {
                result = Err(anyhow::anyhow!(
                    "KV cache is full: {} tokens do not fit",
                    tokens.len()
                ));
                break;
            };
            let table = eviction::table_of(&self.sched.kv, seq);
            let window_tables = self
                .sched
                .kv
                .window_tables(seq)
                .map(<[_]>::to_vec)
                .unwrap_or_default();
            let from = logits_from.clamp(done, end) - done;
            let fwd = SeqForward {
                tokens: &tokens[done..end],
                start_position: slots.first_position as usize,
                stored_start: done,
                block_table: &table,
                logits_from: from,
                stored_positions: &[],
                window_tables: &window_tables,
                head_first_keys: &[],
            };
            match self.backend.forward(&[fwd]) {
                Ok(rows) => logits.extend(rows),
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            }
            done = end;
        }
        self.sched.kv.free(seq);
        result.map(|_| logits)
    }
}
