//! Continuous batching: many requests in one engine give exactly the tokens each gets alone
//! (every row's arithmetic is independent of the batch), including after preemption.

mod common;

use std::sync::mpsc;

use pk_engine::{EngineConfig, GenerateParams, Request, SeqEvent};

fn prompts(engine: &pk_engine::Engine) -> Vec<Vec<u32>> {
    [
        "The planets of the solar system, in order from the Sun, are",
        "Mr. Phileas Fogg lived, in 1872, at No. 7, Saville Row",
        "fn main() {\n    let numbers = vec![1, 2, 3];\n",
        "Once upon a time, in a land far away, there lived a",
        "The quick brown fox",
    ]
    .iter()
    .map(|p| engine.tokenizer.encode(p, false))
    .collect()
}

/// Each prompt run to completion alone on `engine`, one after another.
fn run_alone(
    engine: &mut pk_engine::Engine,
    prompts: &[Vec<u32>],
    params: &GenerateParams,
) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| engine.generate(p, params, &mut |_| {}).unwrap().token_ids)
        .collect()
}

fn run_batched(
    config: EngineConfig,
    prompts: &[Vec<u32>],
    params: &GenerateParams,
) -> (Vec<Vec<u32>>, u64) {
    let mut engine = common::engine(config);
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
    assert!(max_running >= 2, "requests were not batched");
    let outs = rxs
        .iter()
        .map(|rx| {
            let mut ids = Vec::new();
            for ev in rx.try_iter() {
                match ev {
                    SeqEvent::Text { token_ids, .. } => ids.extend(token_ids),
                    SeqEvent::Logits(_) => {}
                    SeqEvent::Finished(o) => assert_eq!(o.token_ids, ids),
                    SeqEvent::Error(e) => panic!("{e}"),
                }
            }
            ids
        })
        .collect();
    assert_eq!(
        engine.kv_manager().pool().num_free_blocks(),
        engine.kv_manager().pool().num_blocks()
    );
    (outs, engine.stats.preemptions)
}

#[test]
fn batched_equals_sequential_and_survives_preemption() {
    let params = GenerateParams {
        max_tokens: 24,
        ignore_eos: true,
        ..Default::default()
    };
    let mut single = common::engine(EngineConfig::default());
    let ps = prompts(&single);
    let alone = run_alone(&mut single, &ps, &params);

    let (batched, preemptions) = run_batched(EngineConfig::default(), &ps, &params);
    assert_eq!(preemptions, 0);
    assert_eq!(batched, alone);

    // 12 blocks of 16 tokens cannot hold five sequences of ~40 tokens: preemption by
    // recompute must kick in and still give the same tokens.
    let tight = EngineConfig {
        kv_capacity_tokens: Some(12 * 16),
        ..Default::default()
    };
    let (preempted, preemptions) = run_batched(tight, &ps, &params);
    assert!(
        preemptions > 0,
        "expected preemptions with a tight KV cache"
    );
    assert_eq!(preempted, alone);
}

#[test]
fn queue_limit_refuses_with_a_clear_error() {
    let mut engine = common::engine(EngineConfig {
        max_waiting_requests: 1,
        ..Default::default()
    });
    let mk = || Request {
        prompt_ids: vec![1, 2, 3],
        params: GenerateParams::default(),
        cache_salt: None,
        sink: Box::new(|_| true),
    };
    engine.submit(mk()).unwrap();
    let err = engine.submit(mk()).unwrap_err();
    assert!(err.to_string().contains("queue is full"), "{err}");
    let bad = Request {
        prompt_ids: vec![u32::MAX],
        params: GenerateParams::default(),
        cache_salt: None,
        sink: Box::new(|_| true),
    };
    assert!(engine.submit(bad).is_err());
}

/// Chunked prefill with decode priority: while a stream decodes, a long prompt arrives;
/// every step carries the decode token plus at most `max_prefill_tokens_while_decoding`
/// prompt tokens, so the stream's time between tokens stays one small step. With nothing
/// decoding, the prompt runs in chunks of `max_batch_tokens`. Tokens are unchanged.
#[test]
fn prompt_chunks_beside_decodes_are_capped() {
    let config = EngineConfig {
        max_prefill_tokens_while_decoding: 48,
        ..Default::default()
    };
    let mut engine = common::engine(config);
    let book = common::book_ids();
    let params = GenerateParams {
        max_tokens: 40,
        ignore_eos: true,
        ..Default::default()
    };
    let submit = |engine: &mut pk_engine::Engine, prompt: &[u32]| {
        let (tx, rx) = mpsc::channel();
        engine
            .submit(Request {
                prompt_ids: prompt.to_vec(),
                params: params.clone(),
                cache_salt: None,
                sink: Box::new(move |e| tx.send(e).is_ok()),
            })
            .unwrap();
        rx
    };
    let first = submit(&mut engine, &book[0..20]);
    assert_eq!(engine.step(), 20, "alone, the prompt runs whole");
    let long = submit(&mut engine, &book[100..400]);
    let mut steps = Vec::new();
    while engine.has_work() {
        steps.push(engine.step());
    }
    // One decode token beside each capped prompt chunk until the 300-token prompt is in.
    assert_eq!(&steps[..6], &[49, 49, 49, 49, 49, 49], "{steps:?}");
    assert_eq!(steps[6], 1 + (300 - 6 * 48), "{steps:?}");
    let ids = |rx: mpsc::Receiver<SeqEvent>| {
        rx.try_iter()
            .find_map(|e| {
                if let SeqEvent::Finished(o) = e {
                    Some(o.token_ids)
                } else {
                    None
                }
            })
            .unwrap()
    };
    let (a, b) = (ids(first), ids(long));
    let alone = |prompt: &[u32]| {
        common::engine(EngineConfig::default())
            .generate(prompt, &params, &mut |_| {})
            .unwrap()
            .token_ids
    };
    assert_eq!(a, alone(&book[0..20]));
    assert_eq!(b, alone(&book[100..400]));
}

/// Runs one request of `params.n` choices to the end; returns each choice's tokens, checked
/// against its `Finished` event.
fn run_choices(
    engine: &mut pk_engine::Engine,
    params: &GenerateParams,
    prompt: &[u32],
) -> Vec<Vec<u32>> {
    let (tx, rx) = mpsc::channel();
    engine
        .submit(Request {
            prompt_ids: prompt.to_vec(),
            params: params.clone(),
            cache_salt: None,
            sink: Box::new(move |e| tx.send(e).is_ok()),
        })
        .unwrap();
    while engine.has_work() {
        engine.step();
        engine.check_invariants();
    }
    let mut texts = vec![Vec::new(); params.n];
    let mut outs = Vec::new();
    for ev in rx.try_iter() {
        match ev {
            SeqEvent::Text {
                choice, token_ids, ..
            } => texts[choice].extend(token_ids),
            SeqEvent::Finished(o) => outs.push(*o),
            SeqEvent::Logits(_) => {}
            SeqEvent::Error(e) => panic!("{e}"),
        }
    }
    outs.sort_by_key(|o| o.choice);
    assert_eq!(outs.len(), params.n, "one Finished per choice");
    for (o, t) in outs.iter().zip(&texts) {
        assert_eq!(&o.token_ids, t);
    }
    texts
}

/// `n > 1`: the prompt runs once and its blocks are forked into the choices, which sample
/// on their own. Greedy choices are identical to one greedy request; sampled ones with a
/// seed differ from each other and repeat with the same seed; a KV cache too small for the
/// forks' copies makes a choice wait and recompute instead of failing.
#[test]
fn n_choices_fork_one_computed_prompt() {
    let mut engine = common::engine(EngineConfig {
        enable_prefix_caching: false,
        ..Default::default()
    });
    let prompt = prompts(&engine)[1].clone();
    let greedy = GenerateParams {
        max_tokens: 12,
        ignore_eos: true,
        ..Default::default()
    };
    let one = run_choices(&mut engine, &greedy, &prompt);
    let (before, served_before) = (
        engine.stats.prompt_tokens,
        engine.stats.prompt_tokens_served,
    );
    let three = run_choices(
        &mut engine,
        &GenerateParams {
            n: 3,
            ..greedy.clone()
        },
        &prompt,
    );
    assert_eq!(
        engine.stats.prompt_tokens - before,
        prompt.len() as u64,
        "the prompt ran once for three choices"
    );
    assert_eq!(
        engine.stats.prompt_tokens_served - served_before,
        3 * prompt.len() as u64,
        "vLLM's prompt_tokens_total counts each choice's prompt"
    );
    assert!(
        three.iter().all(|t| *t == one[0]),
        "greedy choices are the greedy answer"
    );
    let sampled = GenerateParams {
        n: 3,
        sampling: pk_engine::SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            ..Default::default()
        },
        ..greedy.clone()
    };
    let a = run_choices(&mut engine, &sampled, &prompt);
    assert!(a[0] != a[1] && a[1] != a[2], "{a:?}");
    assert_eq!(
        run_choices(&mut engine, &sampled, &prompt),
        a,
        "seeded choices repeat"
    );
    // Room for one sequence and a little: the forks' copy-on-write cannot all fit, so
    // choices wait, recompute and still finish.
    let mut small = common::engine(EngineConfig {
        kv_capacity_tokens: Some(prompt.len() + 40),
        enable_prefix_caching: false,
        ..Default::default()
    });
    let cramped = run_choices(
        &mut small,
        &GenerateParams {
            n: 3,
            ..greedy.clone()
        },
        &prompt,
    );
    assert!(cramped.iter().all(|t| *t == one[0]));
    assert_eq!(
        small.stats.prompt_tokens_served,
        3 * prompt.len() as u64,
        "a choice that waits and recomputes counts its prompt once"
    );
    assert_eq!(
        small.kv_manager().pool().num_free_blocks(),
        small.kv_manager().pool().num_blocks()
    );
}

/// Preemption under eviction: a preempted evicting sequence recomputes to the same tokens
/// as when it ran unpreempted: its prompt is prefilled and pruned as before, then its
/// generated tokens are replayed one per step, so every decode eviction sees the same cache
/// (recomputing prompt and output as one prompt re-chose the kept tokens: measured, the
/// tokens diverged after the preemption). Checked for a key/value scorer and for an
/// attention scorer per KV head, which captures queries at prefill and decode.
#[test]
fn preempted_evicting_sequences_recompute_the_same_tokens() {
    for (policy, granularity) in [("paged-eviction", "shared"), ("snapkv", "head")] {
        let params = GenerateParams {
            max_tokens: 96,
            ignore_eos: true,
            kv_policy: Some(policy.parse().unwrap()),
            kv_budget: Some(48),
            kv_granularity: Some(granularity.parse().unwrap()),
            ..Default::default()
        };
        let mut single = common::engine(EngineConfig::default());
        let ps = prompts(&single);
        let alone = run_alone(&mut single, &ps, &params);
        let tight = EngineConfig {
            kv_capacity_tokens: Some(10 * 16),
            ..Default::default()
        };
        let (preempted, preemptions) = run_batched(tight, &ps, &params);
        assert!(
            preemptions > 0,
            "{policy}: expected preemptions with a tight KV cache"
        );
        for (i, (got, want)) in preempted.iter().zip(&alone).enumerate() {
            assert_eq!(got, want, "{policy}/{granularity}, prompt {i}");
        }
    }
}

/// Issue 23: long prompts under a budget are admitted so that their prefill peaks (the whole
/// prompt, until its last chunk is pruned) do not overlap past the pool: with four 300-token
/// prompts, a budget of 64 and a pool of 512 tokens, a second prompt could start while the
/// first still prefills and both would run the pool out. Admission keeps the blocks a
/// running prefill still needs free, so nothing is preempted, the pruned sequences decode
/// beside the next prefill, and the tokens equal each prompt's run alone.
#[test]
fn prefill_peaks_under_a_budget_are_taken_in_turn_without_preemption() {
    let params = GenerateParams {
        max_tokens: 16,
        ignore_eos: true,
        kv_policy: Some("paged-eviction".parse().unwrap()),
        kv_budget: Some(64),
        ..Default::default()
    };
    let mut single = common::engine(EngineConfig::default());
    let text = include_str!("../../../tests/fixtures/around-the-world-in-80-days.txt");
    let words: Vec<&str> = text.split_whitespace().collect();
    let ps: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut ids = single
                .tokenizer
                .encode(&words[i * 400..(i + 1) * 400].join(" "), false);
            ids.truncate(300);
            ids
        })
        .collect();
    let alone = run_alone(&mut single, &ps, &params);
    let config = EngineConfig {
        kv_capacity_tokens: Some(512),
        max_prefill_tokens_while_decoding: 64,
        ..Default::default()
    };
    let (batched, preemptions) = run_batched(config, &ps, &params);
    assert_eq!(preemptions, 0, "overlapping prefill peaks preempted");
    for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
        assert_eq!(got, want, "prompt {i}");
    }
}

/// One request alone, stepped: its tokens and the most KV blocks the pool had in use.
fn run_alone_tracking_peak(
    config: EngineConfig,
    prompt: &[u32],
    params: &GenerateParams,
) -> (Vec<u32>, usize) {
    let mut engine = common::engine(config);
    let (tx, rx) = mpsc::channel();
    engine
        .submit(Request {
            prompt_ids: prompt.to_vec(),
            params: params.clone(),
            cache_salt: None,
            sink: Box::new(move |e| tx.send(e).is_ok()),
        })
        .unwrap();
    let pool = |e: &pk_engine::Engine| {
        let p = e.kv_manager().pool();
        (p.num_blocks() - p.num_free_blocks()) as usize
    };
    while engine.has_work() {
        engine.step();
        engine.check_invariants();
    }
    // Measured by the engine once each step's slots are allocated, before pruning.
    let peak_blocks = engine.stats.kv_bytes_peak / engine.kv_block_bytes();
    let mut ids = Vec::new();
    for ev in rx.try_iter() {
        match ev {
            SeqEvent::Text { token_ids, .. } => ids.extend(token_ids),
            SeqEvent::Error(e) => panic!("{e}"),
            _ => {}
        }
    }
    assert_eq!(pool(&engine), 0);
    (ids, peak_blocks)
}

/// Issue 23: a budgeted prompt pruned as its chunks arrive (`prefill_prune_interval_tokens`)
/// holds at most budget + interval tokens of blocks while it is prefilled, not the whole
/// prompt; its pruning points are multiples of the interval whatever the scheduler's chunk
/// size, so its tokens do not change with the chunking. Policies that need exact prefill
/// attention (PagedEviction) ignore the setting: same tokens, same peak as without it.
#[test]
fn prompts_pruned_as_chunks_arrive_hold_budget_plus_interval() {
    let book = common::book_ids();
    let prompt = &book[2000..2400];
    let (budget, interval, bs) = (64usize, 64usize, 16usize);
    let config = |interval: usize, max_batch_tokens: usize| EngineConfig {
        prefill_prune_interval_tokens: interval,
        max_batch_tokens,
        ..Default::default()
    };
    for policy in ["streaming-llm", "knorm", "keydiff", "paged-eviction"] {
        let params = GenerateParams {
            max_tokens: 24,
            ignore_eos: true,
            kv_policy: Some(policy.parse().unwrap()),
            kv_budget: Some(budget as u32),
            ..Default::default()
        };
        let (exact, exact_peak) = run_alone_tracking_peak(config(0, 512), prompt, &params);
        let (chunked, chunked_peak) =
            run_alone_tracking_peak(config(interval, 512), prompt, &params);
        let (small_chunks, small_peak) =
            run_alone_tracking_peak(config(interval, 48), prompt, &params);
        assert_eq!(exact.len(), 24, "{policy}");
        assert!(
            exact_peak >= prompt.len() / bs,
            "{policy}: exact peak {exact_peak} blocks"
        );
        assert_eq!(
            chunked, small_chunks,
            "{policy}: tokens changed with the chunk size"
        );
        if policy == "paged-eviction" {
            assert_eq!(chunked, exact, "{policy} must keep exact prefill");
            assert_eq!(chunked_peak, exact_peak, "{policy}");
            continue;
        }
        // Budget + interval tokens, one block of headroom for a partly filled block.
        let bound = (budget + interval).div_ceil(bs) + 1;
        assert!(
            chunked_peak <= bound,
            "{policy}: peak {chunked_peak} blocks > {bound}"
        );
        assert!(
            small_peak <= bound,
            "{policy}: peak {small_peak} blocks > {bound}"
        );
    }
}

/// Preemption of prompts pruned as their chunks arrive: recomputed, each prunes at the same
/// points and gives the tokens it gives alone.
#[test]
fn preempted_chunk_pruned_sequences_recompute_the_same_tokens() {
    let book = common::book_ids();
    let ps: Vec<Vec<u32>> = (0..5)
        .map(|i| book[3000 + 200 * i..3000 + 200 * i + 150].to_vec())
        .collect();
    let params = GenerateParams {
        max_tokens: 64,
        ignore_eos: true,
        kv_policy: Some("streaming-llm".parse().unwrap()),
        kv_budget: Some(48),
        ..Default::default()
    };
    let config = |capacity: Option<usize>| EngineConfig {
        prefill_prune_interval_tokens: 32,
        kv_capacity_tokens: capacity,
        ..Default::default()
    };
    let mut single = common::engine(config(None));
    let alone = run_alone(&mut single, &ps, &params);
    let (preempted, preemptions) = run_batched(config(Some(12 * 16)), &ps, &params);
    assert!(
        preemptions > 0,
        "expected preemptions with a tight KV cache"
    );
    for (i, (got, want)) in preempted.iter().zip(&alone).enumerate() {
        assert_eq!(got, want, "prompt {i}");
    }
}

/// An interval below the block size is refused, naming the setting.
#[test]
fn prune_interval_below_the_block_size_is_refused() {
    let config = EngineConfig {
        prefill_prune_interval_tokens: 8,
        ..Default::default()
    };
    let Err(err) = pk_engine::Engine::load(&common::model_path(), config) else {
        panic!("an interval below the block size was accepted");
    };
    assert!(
        err.to_string().contains("prefill_prune_interval_tokens"),
        "{err}"
    );
}

/// `n > 1` under a server-default budget is refused by name, as under a request's own
/// budget (issue 34: the forked choices ran with no budget at all); a request that opts
/// out with `kv_policy: full` may still ask for several choices.
#[test]
fn n_choices_under_a_default_budget_are_refused_by_name() {
    let mut engine = common::engine(EngineConfig {
        default_kv_budget: Some(64),
        ..Default::default()
    });
    let prompt = prompts(&engine)[1].clone();
    let params = GenerateParams {
        n: 2,
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    let err = engine
        .submit(Request {
            prompt_ids: prompt.clone(),
            params: params.clone(),
            cache_salt: None,
            sink: Box::new(|_| true),
        })
        .unwrap_err();
    match err {
        pk_engine::SubmitError::InvalidParam { param, message } => {
            assert_eq!(param, "n", "{message}");
            assert!(message.contains("default"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let full = GenerateParams {
        kv_policy: Some("full".parse().unwrap()),
        ..params
    };
    assert_eq!(run_choices(&mut engine, &full, &prompt).len(), 2);
    // A granularity where nothing evicts would be accepted and unused: refused by name.
    let unused = GenerateParams {
        kv_granularity: Some("head".parse().unwrap()),
        n: 1,
        ..full
    };
    match engine.submit(Request {
        prompt_ids: prompt,
        params: unused,
        cache_salt: None,
        sink: Box::new(|_| true),
    }) {
        Err(pk_engine::SubmitError::InvalidParam { param, .. }) => {
            assert_eq!(param, "kv_granularity")
        }
        other => panic!("{:?}", other.err()),
    }
}

/// `prompt_tokens` counts what prefill computed, so a prompt served from the prefix cache
/// adds only its uncached tail; `prompt_tokens_served` (vLLM's `vllm:prompt_tokens_total`)
/// adds the whole prompt each time.
#[test]
fn served_prompt_tokens_include_the_cached_prefix() {
    let mut engine = common::engine(EngineConfig::default());
    let prompt = prompts(&engine)[1].clone();
    let params = GenerateParams {
        max_tokens: 2,
        ignore_eos: true,
        ..Default::default()
    };
    run_choices(&mut engine, &params, &prompt);
    let (computed, served) = (
        engine.stats.prompt_tokens,
        engine.stats.prompt_tokens_served,
    );
    assert_eq!(
        (computed, served),
        (prompt.len() as u64, prompt.len() as u64)
    );
    run_choices(&mut engine, &params, &prompt);
    assert!(
        engine.stats.prefix_hits_tokens > 0,
        "the second prompt hit the cache"
    );
    assert_eq!(
        engine.stats.prompt_tokens - computed,
        prompt.len() as u64 - engine.stats.prefix_hits_tokens
    );
    assert_eq!(
        engine.stats.prompt_tokens_served - served,
        prompt.len() as u64
    );
}
