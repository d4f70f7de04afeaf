//! KVzip's reconstruction passes run a piece per engine step beside the other sequences
//! (issue 37): the scores do not depend on the piece size, a stream decoding beside the
//! passes keeps its one token a step, a step carries no more pass tokens than a prompt
//! chunk may, and a sequence preempted while its passes run gives back its fork.

mod common;

use std::sync::{Arc, Mutex};

use pk_engine::{Engine, EngineConfig, GenerateParams, Request, SeqEvent};
use pk_kv::KvGranularity;

fn kvzip_params(policy: &str, max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ignore_eos: true,
        kv_policy: Some(policy.parse().unwrap()),
        kv_budget: Some(128),
        kv_granularity: Some(KvGranularity::Head),
        record_prefill_keeps: true,
        ..Default::default()
    }
}

/// Every unit's recorded KVzip scores for `policy` on the 600-token prompt.
fn prior_scores(engine: &mut Engine, policy: &str) -> Vec<Vec<f32>> {
    let prompt = &common::book_ids()[1000..1600];
    let out = engine
        .generate(prompt, &kvzip_params(policy, 4), &mut |_| {})
        .unwrap();
    assert_eq!(out.token_ids.len(), 4);
    out.prefill_keeps
        .expect("recorded")
        .into_iter()
        .map(|k| k.prior_scores)
        .collect()
}

/// Pieces of 40 tokens against whole passes: the same scores, with several chunks (the
/// earlier pieces' keys go to the kernel as always-visible keys) and with one chunk (the
/// log-sum-exp path on CPUs with AVX-512).
#[test]
fn passes_in_pieces_give_the_scores_of_whole_passes() {
    // Room in one step for a whole pass of the 600-token prompt (the default 512 would cut
    // the one-chunk policy's pass in two).
    let mut whole = common::engine(EngineConfig {
        max_batch_tokens: 1024,
        ..EngineConfig::default()
    });
    let mut pieces = common::engine(EngineConfig {
        max_batch_tokens: 40,
        ..EngineConfig::default()
    });
    for policy in ["kvzip:chunk=256:global", "kvzip:global"] {
        let (a, b) = (
            prior_scores(&mut whole, policy),
            prior_scores(&mut pieces, policy),
        );
        assert_eq!(a.len(), b.len());
        let mut max_diff = 0f32;
        for (ra, rb) in a.iter().zip(&b) {
            assert_eq!(ra.len(), 600);
            for (x, y) in ra.iter().zip(rb) {
                max_diff = max_diff.max((x - y).abs() / (1e-3 + x.abs()));
            }
        }
        eprintln!("{policy}: max relative difference {max_diff}");
        assert!(max_diff < 1e-5, "{policy}: relative difference {max_diff}");
        // The scores are not trivial: some tokens score well below the sinks.
        assert!(a.iter().flatten().any(|&x| x < 0.01), "{policy}");
        whole.check_invariants();
        pieces.check_invariants();
    }
}

/// Per-request counters a sink fills.
#[derive(Default)]
struct Seen {
    tokens: usize,
    finished: bool,
    error: Option<String>,
}

fn submit(engine: &mut Engine, prompt: &[u32], params: GenerateParams) -> Arc<Mutex<Seen>> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let sink_seen = seen.clone();
    let sink = Box::new(move |ev: SeqEvent| {
        let mut s = sink_seen.lock().unwrap();
        match ev {
            SeqEvent::Text { token_ids, .. } => s.tokens += token_ids.len(),
            SeqEvent::Finished(_) => s.finished = true,
            SeqEvent::Error(e) => s.error = Some(e.to_string()),
            _ => {}
        }
        true
    });
    engine
        .submit(Request {
            prompt_ids: prompt.to_vec(),
            params,
            cache_salt: None,
            sink,
        })
        .unwrap();
    seen
}

/// Request A (book tokens `a_prompt`, `a_tokens` out) until it decodes, then request B
/// (600 book tokens, `kvzip:chunk=256` to 128 tokens, 8 out) beside it.
fn stream_then_kvzip(
    engine: &mut Engine,
    a_prompt: std::ops::Range<usize>,
    a_tokens: usize,
) -> (Arc<Mutex<Seen>>, Arc<Mutex<Seen>>) {
    let book = common::book_ids();
    let plain = GenerateParams {
        max_tokens: a_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let a = submit(engine, &book[a_prompt], plain);
    while a.lock().unwrap().tokens == 0 {
        engine.step();
    }
    let b = submit(
        engine,
        &book[1000..1600],
        kvzip_params("kvzip:chunk=256", 8),
    );
    (a, b)
}

/// A stream decoding beside a KVzip request: while the passes run (several steps), it
/// gets a token every step, and no step runs more than the decode plus a prompt chunk's
/// allowance (`max_prefill_tokens_while_decoding`); then the KVzip request decodes too.
#[test]
fn a_stream_decodes_every_step_while_passes_run_beside_it() {
    let config = EngineConfig::default();
    let allowance = config.max_prefill_tokens_while_decoding;
    let mut engine = common::engine(config);
    let (a, b) = stream_then_kvzip(&mut engine, 0..100, 200);
    let mut pending_steps = 0;
    while engine.has_work() {
        // Only A samples while B's passes run: one generated token a step is A's decode.
        let before = engine.stats.generation_tokens;
        let pending = engine.num_kvzip_pending() == 1;
        let ran = engine.step();
        if pending {
            pending_steps += 1;
            let sampled = engine.stats.generation_tokens - before;
            assert_eq!(sampled, 1, "A decodes every step");
            assert!(ran <= 1 + allowance, "{ran} tokens in one step");
        }
    }
    // Three chunks' passes, each a chunk of 256 (or 88) and a prompt, in pieces of 64.
    assert!(pending_steps >= 10, "{pending_steps} steps of passes");
    let (a, b) = (a.lock().unwrap(), b.lock().unwrap());
    assert!(a.finished && b.finished, "{:?} {:?}", a.error, b.error);
    assert_eq!((a.tokens, b.tokens), (200, 8));
    assert!(engine.eviction_stats["kvzip"].reconstruction_forward_seconds > 0.0);
    engine.check_invariants();
    let pool = engine.kv_manager().pool();
    assert_eq!(pool.num_free_blocks(), pool.num_blocks());
}

/// A pool too small for a stream's growth and a KVzip request's passes at once: the
/// passes' sequence is preempted while they run (its fork freed with it), admitted again
/// later, and both requests finish with every block back in the pool. Pieces of 8 tokens
/// make the passes long enough for the stream to outgrow the pool (1,160–1,240 tokens of
/// pool do it; 1,280 does not).
#[test]
fn a_sequence_preempted_during_its_passes_gives_its_fork_back() {
    let mut engine = common::engine(EngineConfig {
        kv_capacity_tokens: Some(1200),
        max_prefill_tokens_while_decoding: 8,
        ..EngineConfig::default()
    });
    let (a, b) = stream_then_kvzip(&mut engine, 0..200, 400);
    let mut preempted_while_pending = 0;
    while engine.has_work() {
        let pending = engine.num_kvzip_pending() == 1;
        engine.step();
        engine.check_invariants();
        if pending && engine.num_kvzip_pending() == 0 && engine.num_waiting() == 1 {
            preempted_while_pending += 1;
        }
    }
    assert!(
        preempted_while_pending >= 1,
        "the pool never ran out during the passes"
    );
    let (a, b) = (a.lock().unwrap(), b.lock().unwrap());
    assert!(a.finished && b.finished, "{:?} {:?}", a.error, b.error);
    assert_eq!((a.tokens, b.tokens), (400, 8));
    let pool = engine.kv_manager().pool();
    assert_eq!(pool.num_free_blocks(), pool.num_blocks());
}

/// A background request's passes (a stored context scored in idle time) yield to a user's
/// request that arrives while they run: its prompt takes the step's allowance first, and
/// it has its first tokens before the passes end.
#[test]
fn a_users_request_goes_ahead_of_background_passes() {
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let background = GenerateParams {
        background: true,
        ..kvzip_params("kvzip:chunk=256", 2)
    };
    let b = submit(&mut engine, &book[1000..1600], background);
    while engine.num_kvzip_pending() == 0 {
        assert!(
            engine.has_work(),
            "the background request ended without passes"
        );
        engine.step();
    }
    let user = GenerateParams {
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    let a = submit(&mut engine, &book[0..300], user);
    let mut user_tokens_during_passes = 0;
    while engine.has_work() {
        engine.step();
        if engine.num_kvzip_pending() == 1 {
            user_tokens_during_passes = a.lock().unwrap().tokens;
        }
    }
    assert!(
        user_tokens_during_passes >= 1,
        "the user's request waited for the background passes"
    );
    let (a, b) = (a.lock().unwrap(), b.lock().unwrap());
    assert!(a.finished && b.finished, "{:?} {:?}", a.error, b.error);
    assert_eq!((a.tokens, b.tokens), (4, 2));
    let pool = engine.kv_manager().pool();
    assert_eq!(pool.num_free_blocks(), pool.num_blocks());
}

/// Blocks set aside for a pass stay set aside while it runs: a request that arrives
/// during the passes and fits only in them waits for them to end, instead of being
/// admitted and leaving the passes no room (which would preempt the KVzip request).
#[test]
fn admission_keeps_a_running_pass_its_blocks() {
    let mut engine = common::engine(EngineConfig {
        kv_capacity_tokens: Some(1600),
        max_prefill_tokens_while_decoding: 8,
        ..EngineConfig::default()
    });
    let (a, b) = stream_then_kvzip(&mut engine, 0..200, 400);
    while engine.num_kvzip_pending() == 0 {
        engine.step();
    }
    let book = common::book_ids();
    let late = GenerateParams {
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    let c = submit(&mut engine, &book[2000..2500], late);
    let mut admitted_during_passes = false;
    while engine.has_work() {
        engine.step();
        if engine.num_kvzip_pending() == 1 && engine.num_waiting() == 0 {
            admitted_during_passes = true;
        }
    }
    assert!(
        !admitted_during_passes,
        "the late request took the pass's blocks"
    );
    assert_eq!(engine.stats.preemptions, 0);
    for (seen, n) in [(a, 400), (b, 8), (c, 4)] {
        let seen = seen.lock().unwrap();
        assert!(seen.finished, "{:?}", seen.error);
        assert_eq!(seen.tokens, n);
    }
}

/// `prefix=`: on a chat prompt the template's prefix is kept whole and scores 1 under
/// `kept` (the authors' treatment), scores 0 but for the 4 sinks under `kvpress`, and is
/// scored like the rest of the context by default; the context after it is scored under
/// all three, and not the same way (the passes repeat different text).
#[test]
fn the_template_prefix_is_treated_as_the_option_says() {
    let mut engine = common::engine(EngineConfig::default());
    let prefix_text = engine.chat_template.user_turn_prefix().unwrap();
    let prefix = engine.tokenizer.encode_prompt(&prefix_text, true);
    let n_prefix = prefix.len();
    assert!(n_prefix > 8, "SmolLM2's template writes a system turn");
    let prompt: Vec<u32> = [&prefix[..], &common::book_ids()[1000..1500]].concat();
    let mut run = |policy: &str| {
        let out = engine
            .generate(&prompt, &kvzip_params(policy, 2), &mut |_| {})
            .unwrap();
        out.prefill_keeps.expect("recorded")
    };
    let (context, kept, kvpress) = (
        run("kvzip:global"),
        run("kvzip:global:prefix=kept"),
        run("kvzip:global:prefix=kvpress"),
    );
    for unit in &kept {
        assert!(unit.prior_scores[..n_prefix].iter().all(|&s| s == 1.0));
        assert!(
            (0..n_prefix as u32).all(|t| unit.kept.contains(&t)),
            "kept whole"
        );
    }
    for unit in &kvpress {
        assert!(unit.prior_scores[..4].iter().all(|&s| s == 1.0));
        assert!(unit.prior_scores[4..n_prefix].iter().all(|&s| s == 0.0));
    }
    assert!(
        context.iter().any(|u| u.prior_scores[4..n_prefix]
            .iter()
            .any(|&s| s > 0.0 && s < 1.0)),
        "by default the prefix is scored as context"
    );
    let after = |units: &[pk_engine::PrefillKeep]| -> Vec<f32> {
        units
            .iter()
            .flat_map(|u| u.prior_scores[n_prefix..prompt.len()].to_vec())
            .collect()
    };
    let (a, b) = (after(&context), after(&kept));
    assert!(a.iter().chain(&b).any(|&s| s > 0.0 && s < 1.0));
    assert!(a != b, "the passes over different text score differently");
    engine.check_invariants();
}
