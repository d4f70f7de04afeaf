//! The scheduler (admission, reservation, preemption, chunked prefill beside decodes)
//! against a fake backend: no weights are loaded and no matrix is multiplied, so these
//! tests run in milliseconds and say exactly what the scheduler did.
//!
//! The fake model writes a K/V for every token (values from the token and its position, so
//! eviction policies have norms to rank) and always predicts "the last token + 1". Its
//! output therefore never depends on the cache: a recomputed (preempted) sequence must
//! still continue exactly where it was, which checks the replay, not the math. Only the
//! tokenizer comes from the default model's file (read, not run).

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use pk_engine::{Engine, EngineConfig, GenerateParams, Request, SeqEvent};
use pk_model::{
    ArchExtras, Backend, BackendError, KvBlocks, KvStore, ModelConfig, RopeStyle, SeqForward,
};

struct FakeBackend {
    config: ModelConfig,
    store: KvStore,
    /// Tokens run by each forward pass, in order.
    steps: Arc<Mutex<Vec<usize>>>,
}

impl Backend for FakeBackend {
    fn name(&self) -> &str {
        "fake"
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn kv(&self) -> &dyn KvBlocks {
        &self.store
    }
    fn kv_mut(&mut self) -> &mut dyn KvBlocks {
        &mut self.store
    }
    fn forward_with_queries(
        &mut self,
        seqs: &[SeqForward],
        _capture_last: &[usize],
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>), BackendError> {
        let g = self.store.geometry;
        let width = g.n_kv_heads * g.head_dim;
        let vocab = self.config.vocab_size;
        let mut logits = Vec::new();
        for s in seqs {
            for (i, &token) in s.tokens.iter().enumerate() {
                let stored = s.stored_start + i;
                let block = *s
                    .block_table
                    .get(stored / g.block_size_tokens)
                    .ok_or_else(|| {
                        BackendError::new("fake", format!("no block for stored index {stored}"))
                    })?;
                let position = s.start_position + i;
                let k: Vec<f32> = (0..width)
                    .map(|j| ((token as usize * 31 + j * 7 + position) % 17) as f32 / 17.0 - 0.4)
                    .collect();
                let v: Vec<f32> = (0..width)
                    .map(|j| ((token as usize * 13 + j * 5 + position * 3) % 19) as f32 / 19.0)
                    .collect();
                for layer in 0..g.n_layers {
                    self.store
                        .write_token(layer, block, stored % g.block_size_tokens, &k, &v);
                }
                if i >= s.logits_from {
                    let mut row = vec![0.0f32; vocab];
                    row[(token as usize + 1) % vocab] = 10.0;
                    logits.extend(row);
                }
            }
        }
        self.steps
            .lock()
            .unwrap()
            .push(seqs.iter().map(|s| s.tokens.len()).sum());
        Ok((logits, Vec::new()))
    }
}

/// An engine over the fake backend; returns it with the per-step token counts.
fn fake_engine(config: EngineConfig) -> (Engine, Arc<Mutex<Vec<usize>>>) {
    let gguf = pk_gguf::GgufFile::open(common::model_path()).unwrap();
    let tokenizer = pk_tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
    let chat = pk_tokenizer::ChatTemplate::from_gguf(&gguf).unwrap();
    let model = ModelConfig {
        arch: "llama".into(),
        name: "fake".into(),
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 8,
        d_model: 16,
        d_ff: 32,
        vocab_size: tokenizer.vocab_size(),
        context_length: 8192,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::Normal,
        rope_freq_scale: 1.0,
        rope_freq_factors: None,
        rms_eps: 1e-5,
        extras: ArchExtras::default(),
    };
    let geometry = config.kv_geometry(&model).unwrap();
    let steps = Arc::new(Mutex::new(Vec::new()));
    let backend = FakeBackend {
        store: KvStore::new(geometry, config.kv_dtype),
        config: model,
        steps: steps.clone(),
    };
    let engine = Engine::with_backend(Box::new(backend), tokenizer, chat, config, "fake").unwrap();
    (engine, steps)
}

/// Tokens or the error each request ended with.
type Outcome = Result<Vec<u32>, String>;

/// Submits every prompt, steps until idle (checking the invariants after each step), and
/// returns each request's outcome, the engine's preemptions and the most running at once.
fn run(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    params: &GenerateParams,
) -> (Vec<Outcome>, u64, usize) {
    let mut rxs = Vec::new();
    for p in prompts {
        let (tx, rx) = mpsc::channel();
        engine
            .submit(Request {
                prompt_ids: p.clone(),
                params: params.clone(),
                cache_salt: None,
                sink: Box::new(move |e| tx.send(e).is_ok()),
            })
            .unwrap();
        rxs.push(rx);
    }
    let mut max_running = 0;
    while engine.has_work() {
        engine.step();
        max_running = max_running.max(engine.num_running());
        engine.check_invariants();
    }
    let outcomes = rxs
        .iter()
        .map(|rx| {
            let mut ids = Vec::new();
            for ev in rx.try_iter() {
                match ev {
                    SeqEvent::Text { token_ids, .. } => ids.extend(token_ids),
                    SeqEvent::Finished(_) | SeqEvent::Logits(_) => {}
                    SeqEvent::Error(e) => return Err(e.to_string()),
                }
            }
            Ok(ids)
        })
        .collect();
    let pool = engine.kv_manager().pool();
    assert_eq!(
        pool.num_free_blocks(),
        pool.num_blocks(),
        "every block returned"
    );
    (outcomes, engine.stats.preemptions, max_running)
}

/// Prompt `i` of `len` tokens; distinct first tokens, so no two share cached blocks.
fn prompt(i: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| 1000 + i * 1000 + t).collect()
}

/// What the fake model generates after `prompt`.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let last = *prompt.last().unwrap();
    (1..=n as u32).map(|k| last + k).collect()
}

fn params(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn full_cache_growth_preempts_and_every_request_continues_where_it_was() {
    let (mut engine, _) = fake_engine(EngineConfig {
        kv_capacity_tokens: Some(512),
        ..Default::default()
    });
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 100)).collect();
    let (outcomes, preemptions, max_running) = run(&mut engine, &prompts, &params(150));
    assert!(
        preemptions > 0,
        "six sequences growing to 250 tokens in 512 must preempt"
    );
    assert!(max_running >= 2);
    for (p, got) in prompts.iter().zip(outcomes) {
        assert_eq!(got.unwrap(), expected(p, 150));
    }
}

#[test]
fn budgeted_prefill_peaks_are_admitted_in_turn() {
    let (mut engine, _) = fake_engine(EngineConfig {
        kv_capacity_tokens: Some(1024),
        max_prefill_tokens_while_decoding: 64,
        ..Default::default()
    });
    let budgeted = GenerateParams {
        kv_policy: Some("paged-eviction".parse().unwrap()),
        kv_budget: Some(64),
        ..params(48)
    };
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(i, 600)).collect();
    let (outcomes, preemptions, max_running) = run(&mut engine, &prompts, &budgeted);
    assert_eq!(preemptions, 0, "prefill peaks overlapped");
    assert!(
        max_running >= 3,
        "pruned sequences decode beside the next prefill: {max_running}"
    );
    for (p, got) in prompts.iter().zip(outcomes) {
        assert_eq!(got.unwrap(), expected(p, 48));
    }
}

#[test]
fn a_request_larger_than_the_pool_fails_alone() {
    let (mut engine, _) = fake_engine(EngineConfig {
        kv_capacity_tokens: Some(256),
        ..Default::default()
    });
    let prompts = vec![prompt(0, 40), prompt(1, 600), prompt(2, 40)];
    let (outcomes, _, _) = run(&mut engine, &prompts, &params(8));
    assert_eq!(outcomes[0].as_ref().unwrap(), &expected(&prompts[0], 8));
    let err = outcomes[1].as_ref().unwrap_err();
    assert!(err.contains("KV blocks"), "{err}");
    assert_eq!(outcomes[2].as_ref().unwrap(), &expected(&prompts[2], 8));
}

#[test]
fn prompt_chunks_beside_decodes_are_capped() {
    let (mut engine, steps) = fake_engine(EngineConfig {
        max_prefill_tokens_while_decoding: 64,
        ..Default::default()
    });
    // A short prompt starts decoding; a long one arrives beside it.
    let prompts = vec![prompt(0, 20), prompt(1, 1000)];
    let (outcomes, _, _) = run(&mut engine, &prompts, &params(40));
    for (p, got) in prompts.iter().zip(outcomes) {
        assert_eq!(got.unwrap(), expected(p, 40));
    }
    let steps = steps.lock().unwrap();
    // Every step after the first (which prefills both first chunks before anything
    // decodes) carries at most one decode token and 64 prompt tokens.
    let biggest_later = steps[1..].iter().copied().max().unwrap();
    assert!(biggest_later <= 65, "steps {steps:?}");
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    assert_eq!(
        steps.iter().sum::<usize>(),
        prompt_tokens + 2 * 40 - 2,
        "each prompt once, each generated token but the last once"
    );
}

/// Every generated token carries the time it was sampled (the server observes each gap
/// between consecutive tokens as one inter-token latency), through preemptions and in
/// every choice of `n > 1`; and a request's times come in order: arrival, first admission,
/// first token, the other tokens, the end.
#[test]
fn every_generated_token_has_its_sampling_time_through_preemption_and_forks() {
    let (mut engine, _) = fake_engine(EngineConfig {
        kv_capacity_tokens: Some(512),
        ..Default::default()
    });
    let two_choices = GenerateParams { n: 2, ..params(40) };
    let mut rxs = Vec::new();
    for i in 0..6 {
        let (tx, rx) = mpsc::channel();
        let p = if i == 0 { &two_choices } else { &params(150) };
        engine
            .submit(Request {
                prompt_ids: prompt(i, 100),
                params: p.clone(),
                cache_salt: None,
                sink: Box::new(move |e| tx.send(e).is_ok()),
            })
            .unwrap();
        rxs.push(rx);
    }
    while engine.has_work() {
        engine.step();
    }
    assert!(
        engine.stats.preemptions > 0,
        "the pool is too small for all"
    );
    let outputs: Vec<_> = rxs
        .iter()
        .flat_map(|rx| rx.try_iter())
        .filter_map(|e| match e {
            SeqEvent::Finished(o) => Some(o),
            _ => None,
        })
        .collect();
    assert_eq!(outputs.len(), 7, "two choices and five single ones");
    for o in &outputs {
        assert_eq!(o.token_times.len(), o.token_ids.len());
        let scheduled = o.scheduled_at.expect("admitted");
        let first = o.first_token_at.expect("a token");
        assert!(o.arrival <= scheduled && scheduled <= first);
        assert_eq!(o.token_times[0], first);
        assert!(o.token_times.windows(2).all(|w| w[0] <= w[1]));
        assert!(*o.token_times.last().unwrap() <= o.finished_at);
    }
}
