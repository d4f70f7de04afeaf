//! One request through the engine, collecting its text and (optionally) its logits.
//!
//! Like `Engine::generate`/`teacher_force`, but with a cache salt: a policy that scores
//! with the last prompt queries (SnapKV, …) must prefill the whole prompt itself, because
//! with a prefix-cache hit only the last, uncached chunk would produce queries.

use anyhow::{bail, Result};
use pk_engine::{Engine, GenerateParams, Request, SeqEvent};

pub struct RunOutput {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub kv_stored_tokens: usize,
    /// One row per generated (or forced) token, with `return_logits`.
    pub logits: Vec<Vec<f32>>,
}

/// Runs one request to completion; no other request may be in flight.
pub fn run(
    engine: &mut Engine,
    prompt_ids: &[u32],
    params: GenerateParams,
    cache_salt: Option<String>,
) -> Result<RunOutput> {
    let (tx, rx) = std::sync::mpsc::channel();
    let req = Request {
        prompt_ids: prompt_ids.to_vec(),
        params,
        cache_salt,
        sink: Box::new(move |e| tx.send(e).is_ok()),
    };
    engine.submit(req).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut logits = Vec::new();
    loop {
        engine.step();
        while let Ok(ev) = rx.try_recv() {
            match ev {
                SeqEvent::Logits(l) => logits.push(l),
                SeqEvent::Text { .. } => {}
                SeqEvent::Error(e) => bail!("{e}"),
                SeqEvent::Finished(o) => {
                    return Ok(RunOutput {
                        text: o.text,
                        token_ids: o.token_ids,
                        kv_stored_tokens: o.kv_stored_tokens,
                        logits,
                    })
                }
            }
        }
        if !engine.has_work() {
            bail!("the request ended without a result");
        }
    }
}

/// Greedy generation of at most `max_tokens`.
pub fn generate(
    engine: &mut Engine,
    prompt_ids: &[u32],
    max_tokens: usize,
    kv: KvSetting,
    salt: Option<String>,
) -> Result<RunOutput> {
    let params = GenerateParams {
        max_tokens,
        kv_policy: kv.policy,
        kv_budget: kv.budget,
        kv_granularity: kv.granularity,
        ..Default::default()
    };
    run(engine, prompt_ids, params, salt)
}

/// Query-agnostic greedy generation: `prompt_ids` (the context) is prefilled and, under an
/// evicting setting, compressed before `question` is read; `question` is then forced and
/// kept whatever the budget (`kv_keep_generated`), and at most `max_tokens` follow. The
/// output's text and ids are the answer alone.
pub fn generate_after(
    engine: &mut Engine,
    prompt_ids: &[u32],
    question: &[u32],
    max_tokens: usize,
    kv: KvSetting,
    salt: Option<String>,
) -> Result<RunOutput> {
    let params = GenerateParams {
        max_tokens: question.len() + max_tokens,
        forced_tokens: question.to_vec(),
        kv_policy: kv.policy,
        kv_budget: kv.budget,
        kv_keep_generated: kv.policy.is_some(),
        kv_granularity: kv.granularity,
        ..Default::default()
    };
    let mut out = run(engine, prompt_ids, params, salt)?;
    let answer = out
        .token_ids
        .split_off(question.len().min(out.token_ids.len()));
    out.text = engine.tokenizer.decode(&answer);
    out.token_ids = answer;
    Ok(out)
}

/// Teacher-forces `continuation` after `prompt_ids`; returns one logits row per token.
pub fn teacher_force(
    engine: &mut Engine,
    prompt_ids: &[u32],
    continuation: &[u32],
    kv: KvSetting,
    salt: Option<String>,
) -> Result<RunOutput> {
    let params = GenerateParams {
        max_tokens: continuation.len(),
        ignore_eos: true,
        forced_tokens: continuation.to_vec(),
        return_logits: true,
        kv_policy: kv.policy,
        kv_budget: kv.budget,
        kv_keep_generated: kv.keep_generated,
        kv_granularity: kv.granularity,
        ..Default::default()
    };
    let out = run(engine, prompt_ids, params, salt)?;
    if out.logits.len() != continuation.len() {
        bail!(
            "teacher forcing returned {} logits rows for {} tokens",
            out.logits.len(),
            continuation.len()
        );
    }
    Ok(out)
}

/// A request's cache setting: `full` is (None, None).
#[derive(Clone, Copy, Debug)]
pub struct KvSetting {
    pub policy: Option<pk_kv::PolicySpec>,
    pub budget: Option<u32>,
    /// The budget bounds the prompt only (`GenerateParams::kv_keep_generated`).
    pub keep_generated: bool,
    /// `None`: the engine's default.
    pub granularity: Option<pk_kv::KvGranularity>,
}

impl KvSetting {
    pub const FULL: KvSetting = KvSetting {
        policy: None,
        budget: None,
        keep_generated: false,
        granularity: None,
    };
}
