//! The engine: one model, one paged KV cache, and the prefill/decode loop for a request.
//!
//! The engine is single-owner (`&mut self`): the pool, the block tables and the physical
//! KV store are never shared behind locks. The server (later) talks to it over channels.
//! A request's life: find its longest cached prefix (prefix caching, full blocks only),
//! allocate slots for the rest of the prompt, prefill in chunks of bounded size, then
//! decode one token per step until a stop condition, and free the sequence.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use pk_kv::{KvCacheManager, SeqId};
use pk_model::{KvDtype, KvGeometry, KvStore, Llama, SeqForward};
use pk_tokenizer::{ChatTemplate, StreamDecoder, Tokenizer};

use crate::sampler::{Sampler, SamplingParams};
use crate::stop::StopMatcher;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size_tokens: u32,
    pub kv_dtype: KvDtype,
    /// Capacity of the KV pool in tokens (rounded up to whole blocks). Defaults to the
    /// model's context length.
    pub kv_capacity_tokens: Option<usize>,
    /// Upper bound on tokens per forward call during prefill; bounds activation memory.
    pub prefill_chunk_tokens: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { block_size_tokens: 16, kv_dtype: KvDtype::F16, kv_capacity_tokens: None, prefill_chunk_tokens: 512 }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams { sampling: SamplingParams::default(), max_tokens: 128, stop: Vec::new(), ignore_eos: false }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

pub struct Engine {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    pub config: EngineConfig,
    kv: KvCacheManager,
    store: KvStore,
    /// Bytes mixed into every block hash so that caches of different models or KV
    /// precisions never alias.
    cache_namespace: Vec<u8>,
    next_seq: u64,
}

impl Engine {
    pub fn load(model_path: &Path, config: EngineConfig) -> Result<Engine> {
        let gguf = pk_gguf::GgufFile::open(model_path).with_context(|| format!("loading {}", model_path.display()))?;
        let model = Llama::from_gguf(&gguf).context("building the model")?;
        let tokenizer = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
        let chat_template = ChatTemplate::from_gguf(&gguf).context("reading the chat template")?;
        let name = model_path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        Engine::new(model, tokenizer, chat_template, config, &name)
    }

    pub fn new(model: Llama, tokenizer: Tokenizer, chat_template: ChatTemplate, config: EngineConfig, model_id: &str) -> Result<Engine> {
        let c = &model.config;
        let bs = config.block_size_tokens as usize;
        if !(1..=256).contains(&bs) {
            bail!("block size must be between 1 and 256 tokens, got {bs}");
        }
        let capacity_tokens = config.kv_capacity_tokens.unwrap_or(c.context_length);
        let num_blocks = capacity_tokens.div_ceil(bs).max(1);
        let geometry = KvGeometry { n_layers: c.n_layers, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim, block_size_tokens: bs, num_blocks };
        let store = KvStore::new(geometry, config.kv_dtype);
        tracing::info!(
            "KV cache: {num_blocks} blocks x {bs} tokens = {} tokens, {:.1} MiB ({:?})",
            num_blocks * bs,
            store.capacity_bytes() as f64 / (1 << 20) as f64,
            config.kv_dtype
        );
        let kv = KvCacheManager::new(num_blocks as u32, bs as u32);
        let cache_namespace = format!("{model_id}|{:?}", config.kv_dtype).into_bytes();
        Ok(Engine { model, tokenizer, chat_template, config, kv, store, cache_namespace, next_seq: 0 })
    }

    pub fn kv_manager(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn kv_store(&self) -> &KvStore {
        &self.store
    }

    fn new_seq(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    fn table_u32(&self, seq: SeqId) -> Vec<u32> {
        self.kv.block_table(seq).expect("live sequence").block_ids().iter().map(|b| b.0).collect()
    }

    /// Appends `tokens` to `seq` and runs them through the model in chunks; returns the
    /// logits rows for `tokens[logits_from..]`.
    fn extend(&mut self, seq: SeqId, tokens: &[u32], logits_from: usize) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        let chunk = self.config.prefill_chunk_tokens.max(1);
        let mut done = 0;
        while done < tokens.len() {
            let end = (done + chunk).min(tokens.len());
            let stored_start = self.kv.block_table(seq).expect("live sequence").num_stored_tokens() as usize;
            let slots = self.kv.allocate_slots(seq, (end - done) as u32).with_context(|| {
                format!(
                    "KV cache is full: {} free blocks of {} tokens, the sequence needs more",
                    self.kv.pool().num_free_blocks(),
                    self.kv.block_size_tokens()
                )
            })?;
            let table = self.table_u32(seq);
            let from = logits_from.max(done).min(end) - done;
            let fwd = SeqForward {
                tokens: &tokens[done..end],
                start_position: slots.first_position as usize,
                stored_start,
                block_table: &table,
                logits_from: from,
            };
            logits.extend(self.model.forward(&mut self.store, &[fwd]));
            done = end;
        }
        Ok(logits)
    }

    /// Generates a continuation of `prompt_ids`, calling `on_text` with each new piece of
    /// text as soon as it is final (stop strings are held back until they cannot match).
    pub fn generate(&mut self, prompt_ids: &[u32], params: &GenerateParams, on_text: &mut dyn FnMut(&str)) -> Result<GenerateOutput> {
        if prompt_ids.is_empty() {
            bail!("the prompt is empty");
        }
        params.sampling.validate().map_err(anyhow::Error::msg)?;
        let ctx = self.model.config.context_length;
        if prompt_ids.len() >= ctx {
            bail!("the prompt has {} tokens; the model's context is {ctx}", prompt_ids.len());
        }
        let seq = self.new_seq();
        let prefix = self.kv.get_computed_prefix(prompt_ids, &self.cache_namespace);
        let cached = self.kv.add_sequence(seq, &prefix) as usize;
        let result = self.generate_inner(seq, prompt_ids, cached, params, on_text);
        self.kv.free(seq);
        result
    }

    fn generate_inner(&mut self, seq: SeqId, prompt: &[u32], cached: usize, params: &GenerateParams, on_text: &mut dyn FnMut(&str)) -> Result<GenerateOutput> {
        let t0 = Instant::now();
        let new = &prompt[cached..];
        let mut logits = self.extend(seq, new, new.len() - 1)?;
        self.kv.cache_full_blocks(seq, prompt);
        let prefill_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();

        let mut sampler = Sampler::new(params.sampling.clone());
        let mut decoder = StreamDecoder::new();
        let mut stop = StopMatcher::new(&params.stop);
        let mut out_ids = Vec::new();
        let mut all_ids = prompt.to_vec();
        let ctx = self.model.config.context_length;
        let finish = loop {
            if out_ids.len() >= params.max_tokens {
                break FinishReason::Length;
            }
            let id = sampler.sample(&logits);
            if !params.ignore_eos && self.tokenizer.is_eog(id) {
                break FinishReason::Stop;
            }
            out_ids.push(id);
            all_ids.push(id);
            let piece = decoder.push(&self.tokenizer, id);
            let (emit, hit) = stop.push(&piece);
            if !emit.is_empty() {
                on_text(&emit);
            }
            if hit {
                break FinishReason::Stop;
            }
            if all_ids.len() >= ctx || out_ids.len() >= params.max_tokens {
                break FinishReason::Length;
            }
            logits = self.extend(seq, &[id], 0)?;
        };
        let tail = stop.finish(&decoder.finish());
        if !tail.is_empty() {
            on_text(&tail);
        }
        self.kv.cache_full_blocks(seq, &all_ids);
        Ok(GenerateOutput {
            text: stop.text().to_string(),
            token_ids: out_ids,
            finish_reason: finish,
            prompt_tokens: prompt.len(),
            cached_prompt_tokens: cached,
            prefill_seconds,
            decode_seconds: t1.elapsed().as_secs_f64(),
        })
    }

    /// Runs `tokens` as a fresh sequence and returns the logits rows for
    /// `tokens[logits_from..]`; the sequence is freed afterwards. Used by perplexity and
    /// evaluation (teacher forcing).
    pub fn score(&mut self, tokens: &[u32], logits_from: usize) -> Result<Vec<f32>> {
        let seq = self.new_seq();
        let empty = self.kv.get_computed_prefix(&[], &self.cache_namespace);
        self.kv.add_sequence(seq, &empty);
        let r = self.extend(seq, tokens, logits_from);
        self.kv.free(seq);
        r
    }

    /// Checks the KV manager's invariants (tests).
    pub fn check_invariants(&self) {
        self.kv.check_invariants();
    }
}
