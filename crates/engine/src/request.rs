//! Requests as the scheduler sees them, and the events it sends back.

use std::time::Instant;

use crate::params::{FinishReason, GenerateParams};

/// What the engine reports about a request, in order: zero or more `Text`, then exactly
/// one `Finished` or `Error` — per choice when the request asks for `n > 1` (events of
/// different choices interleave; an `Error` ends the whole request).
#[derive(Debug, Clone)]
pub enum SeqEvent {
    /// Newly final text and the token ids that produced it (ids may arrive before their
    /// text when a character spans tokens or a stop string might be starting).
    Text {
        /// Which of the request's `n` choices (0 unless `n > 1`).
        choice: usize,
        text: String,
        token_ids: Vec<u32>,
        /// One per id in `token_ids` with `GenerateParams::logprobs`, else empty.
        logprobs: Vec<crate::sampler::TokenLogprob>,
    },
    /// The full logits of a step (only with `GenerateParams::return_logits`).
    Logits(Vec<f32>),
    /// Boxed: a request sends one `Finished` per choice but a `Text` per token or so, and
    /// every event in a channel takes the size of the largest variant.
    Finished(Box<RequestOutput>),
    Error(RequestError),
}

/// Why the engine failed a request it had accepted; the server maps each kind to its own
/// HTTP status, so that a client can tell its own mistake from the server's state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The request can never fit this engine's KV pool (400: shorten it or ask for a
    /// budget).
    #[error("{0}")]
    TooLarge(String),
    /// The KV pool is full now, even with the other sequences preempted (503: retry).
    #[error("{0}")]
    CacheFull(String),
    /// The backend failed (a forward pass): not the client's fault (500).
    #[error("{0}")]
    Internal(String),
}

/// The sink for a request's events; returning `false` means the client went away and the
/// request should be aborted (its blocks freed at the next step).
pub type EventSink = Box<dyn FnMut(SeqEvent) -> bool + Send>;

pub struct Request {
    pub prompt_ids: Vec<u32>,
    pub params: GenerateParams,
    /// Mixed into prefix-cache hashes: requests with different salts never share blocks.
    pub cache_salt: Option<String>,
    pub sink: EventSink,
}

#[derive(Debug, Clone)]
pub struct RequestOutput {
    /// Which of the request's `n` choices this is; each sends its own `Finished`.
    pub choice: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    /// When the request was submitted.
    pub arrival: Instant,
    /// When the scheduler first admitted it (`None` if it finished before, e.g. refused).
    pub scheduled_at: Option<Instant>,
    /// When its first token was sampled (an end-of-generation token included, which is
    /// not in `token_ids`).
    pub first_token_at: Option<Instant>,
    /// When each token of `token_ids` was sampled, one per token: the gaps between
    /// consecutive entries are the inter-token latencies.
    pub token_times: Vec<Instant>,
    pub finished_at: Instant,
    pub num_preemptions: usize,
    /// Tokens the sequence held in the KV cache when it finished (≤ budget + one block
    /// under an evicting policy).
    pub kv_stored_tokens: usize,
    /// KV blocks the sequence held when it finished (main table and window groups).
    pub kv_blocks: usize,
    /// Per generated token, with `GenerateParams::logprobs`.
    pub logprobs: Vec<crate::sampler::TokenLogprob>,
    /// Per prompt token, with `GenerateParams::prompt_logprobs` (choice 0 only; `None`
    /// for the first token, which nothing predicts).
    pub prompt_logprobs: Vec<Option<crate::sampler::TokenLogprob>>,
    /// Where the prompt's stored context came from (EVICPRESS store), if it was loaded.
    pub context_load: Option<crate::connector::LoadOrigin>,
    /// With `GenerateParams::record_prefill_keeps`: each selection unit's kept tokens.
    pub prefill_keeps: Option<Vec<PrefillKeep>>,
}

/// What prefill selection kept in one selection unit: the stored indices at selection,
/// which are prompt positions when nothing was pruned before (every policy that selects
/// once, from the whole prompt).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillKeep {
    pub layers: Vec<usize>,
    /// `None`: every KV head of `layers`.
    pub kv_head: Option<usize>,
    pub kept: Vec<u32>,
    /// The scores the selection ranked by, one per stored token, where they came from
    /// outside the KV: KVzip's reconstruction scores (the unit's mean over its layers and
    /// KV heads; sinks score 1). Empty for policies that score from the KV itself. A
    /// stored-context codec ranks by these (`bench codecs`' KVzip rows).
    pub prior_scores: Vec<f32>,
}

/// Result of a blocking `generate` call.
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub kv_stored_tokens: usize,
    /// Bytes of the KV blocks the sequence held when it finished (its main table's and
    /// its window groups'), shared blocks included.
    pub kv_bytes: usize,
    /// Per generated token, with `GenerateParams::logprobs`.
    pub logprobs: Vec<crate::sampler::TokenLogprob>,
    /// Where a stored context came from (EVICPRESS store), if one was loaded.
    pub context_load: Option<crate::connector::LoadOrigin>,
    /// With `GenerateParams::record_prefill_keeps`: each selection unit's kept tokens.
    pub prefill_keeps: Option<Vec<PrefillKeep>>,
}
