//! Greedy generation through the whole engine (tokenizer → paged prefill → decode →
//! sampling) against llama.cpp's greedy tokens for the six golden prompts.

mod common;

use pk_engine::{EngineConfig, FinishReason, GenerateParams, TokenLogprob};

/// Below this gap between llama.cpp's own top two log-probabilities a step is a near-tie:
/// the two implementations' log-probabilities differ by 0.07–0.11 nats on average
/// (crates/model/tests/golden_logits.rs), so which side of it the argmax falls depends on
/// summation order, which differs between our AVX2, AVX-512 and AMX kernels. Measured: on
/// an Intel Xeon with AMX, raw_list's sixth token (llama.cpp's gap 0.074 nats, three
/// tokens within 0.11) came out as the third of them, while AVX2 hosts matched.
const NEAR_TIE_NATS: f64 = 0.08;

/// llama.cpp's greedy tokens (b4748, regenerated on a host without AMX; see
/// shared/golden/README.md) and ours agree for the first 8 tokens of every prompt, or up to
/// its first near-tie in llama.cpp's own distribution (chat_capital's 8th token, gap 0.019;
/// raw_list's 6th, 0.074) or in ours, after which the continuations may part. Measured on
/// an AMD EPYC Zen 3 (AVX2 kernels): raw_verne's 7th token is 253 over 284 by 0.105 nats
/// in llama.cpp, by 0.051 in ours before the AVX2 attention took four blocks per softmax
/// step (444a861), and 284 over 253 by 0.015 after it, the rest of the step's
/// distribution within 0.07 nats. Every prompt is also held to its exact tokenization.
#[test]
fn greedy_tokens_against_llama_cpp() {
    let mut engine = common::engine(EngineConfig::default());
    let golden = common::golden();
    for p in golden["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let prompt_ids = common::ids(&p["prompt_token_ids"]);
        // The tokenizer must produce the same prompt ids from the prompt text.
        let chat = name.starts_with("chat");
        assert_eq!(
            engine.tokenizer.encode(p["prompt"].as_str().unwrap(), chat),
            prompt_ids,
            "{name}: tokenization"
        );
        let must_match = p["top5_per_step"]
            .as_array()
            .unwrap()
            .iter()
            .take(8)
            .position(|top5| {
                let lp = |i: usize| top5[i]["logprob"].as_f64().unwrap();
                lp(0) - lp(1) < NEAR_TIE_NATS
            })
            .unwrap_or(8);
        assert!(
            must_match >= 5,
            "{name}: only {must_match} tokens before a near-tie"
        );
        let want: Vec<u32> = common::ids(&p["greedy_token_ids"])
            .into_iter()
            .take(must_match)
            .collect();
        let out = engine
            .generate(
                &prompt_ids,
                &GenerateParams {
                    max_tokens: 8,
                    logprobs: Some(2),
                    ..Default::default()
                },
                &mut |_| {},
            )
            .unwrap();
        let mut got = out.token_ids.clone();
        // llama.cpp's list ends with the end-of-generation token; ours stops before it.
        if out.finish_reason == FinishReason::Stop {
            got.push(engine.tokenizer.eos_id());
        }
        // llama.cpp's list may be shorter than 8 (chat_sky's reference stops after 6).
        let n = agreeing_prefix(name, &got, &want, &out.logprobs);
        assert!(n >= 5, "{name}: only {n} tokens before a near-tie");
        assert!(!out.text.is_empty(), "{name}: empty output");
        engine.check_invariants();
    }
}

/// How many of `got` agree with llama.cpp's `want`, which they must up to its end, except
/// at a step that is a near-tie in our own distribution between our token and llama.cpp's
/// (`logprobs[i]`: our top two within [`NEAR_TIE_NATS`], llama.cpp's token the second):
/// the argmax of two tokens that close depends on summation order on our side too, and the
/// continuations part there.
fn agreeing_prefix(name: &str, got: &[u32], want: &[u32], logprobs: &[TokenLogprob]) -> usize {
    assert!(
        got.len() >= want.len(),
        "{name}: {} tokens, llama.cpp's {}",
        got.len(),
        want.len()
    );
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        let our_tie = logprobs.get(i).is_some_and(|lp| {
            lp.top.len() > 1
                && lp.top[1].0 == w
                && f64::from(lp.top[0].1 - lp.top[1].1) < NEAR_TIE_NATS
        });
        assert!(
            our_tie,
            "{name}: greedy token {i} differs from llama.cpp's: {got:?} vs {want:?}"
        );
        return i;
    }
    want.len()
}

#[test]
fn chat_answer_is_coherent() {
    // A guard against silent model breakage that the bounds above might miss: the default
    // model, greedy, names Paris when asked about France in plain text.
    let mut engine = common::engine(EngineConfig::default());
    let prompt = engine.tokenizer.encode("The capital of France is", false);
    let out = engine
        .generate(
            &prompt,
            &GenerateParams {
                max_tokens: 4,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap();
    assert!(out.text.contains("Paris"), "{:?}", out.text);
}

#[test]
fn prefix_cache_hit_gives_identical_greedy_output() {
    let mut engine = common::engine(EngineConfig::default());
    let golden = common::golden();
    let prompt_ids = common::ids(&golden["prompts"][0]["prompt_token_ids"]);
    let params = GenerateParams {
        max_tokens: 12,
        ..Default::default()
    };
    let first = engine.generate(&prompt_ids, &params, &mut |_| {}).unwrap();
    assert_eq!(first.cached_prompt_tokens, 0);
    let second = engine.generate(&prompt_ids, &params, &mut |_| {}).unwrap();
    // 37 prompt tokens with 16-token blocks: two full blocks are reusable.
    assert_eq!(second.cached_prompt_tokens, 32);
    assert_eq!(first.token_ids, second.token_ids);
    engine.check_invariants();
}

#[test]
fn streamed_text_equals_final_text_and_stop_strings_cut() {
    let mut engine = common::engine(EngineConfig::default());
    let prompt = engine.tokenizer.encode(
        "The planets of the solar system, in order from the Sun, are",
        false,
    );
    let mut streamed = String::new();
    let out = engine
        .generate(
            &prompt,
            &GenerateParams {
                max_tokens: 24,
                ..Default::default()
            },
            &mut |s| streamed.push_str(s),
        )
        .unwrap();
    assert_eq!(streamed, out.text);
    assert!(!out.text.is_empty());
    // Stopping at the first newline must cut the text before it.
    let mut streamed2 = String::new();
    let params = GenerateParams {
        max_tokens: 24,
        stop: vec!["\n".into()],
        ..Default::default()
    };
    let out2 = engine
        .generate(&prompt, &params, &mut |s| streamed2.push_str(s))
        .unwrap();
    assert_eq!(out2.finish_reason, FinishReason::Stop);
    assert!(!out2.text.contains('\n'));
    assert_eq!(streamed2, out2.text);
    assert!(out.text.starts_with(&out2.text));
}

#[test]
fn kv_cache_exhaustion_is_an_error_not_a_panic() {
    let mut engine = common::engine(EngineConfig {
        kv_capacity_tokens: Some(32),
        ..Default::default()
    });
    let prompt: Vec<u32> = (0..40).map(|i| 1000 + i).collect();
    let err = engine
        .generate(&prompt, &GenerateParams::default(), &mut |_| {})
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("needs 4 KV blocks of 16 tokens but the cache has only 2"),
        "{err}"
    );
    engine.check_invariants();
    assert_eq!(
        engine.kv_manager().pool().num_free_blocks(),
        2,
        "blocks of the failed request were freed"
    );
}
