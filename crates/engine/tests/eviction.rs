//! Eviction policies running in the real engine on the real model: the KV a sequence holds
//! stays within budget + one block, the pool's invariants hold, and bad settings are refused.

mod common;

use pk_engine::{EngineConfig, GenerateParams};
use pk_kv::{KvGranularity, PolicySpec};

#[test]
fn stored_tokens_stay_within_budget_for_every_policy() {
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let prompt = &book[1000..1600];
    for name in [
        "paged-eviction",
        "paged-eviction:ratio:global",
        "paged-eviction:inv-k-norm",
        "streaming-llm",
        "knorm",
        "keydiff",
        "snapkv",
        "h2o",
        "tova",
        "expected-attention",
        "kvzip:chunk=256",
    ] {
        let spec: PolicySpec = name.parse().unwrap();
        let params = GenerateParams {
            max_tokens: 40,
            ignore_eos: true,
            kv_policy: Some(spec),
            kv_budget: Some(128),
            ..Default::default()
        };
        let out = engine.generate(prompt, &params, &mut |_| {}).unwrap();
        assert_eq!(out.token_ids.len(), 40, "{name}");
        assert!(
            out.kv_stored_tokens <= 128 + 16,
            "{name}: {} stored tokens",
            out.kv_stored_tokens
        );
        assert!(
            out.kv_stored_tokens >= 128,
            "{name}: {} stored tokens",
            out.kv_stored_tokens
        );
        engine.check_invariants();
        assert_eq!(
            engine.kv_manager().pool().num_free_blocks(),
            engine.kv_manager().pool().num_blocks()
        );
    }
    let stats = &engine.eviction_stats["paged-eviction"];
    assert!(stats.pruned_prompt_tokens >= 3 * (600 - 128), "{stats:?}");
    assert!(stats.evicted_blocks > 0, "{stats:?}");
}

/// Per-layer and per-head selection on the real model: every policy stays within budget,
/// prunes and evicts, and leaves the pool consistent.
#[test]
fn per_layer_and_per_head_selection_stay_within_budget() {
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let prompt = &book[1000..1600];
    for granularity in [KvGranularity::Layer, KvGranularity::Head] {
        for name in [
            "paged-eviction",
            "streaming-llm",
            "knorm",
            "keydiff",
            "snapkv",
            "h2o",
            "tova",
            "expected-attention",
            "kvzip:chunk=256",
        ] {
            let spec: PolicySpec = name.parse().unwrap();
            let params = GenerateParams {
                max_tokens: 40,
                ignore_eos: true,
                kv_policy: Some(spec),
                kv_budget: Some(128),
                kv_granularity: Some(granularity),
                ..Default::default()
            };
            let out = engine.generate(prompt, &params, &mut |_| {}).unwrap();
            assert_eq!(out.token_ids.len(), 40, "{name} {granularity}");
            assert!(
                (128..=128 + 16).contains(&out.kv_stored_tokens),
                "{name} {granularity}: {} stored tokens",
                out.kv_stored_tokens
            );
            engine.check_invariants();
            assert_eq!(
                engine.kv_manager().pool().num_free_blocks(),
                engine.kv_manager().pool().num_blocks()
            );
        }
    }
}

/// StreamingLLM chooses by position, so every layer and head chooses the same tokens: per
/// layer and per head, the moves go through the per-unit path yet must give exactly the
/// shared selection's greedy tokens, through prefill pruning and decode evictions.
#[test]
fn position_based_selection_is_the_same_at_every_granularity() {
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let prompt = &book[2000..2500];
    let run = |engine: &mut pk_engine::Engine, granularity| {
        let params = GenerateParams {
            max_tokens: 48,
            ignore_eos: true,
            kv_policy: Some("streaming-llm".parse().unwrap()),
            kv_budget: Some(96),
            kv_granularity: Some(granularity),
            ..Default::default()
        };
        engine
            .generate(prompt, &params, &mut |_| {})
            .unwrap()
            .token_ids
    };
    let shared = run(&mut engine, KvGranularity::Shared);
    for granularity in [KvGranularity::Layer, KvGranularity::Head] {
        assert_eq!(run(&mut engine, granularity), shared, "{granularity}");
    }
    assert!(
        engine.eviction_stats["streaming-llm"].evicted_blocks >= 3 * 2,
        "{:?}",
        engine.eviction_stats
    );
}

/// kvpress's protocol (`kv_keep_generated`): the prompt is pruned to the budget at prefill
/// and every generated token is kept, so the sequence ends with the budget plus the 47
/// generated tokens that were fed back (the last one is sampled, never computed).
#[test]
fn keep_generated_prunes_the_prompt_only() {
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let prompt = &book[1000..1600];
    for name in ["snapkv", "streaming-llm", "paged-eviction"] {
        let spec: PolicySpec = name.parse().unwrap();
        let params = GenerateParams {
            max_tokens: 48,
            ignore_eos: true,
            kv_policy: Some(spec),
            kv_budget: Some(128),
            kv_keep_generated: true,
            ..Default::default()
        };
        let out = engine.generate(prompt, &params, &mut |_| {}).unwrap();
        assert!(
            (128 + 47..=128 + 47 + 16).contains(&out.kv_stored_tokens),
            "{name}: {} stored tokens",
            out.kv_stored_tokens
        );
        engine.check_invariants();
    }
}

/// SnapKV selects with the queries of the prompt's last 64 tokens: after a full-cache run
/// of the same prompt, its prefix-cache hit stops at least 64 tokens before the prompt's
/// end, and it generates what it generates from a cold cache.
#[test]
fn a_window_policy_reuses_the_prefix_cache_up_to_its_window() {
    let book = common::book_ids();
    let prompt = &book[3000..3600];
    let params = GenerateParams {
        max_tokens: 24,
        ignore_eos: true,
        kv_policy: Some("snapkv".parse().unwrap()),
        kv_budget: Some(128),
        kv_granularity: Some(KvGranularity::Head),
        ..Default::default()
    };
    let cold = common::engine(EngineConfig::default())
        .generate(prompt, &params, &mut |_| {})
        .unwrap();
    assert_eq!(cold.cached_prompt_tokens, 0);
    let mut engine = common::engine(EngineConfig::default());
    let full = GenerateParams {
        max_tokens: 1,
        ..Default::default()
    };
    engine.generate(prompt, &full, &mut |_| {}).unwrap();
    let warm = engine.generate(prompt, &params, &mut |_| {}).unwrap();
    assert!(
        (prompt.len() - 64 - 16..=prompt.len() - 64).contains(&warm.cached_prompt_tokens),
        "{} of {} prompt tokens cached",
        warm.cached_prompt_tokens,
        prompt.len()
    );
    assert_eq!(warm.token_ids, cold.token_ids);
    engine.check_invariants();
}

/// A request that names no granularity runs at its policy's own: PagedEviction per KV
/// head, so it generates what an explicit `head` generates.
#[test]
fn paged_eviction_selects_per_head_unless_told_otherwise() {
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let prompt = &book[4000..4500];
    let run = |engine: &mut pk_engine::Engine, granularity| {
        let params = GenerateParams {
            max_tokens: 32,
            ignore_eos: true,
            kv_budget: Some(96),
            kv_granularity: granularity,
            ..Default::default()
        };
        let out = engine.generate(prompt, &params, &mut |_| {}).unwrap();
        (
            out.token_ids,
            engine.eviction_stats["paged-eviction"].kv_slot_copies,
        )
    };
    let (own, own_copies) = run(&mut engine, None);
    let (head, head_copies) = run(&mut engine, Some(KvGranularity::Head));
    assert_eq!(own, head);
    // Per-head units compact their own slots; the counters are cumulative.
    assert!(
        own_copies > 0 && head_copies == 2 * own_copies,
        "{own_copies} {head_copies}"
    );
    engine.check_invariants();
}

#[test]
fn budget_at_least_context_changes_nothing() {
    // With a budget above prompt + output, PagedEviction never prunes or evicts, so the
    // greedy tokens equal the full cache's exactly.
    let mut engine = common::engine(EngineConfig::default());
    let prompt = engine.tokenizer.encode(
        "The planets of the solar system, in order from the Sun, are",
        false,
    );
    let full = engine
        .generate(
            &prompt,
            &GenerateParams {
                max_tokens: 20,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap();
    let params = GenerateParams {
        max_tokens: 20,
        kv_policy: Some(PolicySpec::default()),
        kv_budget: Some(256),
        ..Default::default()
    };
    let pe = engine.generate(&prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(full.token_ids, pe.token_ids);
}

#[test]
fn invalid_policy_settings_are_refused() {
    let mut engine = common::engine(EngineConfig::default());
    let prompt = vec![1000, 1001, 1002];
    let too_small = GenerateParams {
        kv_policy: Some(PolicySpec::default()),
        kv_budget: Some(32),
        ..Default::default()
    };
    let e = engine
        .generate(&prompt, &too_small, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("budget"), "{e}");
    let no_budget = GenerateParams {
        kv_policy: Some("knorm".parse().unwrap()),
        ..Default::default()
    };
    let e = engine
        .generate(&prompt, &no_budget, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs a kv_budget"), "{e}");
    assert!("nonsense"
        .parse::<PolicySpec>()
        .unwrap_err()
        .to_string()
        .contains("paged-eviction"));
}

#[test]
fn teacher_forcing_full_cache_matches_scoring() {
    // Teacher-forced logits through the scheduler equal a single scoring pass over the
    // same tokens (same per-token arithmetic), which the evaluation harness relies on.
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let (prompt, cont) = (&book[0..200], &book[200..216]);
    let forced = engine
        .teacher_force(prompt, cont, &GenerateParams::default())
        .unwrap();
    assert_eq!(forced.len(), cont.len());
    let all: Vec<u32> = book[0..216].to_vec();
    let vocab = engine.model_config().vocab_size;
    let scored = engine.score(&all, 199).unwrap();
    for (i, row) in forced.iter().enumerate() {
        assert!(
            row[..] == scored[i * vocab..(i + 1) * vocab],
            "step {i}: teacher-forced logits differ from scoring"
        );
    }
    // Under a tight budget the distributions differ but stay finite.
    let params = GenerateParams {
        kv_policy: Some(PolicySpec::default()),
        kv_budget: Some(64),
        ..Default::default()
    };
    let pruned = engine.teacher_force(prompt, cont, &params).unwrap();
    assert_eq!(pruned.len(), cont.len());
    assert!(pruned.iter().flatten().all(|v| v.is_finite()));
    // Prefill attention is exact over the full prompt (pruning only changes what is stored),
    // so the first distribution is identical; later ones see the pruned cache.
    assert!(
        pruned[0] == forced[0],
        "the first step must use exact attention over the whole prompt"
    );
    assert!(
        pruned[1] != forced[1],
        "after pruning to 64 tokens the next step must differ"
    );
}

/// A forced end-of-generation token is read like any other forced token (eval's
/// query-agnostic mode forces a chat turn's end before the answer): the sequence goes on
/// and samples after the forced tokens, where a sampled end would stop it.
#[test]
fn a_forced_end_of_turn_does_not_end_the_sequence() {
    let mut engine = common::engine(EngineConfig::default());
    let prompt = engine.tokenizer.encode("The capital of France is", false);
    let eos = engine.tokenizer.eos_id();
    let forced = vec![eos, engine.tokenizer.encode(" Paris", false)[0]];
    let params = GenerateParams {
        max_tokens: 6,
        forced_tokens: forced.clone(),
        ..Default::default()
    };
    let out = engine.generate(&prompt, &params, &mut |_| {}).unwrap();
    assert!(out.token_ids.len() > forced.len(), "{:?}", out.token_ids);
    assert_eq!(out.token_ids[..2], forced[..]);
}

/// KVzip's global budget on the real model: one threshold over every KV head's scores,
/// so heads keep unequal counts, right-aligned in one table whose length is the largest
/// count; generation runs on, the pool stays consistent, and the layout is refused where
/// it cannot hold (not per KV head).
#[test]
fn kvzip_global_keeps_unequal_counts_per_head() {
    let mut engine = common::engine(EngineConfig::default());
    let book = common::book_ids();
    let prompt = &book[1000..1600];
    let params = GenerateParams {
        max_tokens: 40,
        ignore_eos: true,
        kv_policy: Some("kvzip:chunk=256:global".parse().unwrap()),
        kv_budget: Some(128),
        kv_granularity: Some(KvGranularity::Head),
        record_prefill_keeps: true,
        ..Default::default()
    };
    let out = engine.generate(prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(out.token_ids.len(), 40);
    // One kept list per (layer, KV head), of unequal lengths averaging exactly the budget
    // (the three-block floor per head is taken from it), each sorted prompt positions
    // with the 4 sinks.
    let keeps = out.prefill_keeps.as_ref().expect("recorded");
    assert_eq!(keeps.len(), 30 * 3);
    let lens: Vec<usize> = keeps.iter().map(|k| k.kept.len()).collect();
    assert!(lens.iter().any(|&n| n != lens[0]), "{lens:?}");
    assert!(lens.iter().all(|&n| n >= 48), "{lens:?}");
    assert_eq!(lens.iter().sum::<usize>(), 128 * lens.len(), "{lens:?}");
    for k in keeps {
        assert!(k.kept.windows(2).all(|w| w[0] < w[1]) && k.kept[..4] == [0, 1, 2, 3]);
        assert!(k.layers.len() == 1 && k.kv_head.is_some() && k.kept[k.kept.len() - 1] < 600);
    }
    // The table holds the largest head's count (at least the mean, 128) plus the 39
    // generated tokens fed back, which a ragged layout keeps.
    assert!(
        (128 + 39..=600 + 39).contains(&out.kv_stored_tokens),
        "{} stored tokens",
        out.kv_stored_tokens
    );
    let stats = &engine.eviction_stats["kvzip"];
    // The mean count kept is the budget.
    assert_eq!(stats.pruned_prompt_tokens, 600 - 128, "{stats:?}");
    engine.check_invariants();
    assert_eq!(
        engine.kv_manager().pool().num_free_blocks(),
        engine.kv_manager().pool().num_blocks()
    );
    // The same context again: its scores come from the engine's cache (no pass runs) and
    // select the same sets; the uniform budget reuses them too.
    let passes = engine.eviction_stats["kvzip"].reconstruction_forward_seconds;
    assert!(passes > 0.0);
    let again = engine.generate(prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(again.prefill_keeps, out.prefill_keeps);
    let uniform = GenerateParams {
        kv_policy: Some("kvzip:chunk=256".parse().unwrap()),
        ..params.clone()
    };
    engine.generate(prompt, &uniform, &mut |_| {}).unwrap();
    // kvpress's threshold (`floor=4`): a head may keep as few as its sinks, since a share
    // selected once at prefill needs no evictable block; the mean is then the budget
    // raised at most by the sinks.
    let kvpress = GenerateParams {
        kv_policy: Some("kvzip:chunk=256:global:floor=4".parse().unwrap()),
        ..params.clone()
    };
    let lens: Vec<usize> = engine
        .generate(prompt, &kvpress, &mut |_| {})
        .unwrap()
        .prefill_keeps
        .expect("recorded")
        .iter()
        .map(|k| k.kept.len())
        .collect();
    assert!(
        lens.iter().any(|&n| n < 48) && lens.iter().all(|&n| n >= 4),
        "{lens:?}"
    );
    let mean = lens.iter().sum::<usize>() / lens.len();
    assert!((128..=128 + 4).contains(&mean), "{mean}");
    assert_eq!(
        engine.eviction_stats["kvzip"].reconstruction_forward_seconds,
        passes
    );
    let shared = GenerateParams {
        kv_granularity: Some(KvGranularity::Shared),
        record_prefill_keeps: false,
        ..params
    };
    let err = engine.generate(prompt, &shared, &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("kv_granularity head"), "{err}");
}
