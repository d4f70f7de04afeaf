//! Request fields to engine parameters: sampling, penalties, logprobs, grammars, limits;
//! every field is checked here and a bad one is a 400 naming it.

use super::*;

/// Turns the shared request fields into engine parameters, validating every one.
/// `prompt_param` names the prompt's field in errors (`prompt` or `messages`).
pub(super) fn generate_params(
    c: &CommonParams,
    prompt_param: &'static str,
    prompt_tokens: usize,
    default_max_tokens: Option<usize>,
    state: &AppState,
) -> Result<GenerateParams, ApiError> {
    check_model_and_fields(c, state)?;
    check_stream_options(c)?;
    let (kv_policy, kv_budget, kv_granularity) = kv_fields(c)?;
    let max_tokens = max_tokens(c, prompt_param, prompt_tokens, default_max_tokens, state)?;
    let sampling = sampling(c)?;
    let stop = c.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > 16 {
        return Err(ApiError::param(
            "stop",
            "at most 16 stop strings are supported",
        ));
    }
    // An empty string would match everywhere or nowhere; vLLM refuses it too.
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::param("stop", "stop strings must not be empty"));
    }
    Ok(GenerateParams {
        sampling,
        max_tokens,
        stop,
        ignore_eos: c.ignore_eos,
        kv_policy,
        kv_budget,
        kv_granularity,
        min_tokens: min_tokens(c, max_tokens)?,
        logprobs: requested_logprobs(c, prompt_param)?,
        prompt_logprobs: prompt_logprobs(c)?,
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
        n: choices(c)?,
        grammar: requested_grammar(c)?,
        ..Default::default()
    })
}

/// `model` must name the served model (404 otherwise), and no field outside the known
/// ones may ask for anything (`unsupported_field`).
fn check_model_and_fields(c: &CommonParams, state: &AppState) -> Result<(), ApiError> {
    if let Some(m) = c.model.as_ref().filter(|m| **m != state.model_name) {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "the model `{m}` does not exist; this server serves `{}`",
                state.model_name
            ),
            param: Some("model".into()),
        });
    }
    match crate::openai::unsupported_field(&c.other) {
        Some((name, message)) => Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message,
            param: Some(name),
        }),
        None => Ok(()),
    }
}

fn choices(c: &CommonParams) -> Result<usize, ApiError> {
    match c.n {
        None => Ok(1),
        Some(n) if (1..=pk_engine::MAX_CHOICES as i64).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::param(
            "n",
            format!("n must be in [1, {}], got {n}", pk_engine::MAX_CHOICES),
        )),
    }
}

/// pagekeeper's eviction fields, parsed (whether they go together is the engine's check).
type KvFields = (
    Option<pk_kv::PolicySpec>,
    Option<u32>,
    Option<pk_kv::KvGranularity>,
);

fn kv_fields(c: &CommonParams) -> Result<KvFields, ApiError> {
    let kv_policy = match &c.kv_policy {
        Some(p) => Some(
            p.parse::<pk_kv::PolicySpec>()
                .map_err(|e| ApiError::param("kv_policy", e.to_string()))?,
        ),
        None => None,
    };
    let kv_budget = match c.kv_budget {
        Some(b) if b <= 0 || b > u32::MAX as i64 => {
            return Err(ApiError::param(
                "kv_budget",
                format!("kv_budget must be a positive number of tokens, got {b}"),
            ))
        }
        Some(b) => Some(b as u32),
        None => None,
    };
    let kv_granularity = match &c.kv_granularity {
        Some(g) => Some(
            g.parse::<pk_kv::KvGranularity>()
                .map_err(|e| ApiError::param("kv_granularity", e.to_string()))?,
        ),
        None => None,
    };
    Ok((kv_policy, kv_budget, kv_granularity))
}

/// The generation limit: `max_completion_tokens` or `max_tokens` (they must agree), else
/// the endpoint's default, else what the context leaves; prompt and completion must fit
/// in the server's request limit.
fn max_tokens(
    c: &CommonParams,
    prompt_param: &'static str,
    prompt_tokens: usize,
    default_max_tokens: Option<usize>,
    state: &AppState,
) -> Result<usize, ApiError> {
    let limit = state.limits.max_total_tokens;
    if prompt_tokens >= limit {
        return Err(ApiError::param(prompt_param, format!("This model's maximum context length is {limit} tokens. However, your prompt has {prompt_tokens} tokens.")));
    }
    if let (Some(a), Some(b)) = (c.max_tokens, c.max_completion_tokens) {
        if a != b {
            return Err(ApiError::param(
                "max_completion_tokens",
                format!("max_tokens ({a}) and max_completion_tokens ({b}) disagree; give one"),
            ));
        }
    }
    let given = match c.max_completion_tokens {
        Some(m) => Some(("max_completion_tokens", m)),
        None => c.max_tokens.map(|m| ("max_tokens", m)),
    };
    let max_tokens = match given.map(|g| g.1) {
        Some(m) if m < 1 => {
            let name = given.map_or("max_tokens", |g| g.0);
            return Err(ApiError::param(
                name,
                format!("{name} must be at least 1, got {m}"),
            ));
        }
        Some(m) => m as usize,
        None => default_max_tokens.unwrap_or(limit - prompt_tokens),
    };
    if prompt_tokens + max_tokens > limit {
        return Err(ApiError::param(
            "max_tokens",
            format!("This model's maximum context length is {limit} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion).", prompt_tokens + max_tokens),
        ));
    }
    Ok(max_tokens)
}

fn logit_bias(c: &CommonParams) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(map) = &c.logit_bias else {
        return Ok(Vec::new());
    };
    if map.len() > 300 {
        return Err(ApiError::param("logit_bias", "at most 300 biased tokens"));
    }
    map.iter()
        .map(|(id, &bias)| {
            let id: u32 = id.parse().map_err(|_| {
                ApiError::param(
                    "logit_bias",
                    format!("logit_bias keys are token ids, got {id:?}"),
                )
            })?;
            Ok((id, bias))
        })
        .collect()
}

fn sampling(c: &CommonParams) -> Result<SamplingParams, ApiError> {
    let top_k = match c.top_k {
        None | Some(-1) => 0,
        Some(k) if k < 0 => {
            return Err(ApiError::param(
                "top_k",
                format!("top_k must be -1 or >= 0, got {k}"),
            ))
        }
        Some(k) => k as usize,
    };
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_k,
        top_p: c.top_p.unwrap_or(1.0),
        min_p: c.min_p.unwrap_or(0.0),
        seed: c.seed.map(|s| s as u64),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        logit_bias: logit_bias(c)?,
    };
    sampling
        .validate()
        .map_err(|e| ApiError::param(e.param, e.message))?;
    Ok(sampling)
}

fn min_tokens(c: &CommonParams, max_tokens: usize) -> Result<usize, ApiError> {
    match c.min_tokens {
        None => Ok(0),
        Some(m) if m < 0 || m as usize > max_tokens => Err(ApiError::param(
            "min_tokens",
            format!("min_tokens must be in [0, max_tokens = {max_tokens}], got {m}"),
        )),
        Some(m) => Ok(m as usize),
    }
}

/// vLLM's `prompt_logprobs`: alternatives per prompt token, not with `stream` (as vLLM).
fn prompt_logprobs(c: &CommonParams) -> Result<Option<usize>, ApiError> {
    let max = pk_engine::MAX_LOGPROBS as i64;
    match c.prompt_logprobs {
        None => Ok(None),
        Some(_) if c.stream => Err(ApiError::param(
            "prompt_logprobs",
            "prompt_logprobs is not available when stream is true (as vLLM)",
        )),
        Some(n) if (0..=max).contains(&n) => Ok(Some(n as usize)),
        Some(n) => Err(ApiError::param(
            "prompt_logprobs",
            format!("prompt_logprobs must be in [0, {max}], got {n}"),
        )),
    }
}

/// `response_format`'s keys are OpenAI's: `type`, and for `json_schema` its `name`,
/// `description` (both for the model's reader; the schema alone constrains the output),
/// `schema` and `strict` (the schema is always enforced, so either value asks for nothing
/// more). Any other key is refused by its path.
fn check_response_format_keys(rf: &Value) -> Result<(), ApiError> {
    let unknown = |path: String| {
        Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("`{path}` is not a field of response_format this server knows; remove it (a request is never answered with a field ignored)"),
            param: Some(path),
        })
    };
    let Some(top) = rf.as_object() else {
        return Err(ApiError::param(
            "response_format",
            "response_format must be an object",
        ));
    };
    let allowed_top: &[&str] = match rf.get("type").and_then(Value::as_str) {
        Some("json_schema") => &["type", "json_schema"],
        _ => &["type"],
    };
    if let Some(k) = top.keys().find(|k| !allowed_top.contains(&k.as_str())) {
        return unknown(format!("response_format.{k}"));
    }
    if let Some(inner) = rf.get("json_schema").and_then(Value::as_object) {
        let allowed = ["name", "description", "schema", "strict"];
        if let Some(k) = inner.keys().find(|k| !allowed.contains(&k.as_str())) {
            return unknown(format!("response_format.json_schema.{k}"));
        }
        if inner
            .get("strict")
            .is_some_and(|s| !s.is_boolean() && !s.is_null())
        {
            return Err(ApiError::param(
                "response_format",
                "response_format.json_schema.strict must be a boolean",
            ));
        }
    }
    Ok(())
}

/// The grammar a request constrains its output to: OpenAI's `response_format` or one of
/// vLLM's `guided_*` fields (at most one of them).
fn requested_grammar(c: &CommonParams) -> Result<Option<pk_engine::Grammar>, ApiError> {
    use pk_engine::{Grammar, GrammarSpec};
    let mut found: Vec<Grammar> = Vec::new();
    if let Some(rf) = &c.response_format {
        check_response_format_keys(rf)?;
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => {
                found.push(Grammar::new(GrammarSpec::JsonObject, "response_format"))
            }
            Some("json_schema") => {
                let Some(schema) = rf.pointer("/json_schema/schema").filter(|s| s.is_object())
                else {
                    return Err(ApiError::param(
                        "response_format",
                        "response_format json_schema needs json_schema.schema, an object",
                    ));
                };
                found.push(Grammar::new(
                    GrammarSpec::JsonSchema(schema.clone()),
                    "response_format",
                ));
            }
            _ => {
                return Err(ApiError::param(
                    "response_format",
                    format!(
                        "response_format type must be text, json_object or json_schema, got {rf}"
                    ),
                ))
            }
        }
    }
    if let Some(schema) = &c.guided_json {
        let schema = match schema {
            // vLLM accepts the schema as a JSON string too.
            Value::String(s) => serde_json::from_str(s).map_err(|e| {
                ApiError::param("guided_json", format!("guided_json is not JSON: {e}"))
            })?,
            v => v.clone(),
        };
        found.push(Grammar::new(GrammarSpec::JsonSchema(schema), "guided_json"));
    }
    if let Some(rx) = &c.guided_regex {
        found.push(Grammar::new(GrammarSpec::Regex(rx.clone()), "guided_regex"));
    }
    if let Some(choices) = &c.guided_choice {
        if choices.is_empty() {
            return Err(ApiError::param("guided_choice", "guided_choice is empty"));
        }
        found.push(Grammar::new(
            GrammarSpec::Choice(choices.clone()),
            "guided_choice",
        ));
    }
    if let Some(lark) = &c.guided_grammar {
        found.push(Grammar::new(
            GrammarSpec::Lark(lark.clone()),
            "guided_grammar",
        ));
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::param(
            found[1].param,
            format!(
                "{} and {} both constrain the output; give one",
                found[0].param, found[1].param
            ),
        )),
    }
}

/// The alternatives per token a request asks for (`None`: no logprobs), in the endpoint's
/// own form: chat's `logprobs: true` with `top_logprobs`, completions' `logprobs: N`.
fn requested_logprobs(c: &CommonParams, prompt_param: &str) -> Result<Option<usize>, ApiError> {
    let max = pk_engine::MAX_LOGPROBS as i64;
    let chat = prompt_param == "messages";
    match (&c.logprobs, chat) {
        (None | Some(Value::Null) | Some(Value::Bool(false)), true) => match c.top_logprobs {
            None | Some(0) => Ok(None),
            Some(_) => Err(ApiError::param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            )),
        },
        (Some(Value::Bool(true)), true) => match c.top_logprobs {
            None => Ok(Some(0)),
            Some(n) if (0..=max).contains(&n) => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::param(
                "top_logprobs",
                format!("top_logprobs must be in [0, {max}], got {n}"),
            )),
        },
        (Some(v), true) => Err(ApiError::param(
            "logprobs",
            format!("logprobs is a boolean on /v1/chat/completions, got {v}"),
        )),
        (_, false) if c.top_logprobs.is_some() => Err(ApiError::param(
            "top_logprobs",
            "top_logprobs is a chat field; /v1/completions takes logprobs: N",
        )),
        (None | Some(Value::Null), false) => Ok(None),
        (Some(v), false) => match v.as_i64() {
            Some(n) if (0..=max).contains(&n) => Ok(Some(n as usize)),
            _ => Err(ApiError::param(
                "logprobs",
                format!("logprobs must be an integer in [0, {max}] on /v1/completions, got {v}"),
            )),
        },
    }
}

/// `stream_options` only with `stream: true` (vLLM refuses it otherwise), and none of its
/// keys but `include_usage` asking for anything.
fn check_stream_options(c: &CommonParams) -> Result<(), ApiError> {
    let Some(o) = &c.stream_options else {
        return Ok(());
    };
    if !c.stream {
        return Err(ApiError::param(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    if let Some((name, message)) = crate::openai::unsupported_field(&o.other) {
        return Err(ApiError::param(
            "stream_options",
            format!("stream_options.{name}: {message}"),
        ));
    }
    Ok(())
}
