//! Flags that a command accepts but cannot use, refused by name before the command runs.
//!
//! Several subcommands flatten the same argument groups (`ModelArgs` with its tiers,
//! `KvPolicyArgs`), so each accepts flags that some of its uses have no place for:
//! `perplexity` never stores prompt KV, `bench perf --device cuda` runs without the engine.
//! The project's rule is that nothing is accepted and ignored, so [`RULES`] lists every such
//! case and [`check`] refuses it with the flag, the command and the reason. The same rules
//! apply to the `--config` file's keys (a key stands for the flag it fills in).
//!
//! Refusals that depend on more than the command line (the model's layers, the tiers the
//! file and flags configure together, values such as `--temperature 0`) are made where the
//! command has that knowledge; `crates/cli/tests/flag_walk` runs every one of them.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

/// A condition on the leaf subcommand's arguments; a rule applies when all of its hold.
#[derive(Clone, Copy, Debug)]
pub enum When {
    /// Given on the command line or through its environment variable.
    Given(&'static str),
    /// Neither given on the command line nor through its environment variable.
    NotGiven(&'static str),
    /// The argument's value, given or default, is one of these (ASCII case ignored).
    Is(&'static str, &'static [&'static str]),
    /// The argument's value, given or default, is none of these (ASCII case ignored).
    IsNot(&'static str, &'static [&'static str]),
}

/// Arguments (clap ids, the field names) that `command` refuses when every `when` holds.
#[derive(Debug)]
pub struct Rule {
    /// The subcommand path, e.g. "bench perf".
    pub command: &'static str,
    pub args: &'static [&'static str],
    pub when: &'static [When],
    /// Words after the command in the message, e.g. "with --device cuda".
    pub context: &'static str,
    pub why: &'static str,
}

/// The tier and EVICPRESS flags of `ModelArgs`, for commands that store no prompt KV.
const TIER_ARGS: &[&str] = &[
    "tier_ram",
    "tier_disk",
    "tier_redis",
    "tier_chunk_tokens",
    "tier_window_checkpoint_tokens",
    "tier_policy",
    "evicpress_alpha",
    "evicpress_grid",
    "evicpress_per_byte",
    "evicpress_profile_metric",
    "evicpress_copies",
];

/// The settings of the EVICPRESS store, which exists only with `--tier-policy evicpress`.
const EVICPRESS_ARGS: &[&str] = &[
    "evicpress_alpha",
    "evicpress_grid",
    "evicpress_per_byte",
    "evicpress_profile_metric",
    "evicpress_copies",
];

const CUDA: When = When::Is("device", &["cuda"]);
const NOT_EVICPRESS: When = When::IsNot("tier_policy", &["evicpress"]);

pub const RULES: &[Rule] = &[
    Rule {
        command: "generate",
        args: &["tier_ram"],
        when: &[],
        context: "",
        why: "a RAM tier lasts as long as the process and generate serves one prompt; \
              --tier-disk or --tier-redis keep prompt KV for the next run",
    },
    Rule {
        command: "generate",
        args: &["evicpress_profile_metric"],
        when: &[],
        context: "",
        why: "the EVICPRESS store profiles contexts in a server's idle time, and generate \
              exits after one prompt",
    },
    Rule {
        command: "generate",
        args: &["evicpress_copies"],
        when: &[When::Is("evicpress_copies", &["placed-only"])],
        context: "",
        why: "a store with one copy per context adopts nothing after a restart, and \
              generate exits after one prompt: its context could never be used again",
    },
    Rule {
        command: "generate",
        args: EVICPRESS_ARGS,
        when: &[NOT_EVICPRESS],
        context: "without --tier-policy evicpress",
        why: "it configures the EVICPRESS store",
    },
    Rule {
        command: "generate",
        args: &["tier_window_checkpoint_tokens"],
        when: &[When::Is("tier_policy", &["evicpress"])],
        context: "with --tier-policy evicpress",
        why: "window checkpoints are how the chunk tiers store KV cache groups; the \
              EVICPRESS store keeps each context's tail window only (a context is stored \
              whole, so a hit is at its end)",
    },
    Rule {
        command: "serve",
        args: &["tier_window_checkpoint_tokens"],
        when: &[When::Is("tier_policy", &["evicpress"])],
        context: "with --tier-policy evicpress",
        why: "window checkpoints are how the chunk tiers store KV cache groups; the \
              EVICPRESS store keeps each context's tail window only (a context is stored \
              whole, so a hit is at its end)",
    },
    Rule {
        command: "serve",
        args: EVICPRESS_ARGS,
        when: &[NOT_EVICPRESS],
        context: "without --tier-policy evicpress",
        why: "it configures the EVICPRESS store",
    },
    Rule {
        command: "perplexity",
        args: TIER_ARGS,
        when: &[],
        context: "",
        why: "perplexity scores every chunk with a fresh KV cache and never stores or reuses \
              prompt KV",
    },
    Rule {
        command: "perplexity",
        args: &["threads", "kv_dtype", "disable_hybrid_kv_cache_manager"],
        when: &[CUDA],
        context: "with --device cuda",
        why: "the GPU path runs the model directly over an f16 KV pool with one block table, \
              without the engine or its CPU kernels",
    },
    Rule {
        command: "bench perf",
        args: TIER_ARGS,
        when: &[],
        context: "",
        why: "bench perf measures prefill and decode on random prompts that never reuse \
              stored KV",
    },
    Rule {
        command: "bench perf",
        args: &[
            "threads",
            "kv_dtype",
            "disable_hybrid_kv_cache_manager",
            "kv_policy",
            "kv_budget",
            "kv_granularity",
            "compare_threads",
            "compare_llamacpp",
            "llamacpp_python",
        ],
        when: &[CUDA],
        context: "with --device cuda",
        why: "the GPU bench runs the model directly over an f16 KV pool with one block table \
              and no eviction, without the engine, its CPU kernels or a CPU comparison",
    },
    Rule {
        command: "bench perf",
        args: &["dummy_type"],
        when: &[
            CUDA,
            When::Given("dummy_type"),
            When::IsNot("dummy_type", &["F16", "BF16"]),
        ],
        context: "with --device cuda",
        why: "the GPU makes random weights in bf16, or in f16 with --dummy-type F16; \
              quantised types do not apply",
    },
    Rule {
        command: "bench perf",
        args: &["dummy_type"],
        when: &[When::NotGiven("dummy")],
        context: "without --dummy",
        why: "it is the weight format of --dummy's random weights",
    },
    Rule {
        command: "bench perf",
        args: &["model"],
        when: &[When::Given("dummy")],
        context: "with --dummy",
        why: "--dummy runs random weights of a named shape instead of a model file",
    },
    Rule {
        command: "bench perf",
        args: &["llamacpp_python"],
        when: &[When::NotGiven("compare_llamacpp")],
        context: "without --compare-llamacpp",
        why: "it names the Python that runs llama.cpp's side of the comparison",
    },
    Rule {
        command: "bench tiers",
        args: &["tier_ram"],
        when: &[],
        context: "",
        why: "bench tiers always measures a RAM tier, sized to hold the context",
    },
    Rule {
        command: "bench tiers",
        args: &[
            "tier_policy",
            "evicpress_alpha",
            "evicpress_grid",
            "evicpress_per_byte",
            "evicpress_profile_metric",
            "evicpress_copies",
        ],
        when: &[],
        context: "",
        why: "bench tiers measures the chunk tiers one at a time (bench evicpress measures \
              EVICPRESS)",
    },
    Rule {
        command: "bench codecs",
        args: TIER_ARGS,
        when: &[],
        context: "",
        why: "bench codecs compresses a prefix's KV in memory and never stores or reuses \
              prompt KV in tiers",
    },
    Rule {
        command: "bench codecs",
        args: &["disable_hybrid_kv_cache_manager"],
        when: &[],
        context: "",
        why: "bench codecs always keeps one block table for every layer (a stored context is \
              loaded as prefix_kv, which writes every layer)",
    },
    Rule {
        command: "bench evicpress",
        args: TIER_ARGS,
        when: &[],
        context: "",
        why: "bench evicpress builds its own RAM → disk (→ Redis) tiers from --ram-fraction, \
              --disk-fraction and --redis, and profiles with --profile-metric",
    },
    Rule {
        command: "bench evicpress",
        args: &["disable_hybrid_kv_cache_manager"],
        when: &[],
        context: "",
        why: "its engines reuse KV through a context store, so they keep one block table for \
              every layer already",
    },
    Rule {
        command: "bench evicpress",
        args: &["disk_fraction"],
        when: &[When::NotGiven("redis")],
        context: "without --redis",
        why: "the disk tier is last and unlimited unless Redis follows it",
    },
    Rule {
        command: "bench evicpress",
        args: &["loaded_repeats"],
        when: &[When::Is("loaded", &["false"])],
        context: "with --loaded false",
        why: "it repeats the loaded runs",
    },
];

/// Whether `id` was given on the command line or through its environment variable.
fn given(m: &ArgMatches, id: &str) -> bool {
    matches!(
        m.value_source(id),
        Some(ValueSource::CommandLine | ValueSource::EnvVariable)
    )
}

/// The argument's values as text (given or default), for [`When::Is`].
fn values(m: &ArgMatches, id: &str) -> Vec<String> {
    m.get_raw(id)
        .map(|v| v.map(|s| s.to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

fn holds(w: &When, m: &ArgMatches) -> bool {
    let any_of = |id: &str, set: &[&str]| {
        values(m, id)
            .iter()
            .any(|v| set.iter().any(|s| s.eq_ignore_ascii_case(v)))
    };
    match *w {
        When::Given(id) => given(m, id),
        When::NotGiven(id) => !given(m, id),
        When::Is(id, set) => any_of(id, set),
        When::IsNot(id, set) => !any_of(id, set),
    }
}

/// The leaf subcommand: its path ("bench perf"), its definition and its matches.
fn leaf<'a>(root: &'a Command, m: &'a ArgMatches) -> (String, &'a Command, &'a ArgMatches) {
    let (mut path, mut cmd, mut m) = (Vec::new(), root, m);
    while let Some((name, sub)) = m.subcommand() {
        path.push(name);
        cmd = cmd.find_subcommand(name).expect("clap matched it");
        m = sub;
    }
    (path.join(" "), cmd, m)
}

/// How the message names an argument: `--tier-ram`, and the variable it came from if so.
fn describe(cmd: &Command, m: &ArgMatches, id: &str) -> String {
    let arg = cmd.get_arguments().find(|a| a.get_id() == id);
    let flag = arg
        .and_then(|a| a.get_long())
        .map_or_else(|| id.to_owned(), |l| format!("--{l}"));
    match (m.value_source(id), arg.and_then(|a| a.get_env())) {
        (Some(ValueSource::EnvVariable), Some(var)) => {
            format!("{flag} (set by {})", var.to_string_lossy())
        }
        _ => flag,
    }
}

/// The first rule of `command` that refuses `id`, all its conditions holding.
fn refusing<'r>(command: &str, id: &str, m: &ArgMatches) -> Option<&'r Rule> {
    RULES.iter().find(|r| {
        r.command == command && r.args.contains(&id) && r.when.iter().all(|w| holds(w, m))
    })
}

fn message(what: &str, command: &str, rule: &Rule) -> String {
    let context = if rule.context.is_empty() {
        String::new()
    } else {
        format!(" {}", rule.context)
    };
    format!("{what} is not used by `{command}`{context}: {}", rule.why)
}

/// Refuses every argument, and every `--config` file key, that [`RULES`] says the parsed
/// command cannot use.
pub fn check(root: &Command, matches: &ArgMatches) -> Result<()> {
    let (command, cmd, m) = leaf(root, matches);
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if given(m, id) {
            if let Some(rule) = refusing(&command, id, m) {
                bail!(message(&describe(cmd, m, id), &command, rule));
            }
        }
    }
    check_config_file(&command, cmd, m)
}

/// The `--config` file's keys stand for the flags they fill in: a key whose flag is not
/// given (the flag wins) is refused where that flag would be.
fn check_config_file(command: &str, cmd: &Command, m: &ArgMatches) -> Result<()> {
    let has_config = cmd.get_arguments().any(|a| a.get_id() == "config");
    if !has_config || !given(m, "config") {
        return Ok(());
    }
    let Some(path) = m.get_one::<PathBuf>("config") else {
        return Ok(());
    };
    let file = crate::config::FileConfig::load(path)?;
    for (key, id) in file.keys() {
        if given(m, id) {
            continue;
        }
        if let Some(rule) = refusing(command, id, m) {
            let flag = describe(cmd, m, id);
            let what = format!("`{key}` in the --config file {} ({flag})", path.display());
            bail!(message(&what, command, rule));
        }
    }
    Ok(())
}
