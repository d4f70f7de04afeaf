//! Per-request state inside the scheduler: tokens, progress, sampling and text streaming.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use pk_kv::SeqId;
use pk_tokenizer::{StreamDecoder, Tokenizer};

use crate::connector::{LoadOrigin, Lookup, RequestKey};
use crate::eviction::SeqEviction;
use crate::params::FinishReason;
use crate::request::{EventSink, Request, RequestOutput, SeqEvent};
use crate::sampler::{process_logits, token_logprob, Sampler, TokenHistory, TokenLogprob};
use crate::stop::StopMatcher;

/// A sequence's dealings with a KV connector, as far as the engine decides by them (what
/// a connector keeps of a request, it keeps itself under the request's key).
#[derive(Debug, Clone, Default)]
pub(crate) struct SeqReuse {
    /// While waiting: the connector's answer for `all_ids` of this length (asked again only
    /// when a preemption has changed the tokens).
    pub probe: Option<(usize, Lookup)>,
    /// The connector wants the prompt's KV once it is computed.
    pub wants_save: bool,
    /// The sequence's KV is not what prefill computes (a compressed context or a given
    /// prefix): it never feeds the prefix cache or the connector.
    pub inexact: bool,
    /// Where its loaded KV came from, if a connector reported it.
    pub load: Option<LoadOrigin>,
}

impl SeqReuse {
    /// Whether the connector still wants this prompt's KV once it is computed.
    pub fn wants_save(&self) -> bool {
        !self.inexact && self.wants_save
    }
}

/// A sequence's place in the KV cache: its block table and how much of it is computed.
#[derive(Debug, Clone, Default)]
pub(crate) struct SeqKv {
    /// The block table's id while admitted; `None` while waiting (also after preemption).
    pub seq: Option<SeqId>,
    /// Tokens of `all_ids` whose K/V is in the cache.
    pub num_computed: usize,
    /// Prompt tokens found in the prefix cache or a connector at first admission.
    pub cached_prompt_tokens: usize,
    pub preemptions: usize,
    /// Stored tokens after the last step, for the final report.
    pub stored_tokens: usize,
    /// Blocks held after the last step (main table and window groups).
    pub blocks: usize,
}

/// How the next token is chosen: the sampler, the logits processors' history and the
/// grammar.
pub(crate) struct SeqSampling {
    sampler: Sampler,
    /// Generated-token counts (and the prompt's ids) for the logits processors.
    history: TokenHistory,
    /// The request's grammar, advanced by every generated token (structured output).
    pub matcher: Option<llguidance::Matcher>,
    /// Masks computed for the grammar and their time, for the engine's stats.
    pub grammar_masks: u64,
    pub grammar_mask_seconds: f64,
}

/// What the sequence has reported and still holds back: text (detokenized, stop strings
/// held back while one may be starting), ids, log-probabilities and token times.
struct SeqOutput {
    /// Every generated token's log-probabilities (with `logprobs`), and those not yet
    /// reported with a `Text` event.
    logprobs: Vec<TokenLogprob>,
    unreported_logprobs: Vec<TokenLogprob>,
    decoder: StreamDecoder,
    stop: StopMatcher,
    /// Generated ids not yet reported with a `Text` event.
    unreported_ids: Vec<u32>,
    /// When each generated token of `all_ids[n_prompt..]` was sampled, one per token, so
    /// that the server can observe every gap between consecutive tokens.
    token_times: Vec<Instant>,
    first_token_at: Option<Instant>,
    finish_reason: Option<FinishReason>,
    /// With `prompt_logprobs`: entry `t` is prompt token `t`'s log-probability given the
    /// tokens before it (`None` for the first, which has none), filled as prefill runs.
    prompt_logprobs: Vec<Option<TokenLogprob>>,
}

/// One sequence: its request and tokens, then one part per concern.
pub(crate) struct SeqState {
    pub req: Request,
    /// The request's name towards connectors (the scheduler gives it at enqueue and fork).
    pub request_key: RequestKey,
    /// Prefix-cache bytes: the engine's cache namespace and the request's salt.
    pub namespace: Vec<u8>,
    /// Prompt followed by generated tokens; index = absolute position.
    pub all_ids: Vec<u32>,
    pub n_prompt: usize,
    pub kv: SeqKv,
    pub eviction: Option<SeqEviction>,
    /// What the sequence asked of, got from and gives to the engine's KV reuse connector.
    pub reuse: SeqReuse,
    pub sampling: SeqSampling,
    output: SeqOutput,
    pub aborted: bool,
    arrival: Instant,
    /// When the scheduler first admitted the sequence (a preempted one keeps its first
    /// admission), for the queue and prefill times.
    pub scheduled_at: Option<Instant>,
    /// Which of the request's `n` choices this sequence is (0 for the first).
    pub choice: usize,
    /// Sibling choices still to fork from this one when its first token is sampled.
    pub choices_to_fork: usize,
    /// The request's sink once siblings share it.
    shared_sink: Option<Arc<Mutex<EventSink>>>,
}

impl SeqState {
    pub fn new(req: Request, namespace: Vec<u8>) -> SeqState {
        let all_ids = req.prompt_ids.clone();
        let req_n_minus_1 = req.params.n.saturating_sub(1);
        let req_prompt_logprobs = req.params.prompt_logprobs.is_some();
        SeqState {
            n_prompt: all_ids.len(),
            sampling: SeqSampling {
                sampler: Sampler::new(req.params.sampling.clone()),
                history: TokenHistory::new(&all_ids, &req.params.sampling),
                matcher: None,
                grammar_masks: 0,
                grammar_mask_seconds: 0.0,
            },
            output: SeqOutput {
                logprobs: Vec::new(),
                unreported_logprobs: Vec::new(),
                decoder: StreamDecoder::new(),
                stop: StopMatcher::new(&req.params.stop),
                unreported_ids: Vec::new(),
                token_times: Vec::new(),
                first_token_at: None,
                finish_reason: None,
                prompt_logprobs: match req_prompt_logprobs {
                    true => vec![None],
                    false => Vec::new(),
                },
            },
            req,
            namespace,
            all_ids,
            kv: SeqKv::default(),
            aborted: false,
            eviction: None,
            reuse: SeqReuse::default(),
            request_key: 0,
            arrival: Instant::now(),
            scheduled_at: None,
            choice: 0,
            choices_to_fork: req_n_minus_1,
            shared_sink: None,
        }
    }

    /// Choice `index` of an `n > 1` request, forked from this one (choice 0) once its
    /// prompt is in and before its first token is sampled: the same tokens and progress, a
    /// sampler of its own (seed + index), and the request's sink shared. The caller gives
    /// it a block table (a fork of this one's, or none: it then recomputes the prompt).
    pub fn new_choice(&mut self, index: usize) -> SeqState {
        let shared = match &self.shared_sink {
            Some(shared) => shared.clone(),
            None => {
                let sink = std::mem::replace(&mut self.req.sink, Box::new(|_| true));
                let shared = Arc::new(Mutex::new(sink));
                self.req.sink = forward_to(shared.clone());
                self.shared_sink = Some(shared.clone());
                shared
            }
        };
        let mut params = self.req.params.clone();
        params.sampling.seed = params.sampling.seed.map(|s| s.wrapping_add(index as u64));
        params.n = 1;
        // The prompt's logprobs are choice 0's; a fork never computes the prompt's rows.
        params.prompt_logprobs = None;
        let req = Request {
            prompt_ids: self.req.prompt_ids.clone(),
            params,
            cache_salt: self.req.cache_salt.clone(),
            sink: forward_to(shared),
        };
        let mut child = SeqState::new(req, self.namespace.clone());
        child.choice = index;
        child.shared_sink = self.shared_sink.clone();
        child.sampling.matcher = self.sampling.matcher.as_ref().map(|m| m.deep_clone());
        child.all_ids = self.all_ids.clone();
        child.kv.num_computed = self.kv.num_computed;
        child.kv.cached_prompt_tokens = self.kv.cached_prompt_tokens;
        child.arrival = self.arrival;
        child.scheduled_at = self.scheduled_at;
        child
    }

    /// Whether KVzip's passes over the prompt are in progress (the sequence then waits).
    pub fn kvzip_pending(&self) -> bool {
        self.eviction
            .as_ref()
            .is_some_and(|e| e.kvzip_run.is_some())
    }

    /// Frees what the sequence holds besides its own table: the fork of KVzip's passes in
    /// progress. Called wherever a sequence leaves the running set.
    pub fn release_extra_kv(&mut self, kv: &mut pk_kv::KvCacheManager) {
        if let Some(ev) = self.eviction.as_mut() {
            ev.release_kvzip_run(kv);
        }
    }

    /// More than one token to compute: a prompt (or, after preemption, a recompute). An
    /// evicting sequence's recompute is a prefill of its prompt only; its generated tokens
    /// are then replayed one per step, as decode (`max_chunk`), so that every eviction
    /// happens over the same cache as the first time.
    pub fn is_prefilling(&self) -> bool {
        if self.eviction.is_some() {
            return self.kv.num_computed < self.n_prompt;
        }
        self.all_ids.len() - self.kv.num_computed > 1 || self.kv.num_computed < self.n_prompt
    }

    /// The most tokens the next chunk may compute: an evicting sequence's prompt ends its
    /// prefill chunk (its selection runs there), and its replayed tokens go one at a time.
    pub fn max_chunk(&self) -> usize {
        match (&self.eviction, self.kv.num_computed < self.n_prompt) {
            (None, _) => usize::MAX,
            // A prompt pruned as its chunks arrive also ends chunks at its pruning points.
            (Some(ev), true) => {
                let left = self.n_prompt - self.kv.num_computed;
                match ev.prune_interval_tokens {
                    Some(n) => left.min(n - self.kv.num_computed % n),
                    None => left,
                }
            }
            (Some(_), false) => 1,
        }
    }

    /// Whether prompt tokens still lack their `prompt_logprobs` entry.
    pub fn wants_prompt_rows(&self) -> bool {
        self.req.params.prompt_logprobs.is_some()
            && self.output.prompt_logprobs.len() < self.n_prompt
    }

    /// The first position in `from..to` whose logits give a missing prompt logprob (the
    /// logits at position `p` score prompt token `p + 1`).
    pub fn first_prompt_logprob_position(&self, from: usize, to: usize) -> Option<usize> {
        if !self.wants_prompt_rows() {
            return None;
        }
        let pos = (self.output.prompt_logprobs.len() - 1).max(from);
        (pos < to).then_some(pos)
    }

    /// Records prompt token `pos + 1`'s logprob from the logits at `pos`, if it is the next
    /// one missing (a recompute after preemption finds it recorded already).
    pub fn record_prompt_logprob(&mut self, pos: usize, logits: &[f32]) {
        let t = pos + 1;
        if let (Some(n_top), true) = (
            self.req.params.prompt_logprobs,
            t == self.output.prompt_logprobs.len() && t < self.n_prompt,
        ) {
            let lp = token_logprob(logits, self.all_ids[t], n_top);
            self.output.prompt_logprobs.push(Some(lp));
        }
    }

    /// Absolute (RoPE) position of `all_ids[i]`.
    pub fn position_of(&self, i: usize) -> usize {
        i
    }

    /// The prompt's tokens while no token has been sampled yet (the choice's prefill
    /// ends with the next sample), otherwise 0: what `EngineStats::prompt_tokens_served`
    /// adds for this choice's next sample.
    pub fn prompt_tokens_to_serve(&self) -> u64 {
        if self.generated() == 0 {
            self.n_prompt as u64
        } else {
            0
        }
    }

    fn generated(&self) -> usize {
        self.all_ids.len() - self.n_prompt
    }

    /// Samples the next token from `logits`, streams its text, and returns whether the
    /// sequence is finished.
    pub fn sample_and_emit(
        &mut self,
        logits: &[f32],
        tokenizer: &Tokenizer,
        context_length: usize,
    ) -> bool {
        if self.req.params.return_logits && !(self.req.sink)(SeqEvent::Logits(logits.to_vec())) {
            self.aborted = true;
            return true;
        }
        let Some(processed) = self.processed_logits(logits, tokenizer) else {
            // The grammar cannot continue (an engine limit): end here rather than emit text
            // outside it.
            self.output.finish_reason = Some(FinishReason::Stop);
            return true;
        };
        let params = &self.req.params;
        let forced = params.forced_tokens.get(self.generated()).copied();
        let id = match forced {
            Some(forced) => forced,
            None => self.sampling.sampler.sample(&processed),
        };
        let sampled_at = Instant::now();
        self.output.first_token_at.get_or_insert(sampled_at);
        // A forced end-of-generation token is text the caller chose (a chat turn's end
        // inside a forced question), not the model ending its answer.
        if !params.ignore_eos && forced.is_none() && tokenizer.is_eog(id) {
            self.output.finish_reason = Some(FinishReason::Stop);
            return true;
        }
        if let Some(n_top) = params.logprobs {
            let lp = token_logprob(&processed, id, n_top);
            self.output.logprobs.push(lp.clone());
            self.output.unreported_logprobs.push(lp);
        }
        if let Some(m) = self.sampling.matcher.as_mut() {
            if let Err(e) = m.consume_token(id) {
                tracing::warn!("grammar refused token {id}: {e}");
                self.output.finish_reason = Some(FinishReason::Stop);
                return true;
            }
        }
        self.emit(id, sampled_at, tokenizer, context_length)
    }

    /// Logits processors (penalties, bias, banned end-of-generation before `min_tokens`,
    /// the grammar's mask) applied to a copy of `logits`, made only when one is active.
    /// `None` when the grammar cannot continue.
    fn processed_logits<'a>(
        &mut self,
        logits: &'a [f32],
        tokenizer: &Tokenizer,
    ) -> Option<std::borrow::Cow<'a, [f32]>> {
        let params = &self.req.params;
        let banned = match self.generated() < params.min_tokens && !params.ignore_eos {
            true => tokenizer.eog_ids(),
            false => &[],
        };
        if !params.sampling.processes_logits()
            && banned.is_empty()
            && self.sampling.matcher.is_none()
        {
            return Some(std::borrow::Cow::Borrowed(logits));
        }
        let mut l = logits.to_vec();
        process_logits(&mut l, &params.sampling, &self.sampling.history, banned);
        if let Some(m) = self.sampling.matcher.as_mut() {
            let t0 = Instant::now();
            let masked = crate::grammar::mask_logits(m, &mut l);
            self.sampling.grammar_masks += 1;
            self.sampling.grammar_mask_seconds += t0.elapsed().as_secs_f64();
            if let Err(e) = masked {
                tracing::warn!("grammar stopped the sequence: {e}");
                return None;
            }
        }
        Some(std::borrow::Cow::Owned(l))
    }

    /// Appends the sampled `id` (sampled at `sampled_at`), streams its text (held back
    /// while a stop string may be starting), and returns whether the sequence is finished.
    fn emit(
        &mut self,
        id: u32,
        sampled_at: Instant,
        tokenizer: &Tokenizer,
        context_length: usize,
    ) -> bool {
        self.sampling.history.push_output(id);
        self.all_ids.push(id);
        self.output.token_times.push(sampled_at);
        self.output.unreported_ids.push(id);
        let piece = match self.req.params.skip_special_tokens && tokenizer.is_control(id) {
            true => self.output.decoder.push_bytes(&[]),
            false => self.output.decoder.push(tokenizer, id),
        };
        let (text, hit) = self.output.stop.push(&piece);
        if !text.is_empty() || hit {
            let ids = std::mem::take(&mut self.output.unreported_ids);
            let logprobs = std::mem::take(&mut self.output.unreported_logprobs);
            if !(self.req.sink)(SeqEvent::Text {
                choice: self.choice,
                text,
                token_ids: ids,
                logprobs,
            }) {
                self.aborted = true;
                return true;
            }
        }
        if hit {
            self.output.finish_reason = Some(FinishReason::Stop);
            return true;
        }
        let params = &self.req.params;
        if self.generated() >= params.max_tokens || self.all_ids.len() >= context_length {
            self.output.finish_reason = Some(FinishReason::Length);
            return true;
        }
        false
    }

    /// The final result; flushes held-back text as a last `Text` event.
    pub fn output(&mut self) -> RequestOutput {
        let tail = self.output.stop.finish(&self.output.decoder.finish());
        if !tail.is_empty() || !self.output.unreported_ids.is_empty() {
            let ids = std::mem::take(&mut self.output.unreported_ids);
            (self.req.sink)(SeqEvent::Text {
                choice: self.choice,
                text: tail,
                token_ids: ids,
                logprobs: std::mem::take(&mut self.output.unreported_logprobs),
            });
        }
        RequestOutput {
            token_ids: self.all_ids[self.n_prompt..].to_vec(),
            text: self.output.stop.text().to_string(),
            finish_reason: self.output.finish_reason.unwrap_or(FinishReason::Length),
            prompt_tokens: self.n_prompt,
            cached_prompt_tokens: self.kv.cached_prompt_tokens,
            arrival: self.arrival,
            choice: self.choice,
            scheduled_at: self.scheduled_at,
            first_token_at: self.output.first_token_at,
            token_times: self.output.token_times.clone(),
            finished_at: Instant::now(),
            num_preemptions: self.kv.preemptions,
            kv_stored_tokens: self.kv.stored_tokens,
            kv_blocks: self.kv.blocks,
            logprobs: self.output.logprobs.clone(),
            prompt_logprobs: std::mem::take(&mut self.output.prompt_logprobs),
            context_load: self.reuse.load.clone(),
            prefill_keeps: self
                .eviction
                .as_mut()
                .and_then(|ev| ev.recorded_keeps.take()),
        }
    }
}

/// A sink that hands events to a sink shared by a request's choices.
fn forward_to(shared: Arc<Mutex<EventSink>>) -> EventSink {
    Box::new(move |event| {
        let mut sink = shared.lock().unwrap_or_else(|e| e.into_inner());
        (*sink)(event)
    })
}
