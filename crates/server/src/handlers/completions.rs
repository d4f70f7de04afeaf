//! `POST /v1/completions`: one prompt or a list (text or token ids), `n` choices each,
//! `echo` (the prompt before each choice's text) and `suffix` (fill-in-the-middle where
//! the vocabulary has FIM tokens).

use super::*;
use pk_tokenizer::Tokenizer;

/// The most prompts one request may list.
const MAX_PROMPTS: usize = 16;
/// The most choices (prompts × n) one request may ask for.
const MAX_TOTAL_CHOICES: usize = 64;

/// Qwen2.5-Coder's (and StarCoder's) fill-in-the-middle tokens.
const FIM_TOKENS: [&str; 3] = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];

/// The request's prompts as (token ids, text for `echo`).
fn prompts(
    req: &CompletionRequest,
    tokenizer: &Tokenizer,
) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    let texts: Vec<String> = match &req.prompt {
        PromptField::Text(t) => vec![t.clone()],
        PromptField::TextBatch(v) => v.clone(),
        PromptField::Tokens(ids) => return token_prompts(req, tokenizer, vec![ids.clone()]),
        PromptField::TokensBatch(v) => return token_prompts(req, tokenizer, v.clone()),
    };
    check_count(texts.len())?;
    let suffix = req.suffix.as_deref().filter(|s| !s.is_empty());
    let fim = match suffix {
        Some(_) => Some(fim_tokens(tokenizer)?),
        None => None,
    };
    Ok(texts
        .into_iter()
        .map(|text| {
            let ids = match (suffix, &fim) {
                (Some(suffix), Some([pre, suf, mid])) => {
                    let mut ids = vec![*pre];
                    ids.extend(tokenizer.encode(&text, false));
                    ids.push(*suf);
                    ids.extend(tokenizer.encode(suffix, false));
                    ids.push(*mid);
                    ids
                }
                _ => super::encode_text(tokenizer, &text, req.common.add_special_tokens),
            };
            (ids, text)
        })
        .collect())
}

fn token_prompts(
    req: &CompletionRequest,
    tokenizer: &Tokenizer,
    prompts: Vec<Vec<u32>>,
) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param(
            "suffix",
            "suffix needs a text prompt (token-id prompts cannot be wrapped in FIM tokens)",
        ));
    }
    if req.common.add_special_tokens == Some(true) {
        return Err(ApiError::param(
            "add_special_tokens",
            "token-id prompts are run exactly as given; add_special_tokens applies to text prompts",
        ));
    }
    check_count(prompts.len())?;
    Ok(prompts
        .into_iter()
        .map(|ids| {
            let text = tokenizer.decode(&ids);
            (ids, text)
        })
        .collect())
}

fn check_count(n: usize) -> Result<(), ApiError> {
    match n {
        0 => Err(ApiError::param("prompt", "the prompt list is empty")),
        n if n > MAX_PROMPTS => Err(ApiError::param(
            "prompt",
            format!("at most {MAX_PROMPTS} prompts per request, got {n}"),
        )),
        _ => Ok(()),
    }
}

fn fim_tokens(tokenizer: &Tokenizer) -> Result<[u32; 3], ApiError> {
    let ids: Vec<Option<u32>> = FIM_TOKENS.iter().map(|t| tokenizer.token_id(t)).collect();
    match ids[..] {
        [Some(a), Some(b), Some(c)] => Ok([a, b, c]),
        _ => Err(ApiError::param(
            "suffix",
            "suffix (fill-in-the-middle) needs a model whose vocabulary has <|fim_prefix|>, <|fim_suffix|> and <|fim_middle|> (e.g. Qwen2.5-Coder); this one has not",
        )),
    }
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    check_ready(&state)?;
    let req: CompletionRequest = super::body::typed(body, state.limits.max_request_body_bytes)?;
    // Tokenizing (up to 4 MiB of text) runs on the blocking pool.
    let (req, prompts) = {
        let tokenizer = state.tokenizer.clone();
        let work = move || prompts(&req, &tokenizer).map(|p| (req, p));
        state.offload.prompt(work).await??
    };
    if prompts.iter().any(|(ids, _)| ids.is_empty()) {
        return Err(ApiError::param("prompt", "the prompt is empty"));
    }
    let mut subs = Vec::with_capacity(prompts.len());
    let mut echo_texts = Vec::new();
    let mut wants_logprobs = false;
    for (ids, text) in prompts.iter() {
        let params = generate_params(&req.common, "prompt", ids.len(), Some(16), &state)?;
        if req.echo && params.logprobs.is_some() {
            return Err(ApiError::param(
                "echo",
                "echo with logprobs would need the prompt's logprobs in the completion's logprobs, which this server does not write there; ask for prompt_logprobs instead",
            ));
        }
        if prompts.len() * params.n > MAX_TOTAL_CHOICES {
            return Err(ApiError::param(
                "n",
                format!("prompts × n may be at most {MAX_TOTAL_CHOICES}"),
            ));
        }
        wants_logprobs = params.logprobs.is_some();
        echo_texts.extend(std::iter::repeat_n(
            if req.echo {
                text.clone()
            } else {
                String::new()
            },
            params.n,
        ));
        subs.push((ids.clone(), params));
    }
    share_compiled_grammar(&state, &mut subs).await?;
    let s = submit_prompts(&state, subs, &req.common.cache_salt).await?;
    let usage_mode = StreamUsage::of(&req.common);
    if req.common.stream {
        return Ok(stream_response(
            Kind::Completion,
            s,
            state.model_name.clone(),
            usage_mode,
            wants_logprobs.then(|| state.tokenizer.clone()),
            echo_texts,
        )
        .into_response());
    }
    let prompt_tokens = s.prompt_tokens;
    let outputs = collect(s).await?;
    // Choice 0 of each prompt carries its prompt's logprobs; its siblings (`n`) repeat them.
    let choices_per_prompt = outputs.len() / prompts.len();
    let prompt_lps: Vec<Value> = match req.common.prompt_logprobs.is_some() {
        true => outputs
            .iter()
            .filter(|o| o.choice % choices_per_prompt == 0)
            .map(|o| crate::logprobs::prompt(&state.tokenizer, &o.prompt_logprobs))
            .collect(),
        false => Vec::new(),
    };
    let choices: Vec<Value> = outputs
        .iter()
        .map(|o| {
            let text = format!("{}{}", echo_texts[o.choice], o.text);
            let mut c = json!({"index": o.choice, "text": text, "logprobs": match wants_logprobs {
                true => crate::logprobs::completion(&state.tokenizer, &o.logprobs, 0),
                false => Value::Null,
            }, "finish_reason": finish_str(o.finish_reason)});
            if let Some(p) = prompt_lps.get(o.choice / choices_per_prompt) {
                c["prompt_logprobs"] = p.clone();
            }
            c
        })
        .collect();
    Ok(Json(json!({
        "id": new_id("cmpl"), "object": "text_completion", "created": now_unix(), "model": state.model_name,
        "choices": choices,
        "usage": usage_of(prompt_tokens, &outputs),
    }))
    .into_response())
}

/// Queues every prompt's request, all or none (`Command::SubmitAll`), and merges their
/// events into one response's.
async fn submit_prompts(
    state: &AppState,
    subs: Vec<(Vec<u32>, GenerateParams)>,
    cache_salt: &Option<String>,
) -> Result<Submitted, ApiError> {
    let mut reqs = Vec::with_capacity(subs.len());
    let mut submitted = Vec::with_capacity(subs.len());
    for (ids, params) in subs {
        let (r, s) = prepare(state, ids, params, cache_salt.clone()).await?;
        reqs.push(r);
        submitted.push(s);
    }
    state
        .engine
        .submit_all(reqs)
        .await
        .map_err(|e| submit_error_in(e, "prompt"))?;
    Ok(merge(submitted))
}

/// The prompts' grammar (the same for each) compiled once, on the blocking pool; every
/// prompt gets its own copy of the matcher.
async fn share_compiled_grammar(
    state: &AppState,
    subs: &mut [(Vec<u32>, GenerateParams)],
) -> Result<(), ApiError> {
    let Some(((_, first), rest)) = subs.split_first_mut() else {
        return Ok(());
    };
    *first = super::compile_grammar(state, std::mem::take(first)).await?;
    for (_, params) in rest {
        params.grammar = first.grammar.clone();
    }
    Ok(())
}

/// One stream of events for several submitted prompts: prompt i's choice j becomes choice
/// `i × n + j` (OpenAI's numbering), and the prompt tokens add up.
fn merge(mut subs: Vec<Submitted>) -> Submitted {
    if subs.len() == 1 {
        return subs.pop().expect("one");
    }
    let (tx, rx) = event_channel(MAX_UNREAD_EVENTS);
    let tx = Arc::new(tx);
    let mut offset = 0;
    let mut prompt_tokens = 0;
    for s in subs {
        let (n, tx) = (s.n, tx.clone());
        prompt_tokens += s.prompt_tokens;
        let mut sub_rx = s.rx;
        // Forwarding stops when the merged receiver is gone (client gone); dropping each
        // sub-receiver then aborts that prompt's sequences at their next token.
        tokio::spawn(async move {
            while let Some(mut ev) = sub_rx.recv().await {
                match &mut ev {
                    SeqEvent::Text { choice, .. } => *choice += offset,
                    SeqEvent::Finished(o) => o.choice += offset,
                    _ => {}
                }
                if !tx.send(ev) {
                    break;
                }
            }
        });
        offset += n;
    }
    Submitted {
        rx,
        prompt_tokens,
        n: offset,
    }
}
