//! Server-sent event streams in OpenAI's chunk shapes, one or more choices interleaved.

use super::*;

/// What differs between the two endpoints' stream chunks.
#[derive(Clone, Copy)]
pub(super) enum Kind {
    Completion,
    Chat,
}

#[allow(clippy::too_many_arguments)]
fn chunk(
    kind: Kind,
    index: usize,
    id: &str,
    created: u64,
    model: &str,
    text: Option<&str>,
    finish: Option<&str>,
    first: bool,
    logprobs: Value,
) -> Value {
    match kind {
        Kind::Completion => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}],
        }),
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
    }
}

/// Renders streamed tokens' logprobs (`None` when the request asked for none): chat's
/// shape, or completions' with text offsets continuing across a choice's chunks.
struct StreamLogprobs {
    tokenizer: Arc<pk_tokenizer::Tokenizer>,
    kind: Kind,
    /// Per choice.
    text_offsets: Vec<usize>,
}

impl StreamLogprobs {
    fn render(
        this: &mut Option<StreamLogprobs>,
        choice: usize,
        tokens: &[pk_engine::TokenLogprob],
    ) -> Value {
        let Some(l) = this else { return Value::Null };
        match l.kind {
            Kind::Chat => crate::logprobs::chat(&l.tokenizer, tokens),
            Kind::Completion => {
                let offset = &mut l.text_offsets[choice];
                let v = crate::logprobs::completion(&l.tokenizer, tokens, *offset);
                *offset += crate::logprobs::text_len(&l.tokenizer, tokens);
                v
            }
        }
    }
}

/// Which usage a stream reports (`stream_options`).
#[derive(Debug, Clone, Copy)]
pub(super) struct StreamUsage {
    /// `include_usage`: a last chunk with the request's usage.
    pub at_end: bool,
    /// `continuous_usage_stats`: every chunk with its choice's usage so far.
    pub every_chunk: bool,
}

impl StreamUsage {
    pub fn of(c: &crate::openai::CommonParams) -> StreamUsage {
        let o = c.stream_options.as_ref();
        StreamUsage {
            at_end: o.is_some_and(|o| o.include_usage),
            every_chunk: o.is_some_and(|o| o.continuous_usage_stats),
        }
    }
}

pub(super) fn stream_response(
    kind: Kind,
    s: Submitted,
    model: String,
    usage: StreamUsage,
    logprobs: Option<Arc<pk_tokenizer::Tokenizer>>,
    echo: Vec<String>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let n = s.n;
    let include_usage = usage.at_end;
    // vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far.
    let mut tokens_so_far = vec![0usize; n];
    let prompt_tokens = s.prompt_tokens;
    let with_usage = move |mut c: Value, completion_tokens: usize| {
        if usage.every_chunk {
            c["usage"] = json!(Usage::new(prompt_tokens, completion_tokens, 0));
        }
        c
    };
    let mut logprobs = logprobs.map(|tokenizer| StreamLogprobs {
        tokenizer,
        kind,
        text_offsets: vec![0; n],
    });
    let id = new_id(match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    });
    let created = now_unix();
    let mut rx = s.rx;
    let stream = async_stream(move |yield_| async move {
        // Chat streams open every choice with its role.
        if let Kind::Chat = kind {
            for index in 0..n {
                let c = chunk(
                    kind,
                    index,
                    &id,
                    created,
                    &model,
                    Some(""),
                    None,
                    true,
                    Value::Null,
                );
                let c = with_usage(c, 0);
                if !yield_(Event::default().data(c.to_string())).await {
                    return;
                }
            }
        }
        // `echo`: each choice's prompt text first.
        for (index, text) in echo.iter().enumerate().filter(|(_, t)| !t.is_empty()) {
            let c = chunk(
                kind,
                index,
                &id,
                created,
                &model,
                Some(text),
                None,
                false,
                Value::Null,
            );
            let c = with_usage(c, 0);
            if !yield_(Event::default().data(c.to_string())).await {
                return;
            }
        }
        // Per choice: logprobs of tokens whose text is still held back ride with its next
        // text.
        let mut pending: Vec<Vec<pk_engine::TokenLogprob>> = vec![Vec::new(); n];
        let mut outputs: Vec<RequestOutput> = Vec::with_capacity(n);
        while let Some(ev) = rx.recv().await {
            match ev {
                SeqEvent::Logits(_) => {}
                SeqEvent::Text {
                    choice,
                    text,
                    logprobs: token_logprobs,
                    token_ids,
                } => {
                    tokens_so_far[choice] += token_ids.len();
                    pending[choice].extend(token_logprobs);
                    if !text.is_empty() {
                        let tokens = std::mem::take(&mut pending[choice]);
                        let lp = StreamLogprobs::render(&mut logprobs, choice, &tokens);
                        let c = chunk(
                            kind,
                            choice,
                            &id,
                            created,
                            &model,
                            Some(&text),
                            None,
                            false,
                            lp,
                        );
                        let c = with_usage(c, tokens_so_far[choice]);
                        if !yield_(Event::default().data(c.to_string())).await {
                            return;
                        }
                    }
                }
                SeqEvent::Finished(o) => {
                    let fin = finish_str(o.finish_reason);
                    let text = match kind {
                        Kind::Completion => Some(""),
                        Kind::Chat => None,
                    };
                    let tokens = std::mem::take(&mut pending[o.choice]);
                    let lp = match tokens.is_empty() {
                        true => Value::Null,
                        false => StreamLogprobs::render(&mut logprobs, o.choice, &tokens),
                    };
                    let c = chunk(
                        kind,
                        o.choice,
                        &id,
                        created,
                        &model,
                        text,
                        Some(fin),
                        false,
                        lp,
                    );
                    let c = with_usage(c, o.token_ids.len());
                    if !yield_(Event::default().data(c.to_string())).await {
                        return;
                    }
                    outputs.push(*o);
                    if outputs.len() < n {
                        continue;
                    }
                    if include_usage {
                        let obj = match kind {
                            Kind::Completion => "text_completion",
                            Kind::Chat => "chat.completion.chunk",
                        };
                        outputs.sort_by_key(|o| o.choice);
                        let usage = usage_of(prompt_tokens, &outputs);
                        let v = json!({"id": id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage});
                        yield_(Event::default().data(v.to_string())).await;
                    }
                    break;
                }
                SeqEvent::Error(e) => {
                    // The status line went out with the stream's first byte; the error
                    // event carries the status the request would have had.
                    let a = request_error(&e);
                    let v = json!({"error": {"message": a.message, "type": a.error_type(), "param": null, "code": a.status.as_u16()}});
                    yield_(Event::default().data(v.to_string())).await;
                    break;
                }
            }
        }
        yield_(Event::default().data("[DONE]")).await;
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// A tiny generator: runs `f` with a callback that feeds a channel-backed stream, so the
/// SSE body can be written as straight-line async code without another dependency.
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(Box<dyn Fn(Event) -> futures::future::BoxFuture<'static, bool> + Send + Sync>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    // Bounded: a slow client applies back-pressure instead of buffering without limit.
    let (tx, rx) = mpsc::channel::<Event>(64);
    let send: Box<dyn Fn(Event) -> futures::future::BoxFuture<'static, bool> + Send + Sync> =
        Box::new(move |e| {
            let tx = tx.clone();
            // `false` once the client is gone: the caller then stops, dropping the request's
            // event receiver, and the engine aborts the sequence at its next token.
            Box::pin(async move { tx.send(e).await.is_ok() })
        });
    tokio::spawn(f(send));
    tokio_stream::wrappers::ReceiverStream::new(rx).map_ok()
}

/// `Ok` as a function pointer from an event to an infallible SSE stream item, so that the
/// mapped stream has a nameable type.
type OkEvent = fn(Event) -> Result<Event, Infallible>;

trait MapOk: Stream<Item = Event> + Sized {
    fn map_ok(self) -> futures::stream::Map<Self, OkEvent> {
        futures::StreamExt::map(self, Ok as OkEvent)
    }
}
impl<S: Stream<Item = Event>> MapOk for S {}
