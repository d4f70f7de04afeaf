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

/// One stream's state: the identity every chunk repeats, and per choice the tokens so far
/// and the logprobs whose text is still held back. Each engine event becomes the chunks
/// to send, so the async body below only moves them.
struct StreamState {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    usage: StreamUsage,
    prompt_tokens: usize,
    /// vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far.
    tokens_so_far: Vec<usize>,
    logprobs: Option<StreamLogprobs>,
    /// Per choice: logprobs of tokens whose text is still held back ride with its next text.
    pending: Vec<Vec<pk_engine::TokenLogprob>>,
    outputs: Vec<RequestOutput>,
    n: usize,
}

/// What one engine event asks the stream to do.
enum Step {
    Send(Vec<Value>),
    /// Send these, then end the stream.
    End(Vec<Value>),
}

impl StreamState {
    fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        finish: Option<&str>,
        first: bool,
        lp: Value,
    ) -> Value {
        let (id, model) = (self.id.as_str(), self.model.as_str());
        chunk(
            self.kind,
            index,
            id,
            self.created,
            model,
            text,
            finish,
            first,
            lp,
        )
    }

    fn with_usage(&self, mut c: Value, completion_tokens: usize) -> Value {
        if self.usage.every_chunk {
            c["usage"] = json!(Usage::new(self.prompt_tokens, completion_tokens, 0));
        }
        c
    }

    /// Chat streams open every choice with its role; `echo` sends each choice's prompt text.
    fn opening(&self, echo: &[String]) -> Vec<Value> {
        let mut out = Vec::new();
        if let Kind::Chat = self.kind {
            for index in 0..self.n {
                let c = self.chunk(index, Some(""), None, true, Value::Null);
                out.push(self.with_usage(c, 0));
            }
        }
        for (index, text) in echo.iter().enumerate().filter(|(_, t)| !t.is_empty()) {
            let c = self.chunk(index, Some(text), None, false, Value::Null);
            out.push(self.with_usage(c, 0));
        }
        out
    }

    fn on_event(&mut self, ev: SeqEvent) -> Step {
        match ev {
            SeqEvent::Logits(_) => Step::Send(Vec::new()),
            SeqEvent::Text {
                choice,
                text,
                logprobs,
                token_ids,
            } => Step::Send(self.on_text(choice, &text, token_ids.len(), logprobs)),
            SeqEvent::Finished(o) => self.on_finished(*o),
            SeqEvent::Error(e) => {
                // The status line went out with the stream's first byte; the error
                // event carries the status the request would have had.
                let a = request_error(&e);
                let v = json!({"error": {"message": a.message, "type": a.error_type(), "param": null, "code": a.status.as_u16()}});
                Step::End(vec![v])
            }
        }
    }

    fn on_text(
        &mut self,
        choice: usize,
        text: &str,
        n_tokens: usize,
        token_logprobs: Vec<pk_engine::TokenLogprob>,
    ) -> Vec<Value> {
        self.tokens_so_far[choice] += n_tokens;
        self.pending[choice].extend(token_logprobs);
        if text.is_empty() {
            return Vec::new();
        }
        let tokens = std::mem::take(&mut self.pending[choice]);
        let lp = StreamLogprobs::render(&mut self.logprobs, choice, &tokens);
        let c = self.chunk(choice, Some(text), None, false, lp);
        vec![self.with_usage(c, self.tokens_so_far[choice])]
    }

    /// A choice's last chunk; once every choice has finished, the usage chunk
    /// (`include_usage`) and the end.
    fn on_finished(&mut self, o: RequestOutput) -> Step {
        let text = match self.kind {
            Kind::Completion => Some(""),
            Kind::Chat => None,
        };
        let tokens = std::mem::take(&mut self.pending[o.choice]);
        let lp = match tokens.is_empty() {
            true => Value::Null,
            false => StreamLogprobs::render(&mut self.logprobs, o.choice, &tokens),
        };
        let c = self.chunk(o.choice, text, Some(finish_str(o.finish_reason)), false, lp);
        let mut out = vec![self.with_usage(c, o.token_ids.len())];
        self.outputs.push(o);
        if self.outputs.len() < self.n {
            return Step::Send(out);
        }
        if self.usage.at_end {
            let obj = match self.kind {
                Kind::Completion => "text_completion",
                Kind::Chat => "chat.completion.chunk",
            };
            self.outputs.sort_by_key(|o| o.choice);
            let usage = usage_of(self.prompt_tokens, &self.outputs);
            out.push(json!({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [], "usage": usage}));
        }
        Step::End(out)
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
    let mut state = StreamState {
        kind,
        id: new_id(match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }),
        created: now_unix(),
        model,
        usage,
        prompt_tokens: s.prompt_tokens,
        tokens_so_far: vec![0; n],
        logprobs: logprobs.map(|tokenizer| StreamLogprobs {
            tokenizer,
            kind,
            text_offsets: vec![0; n],
        }),
        pending: vec![Vec::new(); n],
        outputs: Vec::with_capacity(n),
        n,
    };
    let mut rx = s.rx;
    let stream = async_stream(move |yield_| async move {
        for c in state.opening(&echo) {
            if !yield_(Event::default().data(c.to_string())).await {
                return;
            }
        }
        while let Some(ev) = rx.recv().await {
            let (chunks, end) = match state.on_event(ev) {
                Step::Send(c) => (c, false),
                Step::End(c) => (c, true),
            };
            for c in chunks {
                // A client gone mid-stream ends it (at the end, the last sends are best effort).
                if !yield_(Event::default().data(c.to_string())).await && !end {
                    return;
                }
            }
            if end {
                break;
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
