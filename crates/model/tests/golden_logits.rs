//! The forward pass against llama.cpp's: teacher-force llama.cpp's greedy tokens after each
//! golden prompt and compare, at every step, the log-probabilities of llama.cpp's top-5
//! tokens with ours, and its greedy token with our argmax.
//!
//! References (all llama.cpp, `llama-server /completion`, temperature 0, `n_probs` 5, one
//! thread; see each fixture's `reference` field):
//! - `smollm2-greedy.json`: build b4748 (c392e5094) on an AVX-512 host without AMX,
//!   regenerated 2026-12-01 (shared/golden/README.md: the first recording came from a build
//!   whose AMX path was broken for Q4_1, and is withdrawn).
//! - `qwen2.5-coder-{0.5b,1.5b}-greedy.json`: the llama.cpp that llama-cpp-python 0.3.8
//!   vendors, built from source here (tests/fixtures/qwen-reference.md).
//!
//! Two implementations of the same quantised model differ in summation order and in how
//! activations are quantised for the integer matmuls, so log-probabilities differ by a few
//! hundredths of a nat on average and a near-tie may flip the argmax. Measured (AMD EPYC
//! host with AVX2, no AVX-512; f16 KV cache, 16-token blocks), top-5 |Δ log-prob| over all steps, mean / max:
//! SmolLM2 0.072–0.106 / 0.33–0.65 (the 135M Q4_1 model is the most sensitive to the
//! rounding of its 8-bit activations), Qwen2.5-Coder-0.5B 0.047–0.075 / 0.18–0.29,
//! Qwen2.5-Coder-1.5B 0.060–0.071 / 0.24–0.54 (measured when its Q4_K weights ran as Q4_1
//! with f16-rounded scale products; run natively since, on an Intel Xeon with AMX: 0.060–0.068
//! / 0.27–0.49, against 0.064–0.072 / 0.30–0.56 with `PK_Q4K=q4_1` in the same session; with
//! Q4_K and Q6_K run natively over 256-element activation blocks, as llama.cpp runs them,
//! 0.060–0.081 / 0.32–0.56, 2026-12-06); the argmax differs once or twice per model, at gaps
//! of 0.26, 0.13 and 0.033 nats or less. The bounds below are
//! those maxima with a margin; a wrong forward pass (a missing bias, the wrong RoPE
//! pairing, a mis-decoded block) moves them by whole nats.

use pk_model::{KvDtype, KvGeometry, KvStore, Llama, SeqForward};

fn model_path(file: &str) -> std::path::PathBuf {
    let home = std::env::var_os("PAGEKEEPER_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/pagekeeper")
        });
    let p = home.join(file);
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all` first",
        p.display()
    );
    p
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
    x.iter().map(|v| v - lse).collect()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// What one prompt measured: the largest |Δ log-prob| over llama.cpp's top-5 at any step,
/// and the steps where llama.cpp's greedy token was not our argmax, with the gap on each
/// side at each: ours (our argmax's log-prob minus that of llama.cpp's token) and
/// llama.cpp's (its token's log-prob minus that of our argmax; infinite when our argmax is
/// not among its top five).
struct PromptReport {
    name: String,
    max_abs_delta: f32,
    mean_abs_delta: f32,
    flips: Vec<(usize, f32, f32)>,
}

/// Teacher-forces every prompt of `fixture` through `model_file` in one forward call per
/// prompt (prompt and forced tokens as one batch; a deliberately non-contiguous block table).
fn teacher_forced(model_file: &str, fixture_file: &str) -> Vec<PromptReport> {
    let path = format!(
        "{}/../../tests/fixtures/{fixture_file}",
        env!("CARGO_MANIFEST_DIR")
    );
    let fixture = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let f = pk_gguf::GgufFile::open(model_path(model_file)).unwrap();
    let model = Llama::from_gguf(&f).unwrap();
    let c = model.config.clone();
    let golden: serde_json::Value = serde_json::from_str(&fixture).unwrap();
    let mut reports = Vec::new();
    for p in golden["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap().to_string();
        let prompt = ids(&p["prompt_token_ids"]);
        let greedy = ids(&p["greedy_token_ids"]);
        let steps = p["top5_per_step"].as_array().unwrap();
        let mut tokens = prompt.clone();
        tokens.extend(&greedy[..steps.len() - 1]);
        let bs = 16;
        let num_blocks = tokens.len().div_ceil(bs);
        // llama.cpp's default cache is f16, so ours is too.
        let geometry = KvGeometry {
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_size_tokens: bs,
            num_blocks,
        };
        let mut store = KvStore::new(geometry, KvDtype::F16);
        let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
        let logits = model.forward(
            &mut store,
            &[SeqForward {
                tokens: &tokens,
                start_position: 0,
                stored_start: 0,
                block_table: &table,
                logits_from: prompt.len() - 1,
                stored_positions: &[],
                window_tables: &[],
                head_first_keys: &[],
            }],
        );
        let (mut max_abs, mut sum_abs, mut n) = (0f32, 0f32, 0usize);
        let mut flips = Vec::new();
        for (step, want) in steps.iter().enumerate() {
            let lp = log_softmax(&logits[step * c.vocab_size..(step + 1) * c.vocab_size]);
            for w in want.as_array().unwrap() {
                let id = w["id"].as_u64().unwrap() as usize;
                let d = (lp[id] - w["logprob"].as_f64().unwrap() as f32).abs();
                max_abs = max_abs.max(d);
                sum_abs += d;
                n += 1;
            }
            let ours = (0..lp.len())
                .max_by(|&a, &b| lp[a].total_cmp(&lp[b]))
                .unwrap();
            let theirs = greedy[step] as usize;
            if ours != theirs {
                let their_lp = |id: usize| {
                    want.as_array()
                        .unwrap()
                        .iter()
                        .find(|w| w["id"].as_u64() == Some(id as u64))
                        .map(|w| w["logprob"].as_f64().unwrap() as f32)
                };
                let their_gap = match (their_lp(theirs), their_lp(ours)) {
                    (Some(t), Some(o)) => t - o,
                    _ => f32::INFINITY,
                };
                flips.push((step, lp[ours] - lp[theirs], their_gap));
            }
        }
        let r = PromptReport {
            name,
            max_abs_delta: max_abs,
            mean_abs_delta: sum_abs / n as f32,
            flips,
        };
        // Printed so that re-measuring the bounds needs only `--nocapture`.
        eprintln!("{model_file} {}: {} steps, top-5 |Δ logprob| max {:.3} mean {:.4}, argmax differs at {:?}", r.name, steps.len(), r.max_abs_delta, r.mean_abs_delta, r.flips);
        reports.push(r);
    }
    reports
}

/// Holds every prompt to `max_bound` on the largest top-5 difference and `mean_bound` on
/// the mean, and allows an argmax difference only at a near-tie: where our gap between the
/// two tokens or llama.cpp's own is below `tie_nats` (as `golden_greedy` in pk-engine
/// judges by llama.cpp's gap). Both sides count because which of two such tokens wins
/// follows summation order: Qwen2.5-Coder-1.5B's raw_capital step 20, where llama.cpp's own
/// gap is 0.099 nats, came out at 0.028 nats our way with the AVX-512 attention kernel and
/// at 0.143 with the AVX2 one (`PK_ISA=avx2`, as on the AMD hosts), 2026-12-07.
fn check(reports: &[PromptReport], max_bound: f32, mean_bound: f32, tie_nats: f32) {
    for r in reports {
        assert!(
            r.max_abs_delta < max_bound,
            "{}: top-5 log-prob differs from llama.cpp's by {} (bound {max_bound})",
            r.name,
            r.max_abs_delta
        );
        assert!(
            r.mean_abs_delta < mean_bound,
            "{}: mean top-5 difference {} (bound {mean_bound})",
            r.name,
            r.mean_abs_delta
        );
        for &(step, ours, theirs) in &r.flips {
            assert!(ours.min(theirs) < tie_nats, "{}: step {step}: llama.cpp's greedy token is {ours} nats below our argmax, and ours {theirs} below its (not a near-tie)", r.name);
        }
    }
}

#[test]
fn smollm2_teacher_forced_top5_match_llama_cpp() {
    let reports = teacher_forced("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-greedy.json");
    check(&reports, 0.8, 0.13, 0.35);
}

#[test]
fn qwen25_coder_05b_teacher_forced_top5_match_llama_cpp() {
    let reports = teacher_forced(
        "Qwen2.5-Coder-0.5B-Instruct.gguf",
        "qwen2.5-coder-0.5b-greedy.json",
    );
    check(&reports, 0.4, 0.1, 0.25);
}

/// Since Q4_K and Q6_K take 256-element activation blocks, as llama.cpp's do
/// (`kernels/q8k.rs`), the four prompts measured max 0.32–0.56 and mean 0.060–0.081 nats,
/// with two near-ties flipped (0.028 and 0.033 nats); with Q4_K alone changed, raw_capital's
/// step 20 had flipped at 0.115.
#[test]
fn qwen25_coder_15b_teacher_forced_top5_match_llama_cpp() {
    let reports = teacher_forced(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        "qwen2.5-coder-1.5b-greedy.json",
    );
    check(&reports, 0.7, 0.1, 0.1);
}
