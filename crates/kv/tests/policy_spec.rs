//! Policy names: parsing, canonical printing, round trips, and the errors users see for
//! unknown names, bad options and budgets below three blocks.

use pk_kv::{validate_budget, PagedScore, PolicyError, PolicySpec};

fn parse(name: &str) -> Result<PolicySpec, String> {
    name.parse::<PolicySpec>()
        .map_err(|error| error.to_string())
}

#[test]
fn canonical_names_round_trip() {
    for name in [
        "full",
        "streaming-llm",
        "streaming-llm:n-sink=4",
        "knorm",
        "keydiff",
        "snapkv",
        "snapkv:window=32",
        "snapkv:kernel=7",
        "snapkv:window=16:kernel=3",
        "snapkv:pool=avg",
        "snapkv:window=16:kernel=3:pool=avg",
        "h2o",
        "tova",
        "expected-attention",
        "expected-attention:window=128:n-sink=0",
        "paged-eviction",
        "paged-eviction:ratio",
        "paged-eviction:inv-k-norm",
        "paged-eviction:global",
        "paged-eviction:ratio:global",
        "paged-eviction:local=5",
        "paged-eviction:inv-k-norm:local=2",
        "kvzip",
        "kvzip:chunk=512:global",
        "kvzip:global:floor=4",
        "kvzip:global:prefix=kept",
        "kvzip:prefix=kvpress",
    ] {
        let spec = parse(name).unwrap();
        assert_eq!(spec.to_string(), name, "display of {name}");
        assert_eq!(parse(&spec.to_string()).unwrap(), spec);
    }
}

#[test]
fn every_default_spec_round_trips_and_builds() {
    let specs = PolicySpec::all_defaults();
    assert_eq!(specs.len(), 13);
    for spec in specs {
        assert_eq!(parse(&spec.to_string()).unwrap(), spec, "{spec}");
        assert_eq!(spec.build().spec(), spec, "{spec} builds itself");
    }
}

#[test]
fn defaults_and_aliases() {
    // Since issue 38 the default is the authors' configuration: ‖v‖ with the victim among
    // the oldest 3 blocks.
    assert_eq!(PolicySpec::default().to_string(), "paged-eviction");
    assert_eq!(
        PolicySpec::default(),
        PolicySpec::PagedEviction {
            score: PagedScore::VNorm,
            local_topk: Some(3)
        }
    );
    // A request that names no granularity runs at the policy's own.
    assert_eq!(
        PolicySpec::default().default_granularity(),
        pk_kv::KvGranularity::Head
    );
    assert_eq!(
        parse("kvzip:global").unwrap().default_granularity(),
        pk_kv::KvGranularity::Head
    );
    for name in ["snapkv", "streaming-llm", "kvzip", "tova"] {
        assert_eq!(
            parse(name).unwrap().default_granularity(),
            pk_kv::KvGranularity::Shared,
            "{name}"
        );
    }
    // The default before issue 38 stays reachable by name.
    assert_eq!(
        parse("paged-eviction:ratio:global").unwrap(),
        PolicySpec::PagedEviction {
            score: PagedScore::VOverK,
            local_topk: None
        }
    );
    // Explicit defaults print in the short form.
    assert_eq!(
        parse("paged-eviction:v-norm:local=3").unwrap().to_string(),
        "paged-eviction"
    );
    assert_eq!(
        parse("paged-eviction:v-norm:global").unwrap().to_string(),
        "paged-eviction:global"
    );
    assert_eq!(
        parse("snapkv:window=64:kernel=5").unwrap().to_string(),
        "snapkv"
    );
    assert_eq!(
        parse("paged-eviction:ratio:local").unwrap().to_string(),
        "paged-eviction:ratio"
    );
    assert_eq!(parse(" tova ").unwrap(), PolicySpec::Tova);
    assert_eq!(
        parse("paged-eviction:local=2:inv-k-norm").unwrap(),
        PolicySpec::PagedEviction {
            score: PagedScore::InvKNorm,
            local_topk: Some(2)
        }
    );
}

#[test]
fn unknown_policy_lists_the_valid_names() {
    for name in ["lru", "", "PagedEviction", "paged_eviction", "snap-kv"] {
        let message = parse(name).unwrap_err();
        assert!(
            message.starts_with(&format!("unknown KV eviction policy `{name}`")),
            "{message}"
        );
        for valid in [
            "full",
            "streaming-llm",
            "knorm",
            "keydiff",
            "snapkv",
            "h2o",
            "tova",
            "expected-attention",
            "paged-eviction",
            "v-norm",
            "inv-k-norm",
        ] {
            assert!(message.contains(valid), "{message} lacks {valid}");
        }
    }
}

#[test]
fn bad_options_name_the_valid_ones() {
    let cases = [
        ("snapkv:window=0", "window=N"),
        ("snapkv:kernel=4", "kernel=N (odd"),
        ("snapkv:size=3", "window=N"),
        ("snapkv:pool=median", "pool=max|avg"),
        ("streaming-llm:n-sink=x", "n-sink=N"),
        ("paged-eviction:l2", "ratio, inv-k-norm"),
        ("paged-eviction:v-norm=1", "ratio, inv-k-norm"),
        ("paged-eviction:local=0", "local=N"),
        ("paged-eviction:v-norm:inv-k-norm", "at most once"),
        ("paged-eviction:local=2:global", "at most once"),
        ("paged-eviction:global=1", "global"),
        ("h2o:window=3", "takes no options"),
        ("full:", "takes no options"),
    ];
    for (name, hint) in cases {
        let message = parse(name).unwrap_err();
        assert!(message.starts_with("invalid option `"), "{name}: {message}");
        assert!(message.contains(hint), "{name}: `{message}` lacks `{hint}`");
    }
    assert_eq!(
        "snapkv:kernel=4".parse::<PolicySpec>(),
        Err(PolicyError::InvalidOption {
            policy: "snapkv",
            option: "kernel=4".to_string(),
            valid: "window=N (N >= 1), kernel=N (odd, N >= 1), pool=max|avg",
        })
    );
}

#[test]
fn budget_below_three_blocks_is_an_error() {
    assert_eq!(validate_budget(48, 16), Ok(()));
    let error = validate_budget(47, 16).unwrap_err();
    assert_eq!(
        error,
        PolicyError::BudgetTooSmall {
            budget_tokens: 47,
            block_size_tokens: 16
        }
    );
    let message = error.to_string();
    assert!(message.contains("at least 48 tokens"), "{message}");
    assert!(message.contains("3 blocks of 16"), "{message}");
    assert_eq!(validate_budget(10, 0), Err(PolicyError::ZeroBlockSize));
    // A budget large enough for any block size passes without overflow.
    assert_eq!(validate_budget(u32::MAX, u32::MAX / 3), Ok(()));
    assert!(validate_budget(u32::MAX, u32::MAX).is_err());
}

#[test]
fn spec_validation_checks_budget_and_sinks() {
    let paged = PolicySpec::default();
    assert!(paged.validate(47, 16).is_err());
    assert!(paged.validate(48, 16).is_ok());
    // `full` ignores the budget.
    assert!(PolicySpec::Full.validate(0, 16).is_ok());
    assert!(PolicySpec::Full.validate(0, 0).is_err());
    let streaming = parse("streaming-llm:n-sink=20").unwrap();
    let message = streaming.validate(64, 16).unwrap_err().to_string();
    assert!(
        message.contains("n-sink=20") && message.contains("block size"),
        "{message}"
    );
    assert!(streaming.validate(96, 32).is_ok());
}

#[test]
#[should_panic(expected = "paged-eviction: KV budget of 40 tokens is too small")]
fn select_prefill_rejects_a_small_budget() {
    let kv = pk_kv::DenseKv::from_fn(1, 1, 1, 60, |_, _, _, k, v| {
        k[0] = 1.0;
        v[0] = 1.0;
    });
    PolicySpec::default()
        .build()
        .select_prefill(&kv, None, 40, 16);
}

#[test]
#[should_panic(expected = "snapkv: this policy scores tokens by attention and needs queries")]
fn attention_policies_require_queries() {
    let kv = pk_kv::DenseKv::from_fn(1, 1, 1, 60, |_, _, _, k, v| {
        k[0] = 1.0;
        v[0] = 1.0;
    });
    "snapkv"
        .parse::<PolicySpec>()
        .unwrap()
        .build()
        .select_prefill(&kv, None, 48, 16);
}

#[test]
fn query_needs_are_declared() {
    use pk_kv::QueryNeed;
    let need = |name: &str| {
        let policy = parse(name).unwrap().build();
        (policy.prefill_queries(), policy.decode_queries())
    };
    assert_eq!(need("paged-eviction"), (QueryNeed::None, QueryNeed::None));
    assert_eq!(need("knorm"), (QueryNeed::None, QueryNeed::None));
    assert_eq!(need("snapkv"), (QueryNeed::Last(64), QueryNeed::Last(64)));
    assert_eq!(need("tova"), (QueryNeed::Last(1), QueryNeed::Last(1)));
    assert_eq!(need("h2o"), (QueryNeed::All, QueryNeed::All));
    assert_eq!(QueryNeed::Last(64).count(10), 10);
    assert_eq!(QueryNeed::All.count(10), 10);
    assert_eq!(QueryNeed::None.count(10), 0);
}

/// `kvzip:global`'s per-head floor: three blocks by default, `floor=N` down to the 4
/// sinks (kvpress's threshold), and only with `global`.
#[test]
fn kvzip_floor_is_global_only_and_keeps_the_sinks() {
    assert_eq!(parse("kvzip:global").unwrap().ragged_floor_tokens(16), 48);
    assert_eq!(
        parse("kvzip:floor=4:global")
            .unwrap()
            .ragged_floor_tokens(16),
        4
    );
    assert_eq!(
        parse("kvzip:global:floor=100")
            .unwrap()
            .ragged_floor_tokens(16),
        100
    );
    assert_eq!(parse("kvzip").unwrap().ragged_floor_tokens(16), 0);
    let uniform = parse("kvzip:floor=4").unwrap_err();
    assert!(
        uniform.contains("floor=4") && uniform.contains("global"),
        "{uniform}"
    );
    let below = parse("kvzip:global:floor=3").unwrap_err();
    assert!(below.contains("floor=N (N >= 4"), "{below}");
}

/// `kvzip`'s `prefix=` names the treatment of a chat template's prefix; the default
/// (`context`) is not written, and an unknown one is refused with the valid names.
#[test]
fn kvzip_prefix_option_parses_and_refuses_unknown_names() {
    use pk_kv::{KvzipPass, KvzipPrefix};
    let pass = |name: &str| parse(name).unwrap().reconstruction_pass();
    let with = |prefix| {
        Some(KvzipPass {
            chunk_tokens: 2048,
            prefix,
        })
    };
    assert_eq!(pass("kvzip"), with(KvzipPrefix::Context));
    assert_eq!(pass("kvzip:prefix=context"), with(KvzipPrefix::Context));
    assert_eq!(parse("kvzip:prefix=context").unwrap().to_string(), "kvzip");
    assert_eq!(pass("kvzip:global:prefix=kept"), with(KvzipPrefix::Kept));
    assert_eq!(pass("kvzip:prefix=kvpress"), with(KvzipPrefix::Kvpress));
    assert_eq!(pass("snapkv"), None);
    let unknown = parse("kvzip:prefix=system").unwrap_err();
    assert!(
        unknown.contains("prefix=system") && unknown.contains("prefix=context|kept|kvpress"),
        "{unknown}"
    );
    let twice = parse("kvzip:prefix=kept:prefix=kvpress").unwrap_err();
    assert!(twice.contains("at most once"), "{twice}");
}
