//! KVzip's scores and budgets against the second implementation: kvpress 0.5.5's
//! `KVzipPress` arithmetic in NumPy (`scripts/kvpress_reference.py`), run on the random
//! keys and queries of `tests/fixtures/kvzip-scores.json` (`scripts/kvzip_fixture.py`):
//! two passes over a 40-token context in chunks of 20 (the second with 4 sinks in its
//! softmax), then the kept sets at half the entries removed under each budget.

use pk_kv::{
    kvzip_chunks, kvzip_initial_scores, kvzip_kept, kvzip_pass_ids, kvzip_pass_scores, DenseKv,
    DenseQueries, KvzipBudget,
};
use serde_json::Value;

fn fixture() -> Value {
    serde_json::from_str(include_str!("../../../tests/fixtures/kvzip-scores.json")).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn pass_scores_match_the_second_implementation() {
    let f = fixture();
    let dim = |k: &str| f["shape"][k].as_u64().unwrap() as usize;
    let (l, kvh, h, d, n, chunk, r) = (
        dim("layers"),
        dim("kv_heads"),
        dim("heads"),
        dim("head_dim"),
        dim("context"),
        dim("chunk"),
        dim("pass"),
    );
    let keys = floats(&f["keys"]);
    let queries = floats(&f["queries"]);
    let stored = n + 2 * r;
    let mut scores = kvzip_initial_scores(l, kvh, n);
    let chunks = kvzip_chunks(0, n, chunk);
    assert_eq!(chunks, vec![0..20, 20..40]);
    for (c, range) in chunks.iter().enumerate() {
        // The pool as the pass sees it: the context, then this pass's own tokens.
        let own = n + c * r;
        let kv = DenseKv::from_fn(l, kvh, d, n + r, |li, hh, t, k, v| {
            let src = if t < n { t } else { own + t - n };
            let at = ((li * kvh + hh) * stored + src) * d;
            k.copy_from_slice(&keys[at..at + d]);
            v.fill(0.0);
        });
        let q = DenseQueries::from_fn(l, h, d, (n..n + r).collect(), |li, hh, p, out| {
            let at = ((((c * l + li) * h + hh) * r) + p - n) * d;
            out.copy_from_slice(&queries[at..at + d]);
        });
        kvzip_pass_scores(&kv, &q, range.clone(), n..n + r, n, &mut scores);
    }
    let want = floats(&f["scores"]);
    for (i, (a, b)) in scores.iter().zip(&want).enumerate() {
        assert!((a - b).abs() <= 1e-5, "score {i}: {a} vs {b}");
    }
    for (name, budget) in [
        ("global", KvzipBudget::Global),
        ("layer", KvzipBudget::Layer),
        ("uniform", KvzipBudget::Uniform),
    ] {
        let want: Vec<Vec<usize>> = f["kept_at_half"][name]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| {
                u.as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as usize)
                    .collect()
            })
            .collect();
        assert_eq!(
            kvzip_kept(&floats(&f["scores"]), l, kvh, 0.5, budget),
            want,
            "{name}"
        );
    }
}

#[test]
fn uniform_keeps_the_same_count_per_head_and_sinks_survive() {
    let scores = kvzip_initial_scores(2, 3, 10);
    let kept = kvzip_kept(&scores, 2, 3, 0.5, KvzipBudget::Uniform);
    assert!(kept.iter().all(|k| k.len() == 5 && k[..4] == [0, 1, 2, 3]));
}

#[test]
fn later_passes_quote_the_previous_chunk() {
    let context: Vec<u32> = (100..130).collect();
    let chunks = kvzip_chunks(2, 30, 10);
    assert_eq!(chunks, vec![2..12, 12..22, 22..30]);
    let ids = kvzip_pass_ids(&context, &chunks, 1, &[1], &[7, 7], &[9]);
    let expected: Vec<u32> = [
        &[7u32, 7][..],
        &(104..112).collect::<Vec<_>>(),
        &[9],
        &(112..122).collect::<Vec<_>>(),
    ]
    .concat();
    assert_eq!(ids, expected);
    assert_eq!(
        kvzip_pass_ids(&context, &chunks, 0, &[1], &[7], &[9])[..2],
        [1, 9]
    );
}

/// The `kvzip` policy keeps the sinks and then the highest of the scores the engine's
/// passes handed it (ties to the earlier token), and scores decode blocks as the sinks.
#[test]
fn the_policy_keeps_sinks_then_the_highest_reconstruction_scores() {
    let spec: pk_kv::PolicySpec = "kvzip".parse().unwrap();
    assert_eq!(spec.reconstruction_chunk_tokens(), Some(2048));
    let chunked: pk_kv::PolicySpec = "kvzip:chunk=512".parse().unwrap();
    assert_eq!(chunked.to_string(), "kvzip:chunk=512");
    assert!("kvzip:chunk=0".parse::<pk_kv::PolicySpec>().is_err());
    let mut policy = spec.build();
    let n = 40;
    let kv = pk_kv::DenseKv::from_fn(1, 1, 2, n, |_, _, _, key, value| {
        key.copy_from_slice(&[1.0, 0.0]);
        value.copy_from_slice(&[1.0, 0.0]);
    });
    // Sinks score 0 here to show they are kept for being sinks; token t > 3 scores t % 10.
    let scores: Vec<f32> = (0..n)
        .map(|t| if t < 4 { 0.0 } else { (t % 10) as f32 })
        .collect();
    policy.set_prior_scores(scores);
    let keep = policy.select_prefill(&kv, None, 16, 4);
    // 4 sinks, then the 12 best of tokens 4..40: the four 9s, four 8s, four 7s.
    let mut want: Vec<u32> = (0..4).collect();
    want.extend((4..n as u32).filter(|t| t % 10 >= 7));
    want.sort_unstable();
    assert_eq!(keep, want);
}

/// A head's share of `kvzip:global`'s budget may be as small as its sinks: it selects once
/// and evicts no block afterwards. Below the sinks, and for the uniform budget below three
/// blocks, selection refuses the budget.
#[test]
fn a_global_share_may_hold_only_the_sinks() {
    let n = 40;
    let kv = pk_kv::DenseKv::from_fn(1, 1, 2, n, |_, _, _, key, value| {
        key.copy_from_slice(&[1.0, 0.0]);
        value.copy_from_slice(&[1.0, 0.0]);
    });
    let select = |spec: &str, budget_tokens: u32| {
        let mut policy = spec.parse::<pk_kv::PolicySpec>().unwrap().build();
        policy.set_prior_scores((0..n).map(|t| t as f32).collect());
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            policy.select_prefill(&kv, None, budget_tokens, 16)
        }))
    };
    assert_eq!(select("kvzip:global", 4).unwrap(), vec![0, 1, 2, 3]);
    assert_eq!(select("kvzip:global", 6).unwrap(), vec![0, 1, 2, 3, 38, 39]);
    assert!(select("kvzip:global", 3).is_err());
    assert!(select("kvzip", 6).is_err());
    assert_eq!(select("kvzip", 48).unwrap().len(), 40);
}
