//! Qwen2.5-Coder (architecture `qwen2`: biased Q/K/V, NEOX RoPE at base 10⁶, 151,936-token
//! byte-level BPE) through the whole engine, against llama.cpp on the same GGUFs
//! (tests/fixtures/qwen-reference.md says how each reference was made): perplexity by
//! llama-perplexity's protocol within 1 %, greedy chat and code continuations up to near
//! ties, and a prompt far past SmolLM2's 8K window.
//!
//! The models are fetched by `pagekeeper fetch-model --name all` (the README's test
//! command); these tests fail, not skip, without them.

use pk_engine::model_store::{known_model_path, KnownModel, QWEN25_CODER_05B, QWEN25_CODER_15B};
use pk_engine::perplexity::perplexity;
use pk_engine::{Engine, EngineConfig, GenerateParams};

fn engine(m: &KnownModel, config: EngineConfig) -> Engine {
    let p = known_model_path(m);
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all` first",
        p.display()
    );
    Engine::load(&p, config).expect("engine loads")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn book_ids(short: &str) -> Vec<u32> {
    let text = match short {
        "qwen2.5-coder-0.5b" => {
            include_str!("../../../tests/fixtures/qwen2.5-coder-0.5b-verne-token-ids.json")
        }
        _ => include_str!("../../../tests/fixtures/qwen2.5-coder-1.5b-verne-token-ids.json"),
    };
    ids(&serde_json::from_str::<serde_json::Value>(text).unwrap()["token_ids"])
}

fn ppl(m: &KnownModel, chunks: usize) -> f64 {
    let mut e = engine(
        m,
        EngineConfig {
            kv_capacity_tokens: Some(512),
            ..Default::default()
        },
    );
    let r = perplexity(&mut e, &book_ids(m.name), 512, Some(chunks), &mut |_, _| {}).unwrap();
    e.check_invariants();
    r.ppl
}

fn assert_within(got: f64, want: f64, rel: f64, what: &str) {
    eprintln!("{what}: PPL {got:.4}, llama.cpp {want}");
    assert!(
        (got - want).abs() / want < rel,
        "{what}: PPL {got:.4}, llama.cpp {want}: not within {:.1}%",
        rel * 100.0
    );
}

/// llama-perplexity -c 512 --chunks 20 on the 0.5B model (qwen-reference.md).
const LLAMA_CPP_05B_PPL_512_20: f64 = 36.8035;
/// llama-perplexity -c 512 on the 1.5B model: its running estimate after 4 chunks.
const LLAMA_CPP_15B_PPL_512_4: f64 = 12.2576;

#[test]
fn qwen25_coder_05b_perplexity_within_one_percent_of_llama_cpp() {
    assert_within(
        ppl(&QWEN25_CODER_05B, 20),
        LLAMA_CPP_05B_PPL_512_20,
        0.01,
        "0.5B, n_ctx 512 x 20",
    );
}

#[test]
fn qwen25_coder_15b_perplexity_within_one_percent_of_llama_cpp() {
    // Four chunks keep the test near a minute; BENCHMARKS.md has all twenty.
    assert_within(
        ppl(&QWEN25_CODER_15B, 4),
        LLAMA_CPP_15B_PPL_512_4,
        0.01,
        "1.5B, n_ctx 512 x 4",
    );
}

/// The engine's greedy tokens (paged prefill, decode, sampling) equal llama.cpp's until
/// the first near-tie: where they part, our token must be among llama.cpp's top 5 at that
/// step, within 0.3 nats of its choice (measured: the 0.5B model's chat_arith parts at
/// step 9, a 0.13-nat tie; every other prompt agrees for all its tokens or parts at a
/// tie, as the teacher-forced logits test in crates/model/tests/golden_logits.rs shows).
#[test]
fn greedy_tokens_equal_llama_cpps_up_to_near_ties() {
    for (m, fixture) in [
        (
            &QWEN25_CODER_05B,
            include_str!("../../../tests/fixtures/qwen2.5-coder-0.5b-greedy.json"),
        ),
        (
            &QWEN25_CODER_15B,
            include_str!("../../../tests/fixtures/qwen2.5-coder-1.5b-greedy.json"),
        ),
    ] {
        let mut e = engine(
            m,
            EngineConfig {
                kv_capacity_tokens: Some(1024),
                ..Default::default()
            },
        );
        let golden: serde_json::Value = serde_json::from_str(fixture).unwrap();
        for p in golden["prompts"].as_array().unwrap() {
            let name = p["name"].as_str().unwrap();
            let prompt = ids(&p["prompt_token_ids"]);
            assert_eq!(
                e.tokenizer.encode(p["prompt"].as_str().unwrap(), true),
                prompt,
                "{}: {name}: tokenization",
                m.name
            );
            let want: Vec<u32> = ids(&p["greedy_token_ids"])
                .into_iter()
                .filter(|&t| !e.tokenizer.is_eog(t))
                .collect();
            let out = e
                .generate(
                    &prompt,
                    &GenerateParams {
                        max_tokens: want.len(),
                        ..Default::default()
                    },
                    &mut |_| {},
                )
                .unwrap();
            let agree = out
                .token_ids
                .iter()
                .zip(&want)
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!(
                "{} {name}: {agree} of {} greedy tokens agree",
                m.name,
                want.len()
            );
            if agree < want.len() {
                let ours = out.token_ids[agree];
                let top5 = p["top5_per_step"][agree].as_array().unwrap();
                let lp = |id: u32| {
                    top5.iter()
                        .find(|c| c["id"].as_u64() == Some(id as u64))
                        .map(|c| c["logprob"].as_f64().unwrap())
                };
                let gap = lp(want[agree]).zip(lp(ours)).map(|(a, b)| a - b);
                assert!(gap.is_some_and(|g| g < 0.3), "{} {name}: parts from llama.cpp at step {agree} ({ours} vs {}), not at a near-tie (gap {gap:?})", m.name, want[agree]);
            }
            e.check_invariants();
        }
    }
}

/// A prompt of about 9K tokens (past SmolLM2's whole 8K window, within Qwen's 32K) runs, and
/// recalls a fact from its start: the long-context path works end to end.
#[test]
fn long_prompt_recalls_a_fact_from_its_start() {
    let mut e = engine(
        &QWEN25_CODER_05B,
        EngineConfig {
            kv_capacity_tokens: Some(16_384),
            max_batch_tokens: 2048,
            ..Default::default()
        },
    );
    let book = String::from_utf8_lossy(include_bytes!(
        "../../../tests/fixtures/around-the-world-in-80-days.txt"
    ))
    .into_owned();
    let mut text = String::from("<|im_start|>user\nRemember this: the secret code is 7319.\n\n");
    // Enough of the book for about 9K tokens.
    text.extend(book.chars().take(36_000));
    text.push_str("\n\nWhat is the secret code? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n");
    let prompt = e.tokenizer.encode(&text, true);
    assert!(
        prompt.len() > 8_192 && prompt.len() < 12_000,
        "{} tokens",
        prompt.len()
    );
    let out = e
        .generate(
            &prompt,
            &GenerateParams {
                max_tokens: 8,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap();
    assert!(
        out.text.contains("7319"),
        "{} prompt tokens: answered {:?}",
        prompt.len(),
        out.text
    );
    e.check_invariants();
}

/// Fill-in-the-middle as the server builds it for `suffix` (`<|fim_prefix|>` prefix
/// `<|fim_suffix|>` suffix `<|fim_middle|>`): Qwen2.5-Coder writes the missing middle.
#[test]
fn fill_in_the_middle_with_qwens_fim_tokens() {
    let mut e = engine(&QWEN25_CODER_05B, EngineConfig::default());
    let t = &e.tokenizer;
    let fim: Vec<u32> = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
        .iter()
        .map(|s| t.token_id(s).expect("Qwen2.5-Coder has FIM tokens"))
        .collect();
    let mut prompt = vec![fim[0]];
    prompt.extend(t.encode("def add(a, b):\n    return ", false));
    prompt.push(fim[1]);
    prompt.extend(t.encode("\n\nprint(add(1, 2))  # 3\n", false));
    prompt.push(fim[2]);
    let params = GenerateParams {
        max_tokens: 8,
        ..Default::default()
    };
    let out = e.generate(&prompt, &params, &mut |_| {}).unwrap();
    eprintln!("middle: {:?}", out.text);
    assert!(out.text.trim_start().starts_with("a + b"), "{:?}", out.text);
}
