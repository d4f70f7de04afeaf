//! Admission control at the door: a request is checked (prompt, sampling, logprobs, choices,
//! grammar, eviction, given prefix KV) and refused with the field it is wrong in before it
//! is queued, so that nothing the scheduler or the executor meets later is a client error.

use super::Engine;
use crate::connector::KvConnector;
use crate::eviction::SeqEviction;
use crate::params::{GenerateParams, SubmitError, MAX_CHOICES, MAX_LOGPROBS};
use crate::request::Request;
use crate::sequence::SeqState;

impl Engine {
    /// A matcher for a request's grammar: the one the caller compiled, checked, or else
    /// compiled now (so that a bad one is refused at submission, naming its field).
    fn grammar_matcher(
        &mut self,
        g: &mut crate::grammar::Grammar,
        p: &GenerateParams,
    ) -> Result<llguidance::Matcher, SubmitError> {
        check_grammar_use(g, p)?;
        let invalid = |message: String| SubmitError::InvalidParam {
            param: g.param,
            message,
        };
        if let Some(compiled) = g.compiled.take() {
            let vocab = self.tokenizer.vocab_size();
            if compiled.vocab_size() != vocab {
                return Err(invalid(format!(
                    "{} was compiled for a vocabulary of {} tokens; this model's has {vocab}",
                    g.param,
                    compiled.vocab_size()
                )));
            }
            return Ok(compiled.into_matcher());
        }
        // Compiling here holds the engine thread, and so every running sequence: callers
        // that serve other requests meanwhile compile first (`GrammarCompiler::compile`).
        self.stats.grammar_compilations += 1;
        if self.grammar.is_none() {
            let t0 = std::time::Instant::now();
            let compiler =
                crate::grammar::GrammarCompiler::new(std::sync::Arc::new(self.tokenizer.clone()))
                    .map_err(|e| invalid(format!("the grammar engine could not start: {e}")))?;
            tracing::info!(
                "grammar engine ready in {:.2} s",
                t0.elapsed().as_secs_f64()
            );
            self.grammar = Some(compiler);
        }
        let compiler = self.grammar.as_ref().expect("built above");
        compiler
            .compile(g)
            .map(crate::grammar::CompiledGrammar::into_matcher)
            .map_err(|e| invalid(e.to_string()))
    }

    /// Queues a request. Validation errors and a full queue are refused immediately.
    pub fn submit(&mut self, mut req: Request) -> Result<(), SubmitError> {
        if self.sched.waiting.len() >= self.config.max_waiting_requests {
            return Err(SubmitError::QueueFull(self.sched.waiting.len()));
        }
        self.check_prompt(&req.prompt_ids)?;
        self.check_params(&req.params)?;
        let eviction = self.eviction_for(&req.params)?;
        // The budget that applies is the request's or the server's default: choices of a
        // request evicting under either would share blocks that eviction rewrites.
        check_choices(&req.params, eviction.is_some())?;
        if let Some(p) = &req.params.prefix_kv {
            self.check_prefix_kv(&**p, req.prompt_ids.len(), eviction.is_some())?;
        }
        let namespace = self.cache_namespace.salted(req.cache_salt.as_deref());
        let matcher = match req.params.grammar.take() {
            Some(mut g) => {
                let m = self.grammar_matcher(&mut g, &req.params)?;
                req.params.grammar = Some(g);
                Some(m)
            }
            None => None,
        };
        let mut state = SeqState::new(req, namespace);
        state.eviction = eviction;
        state.sampling.matcher = matcher;
        self.sched.enqueue(state);
        Ok(())
    }

    fn check_prompt(&self, ids: &[u32]) -> Result<(), SubmitError> {
        if ids.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        let ctx = self.backend.config().context_length;
        if ids.len() >= ctx {
            return Err(SubmitError::Invalid(format!(
                "the prompt has {} tokens; the model's context is {ctx}",
                ids.len()
            )));
        }
        let vocab = self.backend.config().vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        Ok(())
    }

    fn check_params(&self, p: &GenerateParams) -> Result<(), SubmitError> {
        let invalid =
            |param: &'static str, message: String| SubmitError::InvalidParam { param, message };
        p.sampling
            .validate()
            .map_err(|e| invalid(e.param, e.message))?;
        let vocab = self.backend.config().vocab_size;
        if let Some((id, _)) = p
            .sampling
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= vocab)
        {
            return Err(invalid(
                "logit_bias",
                format!("logit_bias names token {id}, outside the vocabulary of {vocab}"),
            ));
        }
        if p.logprobs.is_some_and(|n| n > MAX_LOGPROBS) {
            return Err(invalid(
                "top_logprobs",
                format!("at most {MAX_LOGPROBS} alternatives per token"),
            ));
        }
        if p.prompt_logprobs.is_some_and(|n| n > MAX_LOGPROBS) {
            return Err(invalid(
                "prompt_logprobs",
                format!("at most {MAX_LOGPROBS} alternatives per token"),
            ));
        }
        if p.prompt_logprobs.is_some() && p.prefix_kv.is_some() {
            return Err(invalid(
                "prompt_logprobs",
                "a given prefix KV has no logits for its tokens; prompt_logprobs needs the whole prompt computed".into(),
            ));
        }
        if p.min_tokens > p.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!(
                    "min_tokens {} exceeds max_tokens {}",
                    p.min_tokens, p.max_tokens
                ),
            ));
        }
        Ok(())
    }

    fn check_prefix_kv(
        &self,
        given: &dyn KvConnector,
        prompt_tokens: usize,
        evicting: bool,
    ) -> Result<(), SubmitError> {
        let invalid = |message: String| SubmitError::InvalidParam {
            param: "prefix_kv",
            message,
        };
        if self.sched.kv.window_spec().is_some() && !given.supports_kv_groups() {
            return Err(invalid("prefix_kv with dropped tokens lacks window positions that this engine's sliding-window layers read (it keeps them in KV cache groups of their own); give a whole context, or build the engine with hybrid_kv_cache off".into()));
        }
        given
            .check_given(prompt_tokens, &self.backend.kv().geometry())
            .map_err(invalid)?;
        if evicting && !given.given_is_whole() {
            return Err(invalid(
                "prefix_kv with dropped tokens and an evicting kv_policy are exclusive".into(),
            ));
        }
        Ok(())
    }

    /// Resolves a request's policy and budget against the engine defaults.
    fn eviction_for(&self, p: &GenerateParams) -> Result<Option<SeqEviction>, SubmitError> {
        let invalid =
            |param: &'static str, message: String| SubmitError::InvalidParam { param, message };
        let budget = p.kv_budget.or(self.config.default_kv_budget);
        let no_eviction = || match (p.kv_granularity, p.record_prefill_keeps) {
            // A granularity chooses how eviction selects; with nothing evicted it would be
            // accepted and unused.
            (Some(g), _) => Err(invalid(
                "kv_granularity",
                format!("kv_granularity {g} applies only when a kv_budget evicts"),
            )),
            (None, true) => Err(invalid(
                "record_prefill_keeps",
                "record_prefill_keeps needs an evicting kv_policy and a kv_budget".into(),
            )),
            (None, false) => Ok(None),
        };
        let spec = match (p.kv_policy, budget) {
            (Some(spec), _) => spec,
            (None, Some(_)) => self.config.default_kv_policy,
            (None, None) => return no_eviction(),
        };
        if !spec.evicts() {
            if p.kv_budget.is_some() {
                return Err(invalid(
                    "kv_budget",
                    format!("kv_policy {spec} keeps every token and takes no kv_budget"),
                ));
            }
            return no_eviction();
        }
        let Some(budget) = budget else {
            return Err(invalid(
                "kv_budget",
                format!("kv_policy {spec} needs a kv_budget (tokens kept per sequence)"),
            ));
        };
        spec.validate(budget, self.config.block_size_tokens)
            .map_err(|e| invalid("kv_budget", e.to_string()))?;
        if spec.reconstruction_chunk_tokens().is_some() {
            crate::eviction::kvzip::KvzipPrompts::new(&self.tokenizer, &self.chat_template)
                .map_err(|e| invalid("kv_policy", e))?;
        }
        let granularity = p
            .kv_granularity
            .or(self.config.default_kv_granularity)
            .unwrap_or_else(|| spec.default_granularity());
        let c = self.backend.config();
        let mut units = pk_kv::selection_units(granularity, c.n_layers, c.n_kv_heads, |layer| {
            c.layer_window(layer).is_some()
        });
        if self.sched.kv.window_spec().is_some() {
            // Windowed layers have tables of their own, bounded already: eviction chooses
            // for the full-attention layers only.
            for unit in &mut units {
                unit.layers.retain(|&layer| c.layer_window(layer).is_none());
            }
            units.retain(|unit| !unit.layers.is_empty());
        }
        if spec.ragged()
            && (granularity != pk_kv::KvGranularity::Head
                || units.len() != c.n_layers * c.n_kv_heads)
        {
            return Err(invalid(
                "kv_policy",
                format!("kv_policy {spec} spends one budget over every KV head of every layer: it needs kv_granularity head, on a model without sliding-window layers"),
            ));
        }
        let mut ev = SeqEviction::new(spec, budget, granularity, units);
        // A ragged layout selects once, at prefill (see `eviction::after_decode`).
        ev.keep_generated = p.kv_keep_generated || spec.ragged();
        ev.record_keeps = p.record_prefill_keeps;
        let interval = self.config.prefill_prune_interval_tokens;
        if interval > 0 && spec.prunes_as_chunks_arrive() && self.sched.kv.window_spec().is_none() {
            ev.prune_interval_tokens = Some(interval);
        }
        Ok(Some(ev))
    }
}

/// Whether `p` can run under grammar `g`: a grammar can neither constrain forced tokens
/// nor let a sequence run past end-of-generation. Callers that compile before submitting
/// check it first, so that a request the engine would refuse is not compiled for nothing.
pub fn check_grammar_use(
    g: &crate::grammar::Grammar,
    p: &GenerateParams,
) -> Result<(), SubmitError> {
    if !p.forced_tokens.is_empty() || p.ignore_eos {
        return Err(SubmitError::InvalidParam {
            param: g.param,
            message: "a grammar cannot constrain forced tokens or run past end-of-generation (ignore_eos)".into(),
        });
    }
    Ok(())
}

/// `n` within its bounds, and not combined with what choices cannot share.
fn check_choices(p: &GenerateParams, evicts: bool) -> Result<(), SubmitError> {
    let n = p.n;
    if n == 0 || n > MAX_CHOICES {
        return Err(SubmitError::InvalidParam {
            param: "n",
            message: format!("n must be in [1, {MAX_CHOICES}], got {n}"),
        });
    }
    if n == 1 {
        return Ok(());
    }
    let clash = [
        (!p.forced_tokens.is_empty(), "forced tokens"),
        (p.return_logits, "returned logits"),
        (p.prefix_kv.is_some(), "prefix_kv"),
        (evicts, "an evicting kv_policy or a kv_budget, the request's or the server's default (choices share the prompt's blocks, which eviction rewrites)"),
    ]
    .into_iter()
    .find(|c| c.0);
    match clash {
        Some((_, what)) => Err(SubmitError::InvalidParam {
            param: "n",
            message: format!("n > 1 cannot be combined with {what}"),
        }),
        None => Ok(()),
    }
}
