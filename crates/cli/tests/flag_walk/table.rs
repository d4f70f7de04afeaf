//! How every flag of every subcommand is honoured or refused: the table that the flag walk
//! checks (issue 34: "every flag that a command accepts changes what that command does, or
//! the command refuses it by name").
//!
//! A unit test inside the binary (`crates/cli/src/flag_walk.rs`) walks clap's command tree
//! and fails for a flag that has no entry here, so a new flag must be classified; it also
//! checks that every entry's arguments parse and that every rule of `flag_rules::RULES` has
//! a refusal here. `crates/cli/tests/flag_walk.rs` runs every entry that can run.
//!
//! Placeholders in arguments, filled in by the runner: `{text}` a text file (the bundled
//! book), `{readme}` another (the README), `{dir}` a fresh directory (one per entry for `Reuse`, one per run otherwise), and
//! `{cfg_model}`, `{cfg_threads0}`, `{cfg_ram}`, `{cfg_chunk}` config files that set
//! `model = "gemma3-270m"`, `threads = 0`, `[tiers] ram` and `[tiers] chunk_tokens`.

/// How one flag of one command is honoured or refused.
#[derive(Debug)]
pub enum How {
    /// Parsed by clap itself (`--help`, `--version`).
    Clap,
    /// Both runs succeed and their stdout differs.
    Output {
        base: &'static [&'static str],
        with: &'static [&'static str],
    },
    /// Both runs succeed, print JSON, and the values at `pointer` differ.
    Json {
        base: &'static [&'static str],
        with: &'static [&'static str],
        pointer: &'static str,
    },
    /// Two runs of `args` in a row: the first computes its whole prompt, the second reuses
    /// some of it (the timing line's "(N cached)"); two runs of `without` (when not empty)
    /// reuse none of it.
    Reuse {
        args: &'static [&'static str],
        without: &'static [&'static str],
    },
    /// The command refuses the flag in this use: it fails, and its error names the flag.
    Refused { args: &'static [&'static str] },
    /// As `Refused`, with the flag given through its environment variable.
    RefusedEnv {
        var: &'static str,
        value: &'static str,
        args: &'static [&'static str],
    },
    /// The command reads the flag: a value it cannot use fails with an error containing
    /// `error`. For flags whose effect costs minutes to show, or shows only in timings.
    Read {
        args: &'static [&'static str],
        error: &'static str,
    },
    /// Honoured, and checked by the test `name` in `file` (relative to the crate).
    Test {
        file: &'static str,
        name: &'static str,
    },
    /// Honoured through the same code as `command`'s entry for this flag, which runs.
    SameAs { command: &'static str },
    /// Honoured as the code reads, without an automated check here: the reason why not.
    Unchecked { why: &'static str },
}

#[derive(Debug)]
pub struct Entry {
    /// The subcommand path ("bench perf"); "" for `pagekeeper` itself.
    pub command: &'static str,
    /// The long flag (`--kv-budget`).
    pub flag: &'static str,
    pub how: How,
}

const fn e(command: &'static str, flag: &'static str, how: How) -> Entry {
    Entry { command, flag, how }
}

use How::*;

const CLAP: How = Clap;

/// A prompt for a handful of greedy tokens.
const PROMPT: &str = "The capital of France is";

/// About 100 tokens: more than a 48-token KV budget and a 64-token chunk, less than the
/// default 256-token chunk.
const LONG: &str = "The old lighthouse keeper climbed the spiral stairs every evening at \
dusk, carrying a brass lantern and a notebook in which he recorded the weather, the passing \
ships and the behaviour of the seabirds that nested on the rocks below. Over forty years he \
had filled more than two hundred notebooks, and the villagers said that he knew the sea \
better than any sailor alive. One stormy night in November, a small fishing boat appeared on \
the horizon, its mast broken and its sails torn, drifting towards the reef. The keeper";

const GEN: &[&str] = &["generate", "--prompt", PROMPT, "--max-tokens", "6"];
const GEN_LONG: &[&str] = &["generate", "--prompt", LONG, "--max-tokens", "8"];
/// Sampling at temperature 1 with a fixed seed: reproducible, and unlike greedy.
const GEN_T1: &[&str] = &[
    "generate",
    "--prompt",
    PROMPT,
    "--max-tokens",
    "12",
    "--temperature",
    "1",
    "--seed",
    "1",
];
const GEN_DISK: &[&str] = &[
    "generate",
    "--prompt",
    LONG,
    "--max-tokens",
    "2",
    "--tier-disk",
    "{dir}/kv:1GiB",
    "--tier-chunk-tokens",
    "64",
];
const PPL: &[&str] = &[
    "perplexity",
    "--file",
    "{text}",
    "--ctx",
    "128",
    "--chunks",
    "2",
];
const PERF: &[&str] = &[
    "bench",
    "perf",
    "--json",
    "--contexts",
    "64",
    "--decode-tokens",
    "2",
];
const PERF_GEMMA: &[&str] = &[
    "bench",
    "perf",
    "--json",
    "--contexts",
    "64",
    "--decode-tokens",
    "2",
    "--model",
    "gemma3-270m",
];
const PERF_DUMMY: &[&str] = &[
    "bench",
    "perf",
    "--json",
    "--contexts",
    "32",
    "--decode-tokens",
    "2",
    "--dummy",
    "smollm2-135m",
];
const EVAL: &[&str] = &[
    "eval",
    "--tasks",
    "passkey",
    "--lengths",
    "128",
    "--samples",
    "1",
    "--policies",
    "knorm",
    "--budgets",
    "50%",
    "--no-progress",
    "--json",
    "--out",
    "{dir}",
];
/// text-kl with a short continuation: the run is mostly its forced tokens.
const EVAL_KL: &[&str] = &[
    "eval",
    "--continuation-tokens",
    "8",
    "--tasks",
    "text-kl",
    "--lengths",
    "128",
    "--samples",
    "1",
    "--policies",
    "knorm",
    "--budgets",
    "50%",
    "--no-progress",
    "--json",
    "--out",
    "{dir}",
];
const CODECS: &[&str] = &[
    "bench",
    "codecs",
    "--prefix-tokens",
    "64",
    "--continuation-tokens",
    "2",
    "--samples",
    "1",
    "--ratios",
    "0.5",
    "--json",
];
const TIERS: &[&str] = &[
    "bench",
    "tiers",
    "--context-tokens",
    "128",
    "--tier-chunk-tokens",
    "128",
    "--runs",
    "1",
    "--json",
];

const SERVE_PLAN: How = Test {
    file: "src/serve.rs",
    name: "every_serve_flag_changes_the_plan",
};
const BENCH_SERVE_WIRING: How = Test {
    file: "src/bench_serve.rs",
    name: "every_server_and_request_flag_reaches_the_server_or_the_body",
};
const BENCH_SERVE_E2E: How = Test {
    file: "tests/bench_serve_e2e.rs",
    name: "bench_serve_reports_the_pool_per_level",
};
const REPLICAS_E2E: How = Test {
    file: "tests/tiers_e2e.rs",
    name: "bench_serve_replicas_reports_hits_on_the_other_replica",
};
const BENCH_TIERS_E2E: How = Test {
    file: "tests/tiers_e2e.rs",
    name: "bench_tiers_json_reports_every_tier",
};
const EVICPRESS_MINUTES: How = Unchecked {
    why: "shows only in results that take bench evicpress minutes to produce",
};

pub const TABLE: &[Entry] = &[
    e("", "--help", CLAP),
    e("", "--version", CLAP),
    e("bench", "--help", CLAP),
    // fetch-model
    e("fetch-model", "--help", CLAP),
    e(
        "fetch-model",
        "--name",
        Read {
            args: &["fetch-model", "--name", "no-such-model"],
            error: "unknown model \"no-such-model\"",
        },
    ),
    // info
    e("info", "--help", CLAP),
    e(
        "info",
        "--model",
        Output {
            base: &["info"],
            with: &["info", "--model", "gemma3-270m"],
        },
    ),
    e(
        "info",
        "--dummy",
        Output {
            base: &["info"],
            with: &["info", "--dummy", "llama-3.2-1b"],
        },
    ),
    e(
        "info",
        "--json",
        Output {
            base: &["info"],
            with: &["info", "--json"],
        },
    ),
    // generate
    e("generate", "--help", CLAP),
    e(
        "generate",
        "--model",
        Output {
            base: GEN,
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "6",
                "--model",
                "gemma3-270m",
            ],
        },
    ),
    e(
        "generate",
        "--threads",
        Read {
            args: &["generate", "--prompt", PROMPT, "--threads", "0"],
            error: "--threads",
        },
    ),
    e(
        "generate",
        "--threads",
        SameAs {
            command: "bench perf",
        },
    ),
    e(
        "generate",
        "--block-size",
        Read {
            args: &["generate", "--prompt", PROMPT, "--block-size", "0"],
            error: "block size",
        },
    ),
    e(
        "generate",
        "--block-size",
        SameAs {
            command: "bench perf",
        },
    ),
    e(
        "generate",
        "--kv-dtype",
        Output {
            base: GEN_LONG,
            with: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "8",
                "--kv-dtype",
                "q4",
            ],
        },
    ),
    e(
        "generate",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--disable-hybrid-kv-cache-manager",
            ],
        },
    ),
    e(
        "generate",
        "--disable-hybrid-kv-cache-manager",
        SameAs {
            command: "bench perf",
        },
    ),
    e(
        "generate",
        "--tier-ram",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--tier-ram", "64MiB"],
        },
    ),
    e(
        "generate",
        "--tier-ram",
        RefusedEnv {
            var: "PAGEKEEPER_TIER_RAM",
            value: "64MiB",
            args: &["generate", "--prompt", PROMPT],
        },
    ),
    e(
        "generate",
        "--tier-ram",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--config", "{cfg_ram}"],
        },
    ),
    e(
        "generate",
        "--tier-disk",
        Reuse {
            args: GEN_DISK,
            without: &[],
        },
    ),
    e("generate", "--tier-redis", SameAs { command: "serve" }),
    e(
        "generate",
        "--tier-chunk-tokens",
        Reuse {
            args: GEN_DISK,
            without: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "2",
                "--tier-disk",
                "{dir}/kv:1GiB",
            ],
        },
    ),
    e(
        "generate",
        "--tier-chunk-tokens",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--tier-chunk-tokens", "64"],
        },
    ),
    e(
        "generate",
        "--tier-chunk-tokens",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--config", "{cfg_chunk}"],
        },
    ),
    e(
        "generate",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e(
        "generate",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--tier-disk",
                "{dir}/kv:1GiB",
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e(
        "generate",
        "--tier-window-checkpoint-tokens",
        SameAs { command: "serve" },
    ),
    e(
        "generate",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--tier-disk",
                "{dir}/kv:1GiB",
                "--tier-policy",
                "evicpress",
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e(
        "generate",
        "--tier-policy",
        Reuse {
            args: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "2",
                "--tier-disk",
                "{dir}/kv:1GiB",
                "--tier-chunk-tokens",
                "64",
                "--tier-policy",
                "evicpress",
            ],
            without: &[],
        },
    ),
    e("generate", "--evicpress-alpha", SameAs { command: "serve" }),
    e(
        "generate",
        "--evicpress-alpha",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--evicpress-alpha", "2"],
        },
    ),
    e("generate", "--evicpress-grid", SameAs { command: "serve" }),
    e(
        "generate",
        "--evicpress-grid",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--evicpress-grid", "q8"],
        },
    ),
    e(
        "generate",
        "--evicpress-copies",
        SameAs { command: "serve" },
    ),
    e(
        "generate",
        "--evicpress-copies",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--tier-policy",
                "evicpress",
                "--tier-disk",
                "{dir}/kv:1GiB",
                "--evicpress-copies",
                "placed-only",
            ],
        },
    ),
    e(
        "generate",
        "--evicpress-copies",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--evicpress-copies",
                "master-and-placed",
            ],
        },
    ),
    e(
        "generate",
        "--evicpress-per-byte",
        SameAs { command: "serve" },
    ),
    e(
        "generate",
        "--evicpress-per-byte",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--evicpress-per-byte"],
        },
    ),
    e(
        "generate",
        "--evicpress-profile-metric",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--tier-policy",
                "evicpress",
                "--tier-disk",
                "{dir}/kv:1GiB",
                "--evicpress-profile-metric",
                "teacher-forced",
            ],
        },
    ),
    e(
        "generate",
        "--config",
        Output {
            base: GEN,
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "6",
                "--config",
                "{cfg_model}",
            ],
        },
    ),
    e(
        "generate",
        "--prompt",
        Output {
            base: GEN,
            with: &[
                "generate",
                "--prompt",
                "Water boils at",
                "--max-tokens",
                "6",
            ],
        },
    ),
    e(
        "generate",
        "--chat",
        Output {
            base: GEN,
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "6",
                "--chat",
            ],
        },
    ),
    e(
        "generate",
        "--chat-template-kwargs",
        Read {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--chat",
                "--chat-template-kwargs",
                "{\"no_such_variable\": 1}",
            ],
            error: "does not read `no_such_variable`",
        },
    ),
    e(
        "generate",
        "--chat-template-kwargs",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--chat-template-kwargs",
                "{}",
            ],
        },
    ),
    e(
        "generate",
        "--system",
        Output {
            base: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "6",
                "--chat",
            ],
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "6",
                "--chat",
                "--system",
                "Answer in French.",
            ],
        },
    ),
    e(
        "generate",
        "--system",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--system", "Be brief."],
        },
    ),
    e(
        "generate",
        "--max-tokens",
        Output {
            base: GEN,
            with: &["generate", "--prompt", PROMPT, "--max-tokens", "2"],
        },
    ),
    e(
        "generate",
        "--max-tokens",
        Read {
            args: &["generate", "--prompt", PROMPT, "--max-tokens", "0"],
            error: "--max-tokens must be at least 1",
        },
    ),
    e(
        "generate",
        "--threads",
        Read {
            args: &["generate", "--prompt", PROMPT, "--threads", "100000"],
            error: "--threads",
        },
    ),
    e(
        "generate",
        "--temperature",
        Output {
            base: &["generate", "--prompt", PROMPT, "--max-tokens", "12"],
            with: GEN_T1,
        },
    ),
    e(
        "generate",
        "--top-k",
        Output {
            base: GEN_T1,
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "12",
                "--temperature",
                "1",
                "--seed",
                "1",
                "--top-k",
                "1",
            ],
        },
    ),
    e(
        "generate",
        "--top-k",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--top-k", "40"],
        },
    ),
    e(
        "generate",
        "--top-p",
        Output {
            base: GEN_T1,
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "12",
                "--temperature",
                "1",
                "--seed",
                "1",
                "--top-p",
                "0.05",
            ],
        },
    ),
    e(
        "generate",
        "--top-p",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--top-p", "0.9"],
        },
    ),
    e(
        "generate",
        "--seed",
        Output {
            base: GEN_T1,
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "12",
                "--temperature",
                "1",
                "--seed",
                "2",
            ],
        },
    ),
    e(
        "generate",
        "--seed",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--seed", "1"],
        },
    ),
    e(
        "generate",
        "--stop",
        Read {
            args: &["generate", "--prompt", PROMPT, "--stop", ""],
            error: "--stop strings must not be empty",
        },
    ),
    e(
        "generate",
        "--stop",
        Output {
            base: GEN,
            with: &[
                "generate",
                "--prompt",
                PROMPT,
                "--max-tokens",
                "6",
                "--stop",
                ".",
            ],
        },
    ),
    e(
        "generate",
        "--kv-policy",
        Output {
            base: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "8",
                "--kv-budget",
                "48",
            ],
            with: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "8",
                "--kv-budget",
                "48",
                "--kv-policy",
                "streaming-llm",
            ],
        },
    ),
    e(
        "generate",
        "--kv-policy",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--kv-policy", "knorm"],
        },
    ),
    e(
        "generate",
        "--kv-budget",
        Output {
            base: GEN_LONG,
            with: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "8",
                "--kv-budget",
                "48",
            ],
        },
    ),
    e(
        "generate",
        "--kv-budget",
        Refused {
            args: &[
                "generate",
                "--prompt",
                PROMPT,
                "--kv-policy",
                "full",
                "--kv-budget",
                "48",
            ],
        },
    ),
    e(
        "generate",
        "--kv-granularity",
        Output {
            base: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "8",
                "--kv-budget",
                "48",
                "--kv-policy",
                "knorm",
            ],
            with: &[
                "generate",
                "--prompt",
                LONG,
                "--max-tokens",
                "8",
                "--kv-budget",
                "48",
                "--kv-policy",
                "knorm",
                "--kv-granularity",
                "head",
            ],
        },
    ),
    e(
        "generate",
        "--kv-granularity",
        Refused {
            args: &["generate", "--prompt", PROMPT, "--kv-granularity", "head"],
        },
    ),
    e(
        "generate",
        "--device",
        Read {
            args: &["generate", "--prompt", PROMPT, "--device", "cuda"],
            error: "--device cuda",
        },
    ),
    // perplexity
    e("perplexity", "--help", CLAP),
    e(
        "perplexity",
        "--model",
        Output {
            base: PPL,
            with: &[
                "perplexity",
                "--file",
                "{text}",
                "--ctx",
                "128",
                "--chunks",
                "2",
                "--model",
                "gemma3-270m",
            ],
        },
    ),
    e(
        "perplexity",
        "--threads",
        Read {
            args: &["perplexity", "--file", "{text}", "--threads", "0"],
            error: "--threads",
        },
    ),
    e(
        "perplexity",
        "--threads",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--device",
                "cuda",
                "--threads",
                "1",
            ],
        },
    ),
    e(
        "perplexity",
        "--block-size",
        Read {
            args: &["perplexity", "--file", "{text}", "--block-size", "0"],
            error: "block size",
        },
    ),
    e(
        "perplexity",
        "--block-size",
        SameAs {
            command: "bench perf",
        },
    ),
    e(
        "perplexity",
        "--kv-dtype",
        Output {
            base: PPL,
            with: &[
                "perplexity",
                "--file",
                "{text}",
                "--ctx",
                "128",
                "--chunks",
                "2",
                "--kv-dtype",
                "q4",
            ],
        },
    ),
    e(
        "perplexity",
        "--kv-dtype",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--device",
                "cuda",
                "--kv-dtype",
                "q8",
            ],
        },
    ),
    e(
        "perplexity",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--disable-hybrid-kv-cache-manager",
            ],
        },
    ),
    e(
        "perplexity",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--model",
                "gemma3-270m",
                "--device",
                "cuda",
                "--disable-hybrid-kv-cache-manager",
            ],
        },
    ),
    e(
        "perplexity",
        "--disable-hybrid-kv-cache-manager",
        SameAs {
            command: "bench perf",
        },
    ),
    e(
        "perplexity",
        "--tier-ram",
        Refused {
            args: &["perplexity", "--file", "{text}", "--tier-ram", "64MiB"],
        },
    ),
    e(
        "perplexity",
        "--tier-ram",
        Refused {
            args: &["perplexity", "--file", "{text}", "--config", "{cfg_ram}"],
        },
    ),
    e(
        "perplexity",
        "--tier-disk",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--tier-disk",
                "{dir}:1GiB",
            ],
        },
    ),
    e(
        "perplexity",
        "--tier-redis",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--tier-redis",
                "redis://127.0.0.1:1",
            ],
        },
    ),
    e(
        "perplexity",
        "--tier-chunk-tokens",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--tier-chunk-tokens",
                "64",
            ],
        },
    ),
    e(
        "perplexity",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e(
        "perplexity",
        "--tier-policy",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--tier-policy",
                "evicpress",
            ],
        },
    ),
    e(
        "perplexity",
        "--evicpress-alpha",
        Refused {
            args: &["perplexity", "--file", "{text}", "--evicpress-alpha", "2"],
        },
    ),
    e(
        "perplexity",
        "--evicpress-grid",
        Refused {
            args: &["perplexity", "--file", "{text}", "--evicpress-grid", "q8"],
        },
    ),
    e(
        "perplexity",
        "--evicpress-copies",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--evicpress-copies",
                "placed-only",
            ],
        },
    ),
    e(
        "perplexity",
        "--evicpress-per-byte",
        Refused {
            args: &["perplexity", "--file", "{text}", "--evicpress-per-byte"],
        },
    ),
    e(
        "perplexity",
        "--evicpress-profile-metric",
        Refused {
            args: &[
                "perplexity",
                "--file",
                "{text}",
                "--evicpress-profile-metric",
                "f1",
            ],
        },
    ),
    e(
        "perplexity",
        "--config",
        Output {
            base: PPL,
            with: &[
                "perplexity",
                "--file",
                "{text}",
                "--ctx",
                "128",
                "--chunks",
                "2",
                "--config",
                "{cfg_model}",
            ],
        },
    ),
    e(
        "perplexity",
        "--file",
        Output {
            base: PPL,
            with: &[
                "perplexity",
                "--file",
                "{readme}",
                "--ctx",
                "128",
                "--chunks",
                "2",
            ],
        },
    ),
    e(
        "perplexity",
        "--ctx",
        Output {
            base: PPL,
            with: &[
                "perplexity",
                "--file",
                "{text}",
                "--ctx",
                "64",
                "--chunks",
                "2",
            ],
        },
    ),
    e(
        "perplexity",
        "--ctx",
        Read {
            args: &["perplexity", "--file", "{text}", "--ctx", "0"],
            error: "--ctx must be at least 4",
        },
    ),
    e(
        "perplexity",
        "--ctx",
        Read {
            args: &["perplexity", "--file", "{text}", "--ctx", "100000"],
            error: "--ctx 100000 is longer than the model's context",
        },
    ),
    e(
        "perplexity",
        "--chunks",
        Output {
            base: PPL,
            with: &[
                "perplexity",
                "--file",
                "{text}",
                "--ctx",
                "128",
                "--chunks",
                "1",
            ],
        },
    ),
    e(
        "perplexity",
        "--json",
        Output {
            base: PPL,
            with: &[
                "perplexity",
                "--file",
                "{text}",
                "--ctx",
                "128",
                "--chunks",
                "2",
                "--json",
            ],
        },
    ),
    e(
        "perplexity",
        "--device",
        Read {
            args: &["perplexity", "--file", "{text}", "--device", "cuda"],
            error: "--device cuda",
        },
    ),
    // serve: every flag that shapes the server goes through `serve::plan`, whose unit
    // test changes each; starting servers is what the e2e tests do.
    e("serve", "--help", CLAP),
    e(
        "serve",
        "--model",
        Read {
            args: &["serve", "--model", "/no/such/model.gguf"],
            error: "/no/such/model.gguf",
        },
    ),
    e(
        "serve",
        "--threads",
        Read {
            args: &["serve", "--threads", "0"],
            error: "--threads",
        },
    ),
    e("serve", "--block-size", SERVE_PLAN),
    e("serve", "--kv-dtype", SERVE_PLAN),
    e("serve", "--disable-hybrid-kv-cache-manager", SERVE_PLAN),
    e(
        "serve",
        "--disable-hybrid-kv-cache-manager",
        Test {
            file: "tests/server_e2e.rs",
            name: "serve_honours_disable_hybrid_kv_cache_manager",
        },
    ),
    e(
        "serve",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &["serve", "--port", "1", "--disable-hybrid-kv-cache-manager"],
        },
    ),
    e("serve", "--tier-ram", SERVE_PLAN),
    e("serve", "--tier-disk", SERVE_PLAN),
    e(
        "serve",
        "--tier-disk",
        Test {
            file: "tests/tiers_e2e.rs",
            name: "disk_tier_survives_kill_9_mid_write",
        },
    ),
    e("serve", "--tier-redis", SERVE_PLAN),
    e(
        "serve",
        "--tier-redis",
        Test {
            file: "tests/tiers_e2e.rs",
            name: "two_servers_share_one_redis",
        },
    ),
    e("serve", "--tier-chunk-tokens", SERVE_PLAN),
    e(
        "serve",
        "--tier-chunk-tokens",
        Refused {
            args: &["serve", "--port", "1", "--tier-chunk-tokens", "64"],
        },
    ),
    e("serve", "--tier-window-checkpoint-tokens", SERVE_PLAN),
    e(
        "serve",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "serve",
                "--port",
                "1",
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e(
        "serve",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "serve",
                "--port",
                "1",
                "--tier-ram",
                "64MiB",
                "--tier-policy",
                "evicpress",
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e("serve", "--tier-policy", SERVE_PLAN),
    e(
        "serve",
        "--tier-policy",
        Test {
            file: "tests/evicpress_e2e.rs",
            name: "evicpress_store_serves_explains_and_profiles_contexts",
        },
    ),
    e("serve", "--evicpress-alpha", SERVE_PLAN),
    e(
        "serve",
        "--evicpress-alpha",
        Refused {
            args: &["serve", "--evicpress-alpha", "2"],
        },
    ),
    e("serve", "--evicpress-grid", SERVE_PLAN),
    e(
        "serve",
        "--evicpress-grid",
        Refused {
            args: &["serve", "--evicpress-grid", "q8"],
        },
    ),
    e("serve", "--evicpress-copies", SERVE_PLAN),
    e(
        "serve",
        "--evicpress-copies",
        Refused {
            args: &["serve", "--evicpress-copies", "placed-only"],
        },
    ),
    e("serve", "--evicpress-per-byte", SERVE_PLAN),
    e(
        "serve",
        "--evicpress-per-byte",
        Refused {
            args: &["serve", "--evicpress-per-byte"],
        },
    ),
    e("serve", "--evicpress-profile-metric", SERVE_PLAN),
    e(
        "serve",
        "--evicpress-profile-metric",
        Refused {
            args: &["serve", "--evicpress-profile-metric", "teacher-forced"],
        },
    ),
    e(
        "serve",
        "--config",
        Test {
            file: "src/config.rs",
            name: "precedence_flags_env_file_defaults",
        },
    ),
    e(
        "serve",
        "--config",
        Read {
            args: &["serve", "--config", "{cfg_threads0}"],
            error: "threads",
        },
    ),
    e("serve", "--host", SERVE_PLAN),
    e("serve", "--port", SERVE_PLAN),
    e("serve", "--served-model-name", SERVE_PLAN),
    e(
        "serve",
        "--served-model-name",
        Read {
            args: &["serve", "--served-model-name", ""],
            error: "--served-model-name must not be empty",
        },
    ),
    e("serve", "--kv-capacity-tokens", SERVE_PLAN),
    e("serve", "--max-running-seqs", SERVE_PLAN),
    e(
        "serve",
        "--max-running-seqs",
        Read {
            args: &["serve", "--max-running-seqs", "0"],
            error: "--max-running-seqs 0",
        },
    ),
    e("serve", "--max-waiting-requests", SERVE_PLAN),
    e("serve", "--max-batch-tokens", SERVE_PLAN),
    e(
        "serve",
        "--max-batch-tokens",
        Read {
            args: &["serve", "--max-batch-tokens", "0"],
            error: "--max-batch-tokens 0",
        },
    ),
    e("serve", "--max-prefill-tokens-while-decoding", SERVE_PLAN),
    e("serve", "--prefill-prune-interval-tokens", SERVE_PLAN),
    e("serve", "--max-model-len", SERVE_PLAN),
    e("serve", "--kv-policy", SERVE_PLAN),
    e("serve", "--kv-budget", SERVE_PLAN),
    e("serve", "--kv-granularity", SERVE_PLAN),
    e(
        "serve",
        "--device",
        Read {
            args: &["serve", "--device", "cuda"],
            error: "--device cuda",
        },
    ),
    // eval
    e("eval", "--help", CLAP),
    e(
        "eval",
        "--quick",
        Read {
            args: &["eval", "--quick", "--full"],
            error: "'--quick' cannot be used with '--full'",
        },
    ),
    e(
        "eval",
        "--quick",
        Test {
            file: "tests/eval_cli.rs",
            name: "quick_preset",
        },
    ),
    e(
        "eval",
        "--full",
        Json {
            base: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
            ],
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--full",
            ],
            pointer: "/results/3/kv_budget",
        },
    ),
    e(
        "eval",
        "--policies",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "streaming-llm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
            ],
            pointer: "/results/1/policy",
        },
    ),
    e(
        "eval",
        "--budgets",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "25%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
            ],
            pointer: "/results/1/kv_budget",
        },
    ),
    e(
        "eval",
        "--budgets",
        Refused {
            args: &["eval", "--policies", "full", "--budgets", "50%"],
        },
    ),
    e(
        "eval",
        "--tasks",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "niah-single",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
            ],
            pointer: "/results/0/task",
        },
    ),
    e(
        "eval",
        "--lengths",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "192",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
            ],
            pointer: "/results/0/context_tokens",
        },
    ),
    e(
        "eval",
        "--block-sizes",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--block-sizes",
                "32",
            ],
            pointer: "/results/0/block_size",
        },
    ),
    e(
        "eval",
        "--samples",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "2",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
            ],
            pointer: "/results/0/samples",
        },
    ),
    e(
        "eval",
        "--seed",
        Json {
            base: EVAL_KL,
            with: &[
                "eval",
                "--continuation-tokens",
                "8",
                "--tasks",
                "text-kl",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--seed",
                "2",
            ],
            pointer: "/results/1/kl_mean",
        },
    ),
    e(
        "eval",
        "--out",
        Read {
            args: &["eval", "--out", "/dev/null/out"],
            error: "/dev/null/out",
        },
    ),
    e(
        "eval",
        "--json",
        Output {
            base: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--out",
                "{dir}",
            ],
            with: EVAL,
        },
    ),
    e(
        "eval",
        "--model",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--model",
                "gemma3-270m",
            ],
            pointer: "/model",
        },
    ),
    e(
        "eval",
        "--query-agnostic",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--query-agnostic",
            ],
            pointer: "/query_agnostic",
        },
    ),
    e(
        "eval",
        "--text-kl-keep-continuation",
        Json {
            base: EVAL_KL,
            with: &[
                "eval",
                "--continuation-tokens",
                "8",
                "--tasks",
                "text-kl",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--text-kl-keep-continuation",
            ],
            pointer: "/results/2/task",
        },
    ),
    e(
        "eval",
        "--continuation-tokens",
        Json {
            base: EVAL_KL,
            with: &[
                "eval",
                "--continuation-tokens",
                "16",
                "--tasks",
                "text-kl",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
            ],
            pointer: "/results/1/kl_mean",
        },
    ),
    e(
        "eval",
        "--continuation-tokens",
        Refused {
            args: &["eval", "--tasks", "passkey", "--continuation-tokens", "16"],
        },
    ),
    e(
        "eval",
        "--no-progress",
        Unchecked {
            why: "the progress bar is drawn only on a terminal, so a test's pipe never shows it",
        },
    ),
    e(
        "eval",
        "--kv-dtype",
        Json {
            base: EVAL_KL,
            with: &[
                "eval",
                "--continuation-tokens",
                "8",
                "--tasks",
                "text-kl",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--kv-dtype",
                "q4",
            ],
            pointer: "/results/0/kl_mean",
        },
    ),
    e(
        "eval",
        "--kv-granularity",
        Json {
            base: EVAL,
            with: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--policies",
                "knorm",
                "--budgets",
                "50%",
                "--no-progress",
                "--json",
                "--out",
                "{dir}",
                "--kv-granularity",
                "head",
            ],
            pointer: "/results/1/kv_granularity",
        },
    ),
    e(
        "eval",
        "--kv-granularity",
        Refused {
            args: &["eval", "--policies", "full", "--kv-granularity", "head"],
        },
    ),
    e(
        "eval",
        "--threads",
        Read {
            args: &[
                "eval",
                "--tasks",
                "passkey",
                "--lengths",
                "128",
                "--samples",
                "1",
                "--out",
                "{dir}",
                "--threads",
                "0",
            ],
            error: "--threads",
        },
    ),
    // bench perf
    e("bench perf", "--help", CLAP),
    e(
        "bench perf",
        "--model",
        Json {
            base: PERF,
            with: PERF_GEMMA,
            pointer: "/model",
        },
    ),
    e(
        "bench perf",
        "--model",
        Refused {
            args: &[
                "bench",
                "perf",
                "--dummy",
                "smollm2-135m",
                "--model",
                "gemma3-270m",
            ],
        },
    ),
    e(
        "bench perf",
        "--threads",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--threads",
                "1",
            ],
            pointer: "/threads",
        },
    ),
    e(
        "bench perf",
        "--threads",
        Refused {
            args: &["bench", "perf", "--device", "cuda", "--threads", "1"],
        },
    ),
    e(
        "bench perf",
        "--block-size",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--block-size",
                "48",
            ],
            pointer: "/runs/0/kv_bytes",
        },
    ),
    e(
        "bench perf",
        "--kv-dtype",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--kv-dtype",
                "q8",
            ],
            pointer: "/runs/0/kv_bytes",
        },
    ),
    e(
        "bench perf",
        "--kv-dtype",
        Json {
            base: PERF_DUMMY,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "32",
                "--decode-tokens",
                "2",
                "--dummy",
                "smollm2-135m",
                "--kv-dtype",
                "q8",
            ],
            pointer: "/runs/0/kv_bytes",
        },
    ),
    e(
        "bench perf",
        "--kv-dtype",
        Refused {
            args: &["bench", "perf", "--device", "cuda", "--kv-dtype", "q8"],
        },
    ),
    e(
        "bench perf",
        "--disable-hybrid-kv-cache-manager",
        Json {
            base: PERF_GEMMA,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--model",
                "gemma3-270m",
                "--disable-hybrid-kv-cache-manager",
            ],
            pointer: "/runs/0/kv_cache_groups",
        },
    ),
    e(
        "bench perf",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &["bench", "perf", "--disable-hybrid-kv-cache-manager"],
        },
    ),
    e(
        "bench perf",
        "--tier-ram",
        Refused {
            args: &["bench", "perf", "--tier-ram", "64MiB"],
        },
    ),
    e(
        "bench perf",
        "--tier-ram",
        Refused {
            args: &["bench", "perf", "--config", "{cfg_ram}"],
        },
    ),
    e(
        "bench perf",
        "--tier-disk",
        Refused {
            args: &["bench", "perf", "--tier-disk", "{dir}:1GiB"],
        },
    ),
    e(
        "bench perf",
        "--tier-redis",
        Refused {
            args: &["bench", "perf", "--tier-redis", "redis://127.0.0.1:1"],
        },
    ),
    e(
        "bench perf",
        "--tier-chunk-tokens",
        Refused {
            args: &["bench", "perf", "--tier-chunk-tokens", "64"],
        },
    ),
    e(
        "bench perf",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &["bench", "perf", "--tier-window-checkpoint-tokens", "512"],
        },
    ),
    e(
        "bench perf",
        "--tier-policy",
        Refused {
            args: &["bench", "perf", "--tier-policy", "evicpress"],
        },
    ),
    e(
        "bench perf",
        "--evicpress-alpha",
        Refused {
            args: &["bench", "perf", "--evicpress-alpha", "2"],
        },
    ),
    e(
        "bench perf",
        "--evicpress-grid",
        Refused {
            args: &["bench", "perf", "--evicpress-grid", "q8"],
        },
    ),
    e(
        "bench perf",
        "--evicpress-copies",
        Refused {
            args: &["bench", "perf", "--evicpress-copies", "placed-only"],
        },
    ),
    e(
        "bench perf",
        "--evicpress-per-byte",
        Refused {
            args: &["bench", "perf", "--evicpress-per-byte"],
        },
    ),
    e(
        "bench perf",
        "--evicpress-profile-metric",
        Refused {
            args: &["bench", "perf", "--evicpress-profile-metric", "f1"],
        },
    ),
    e(
        "bench perf",
        "--config",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--config",
                "{cfg_model}",
            ],
            pointer: "/model",
        },
    ),
    e(
        "bench perf",
        "--config",
        Refused {
            args: &[
                "bench",
                "perf",
                "--device",
                "cuda",
                "--config",
                "{cfg_threads0}",
            ],
        },
    ),
    e(
        "bench perf",
        "--dummy",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--dummy",
                "smollm2-135m",
            ],
            pointer: "/model",
        },
    ),
    e(
        "bench perf",
        "--dummy-type",
        Read {
            args: &[
                "bench",
                "perf",
                "--dummy",
                "smollm2-135m",
                "--dummy-type",
                "Q3_K",
            ],
            error: "unsupported --dummy-type",
        },
    ),
    e(
        "bench perf",
        "--dummy-type",
        Refused {
            args: &["bench", "perf", "--dummy-type", "Q8_0"],
        },
    ),
    e(
        "bench perf",
        "--dummy-type",
        Refused {
            args: &[
                "bench",
                "perf",
                "--device",
                "cuda",
                "--dummy",
                "llama-3.2-1b",
                "--dummy-type",
                "Q8_0",
            ],
        },
    ),
    e(
        "bench perf",
        "--contexts",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "48",
                "--decode-tokens",
                "2",
            ],
            pointer: "/runs/0/context_tokens",
        },
    ),
    e(
        "bench perf",
        "--decode-tokens",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "3",
            ],
            pointer: "/runs/0/decode_tokens",
        },
    ),
    e(
        "bench perf",
        "--json",
        Output {
            base: &["bench", "perf", "--contexts", "64", "--decode-tokens", "2"],
            with: PERF,
        },
    ),
    e(
        "bench perf",
        "--kv-policy",
        Json {
            base: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--kv-budget",
                "48",
            ],
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--kv-budget",
                "48",
                "--kv-policy",
                "streaming-llm",
            ],
            pointer: "/kv_policy",
        },
    ),
    e(
        "bench perf",
        "--kv-policy",
        Refused {
            args: &["bench", "perf", "--device", "cuda", "--kv-policy", "knorm"],
        },
    ),
    e(
        "bench perf",
        "--kv-budget",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--kv-budget",
                "48",
            ],
            pointer: "/runs/0/kv_bytes",
        },
    ),
    e(
        "bench perf",
        "--kv-budget",
        Refused {
            args: &["bench", "perf", "--device", "cuda", "--kv-budget", "48"],
        },
    ),
    e(
        "bench perf",
        "--kv-granularity",
        Json {
            base: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--kv-budget",
                "48",
            ],
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--kv-budget",
                "48",
                "--kv-granularity",
                "layer",
            ],
            pointer: "/kv_granularity",
        },
    ),
    e(
        "bench perf",
        "--kv-granularity",
        Refused {
            args: &["bench", "perf", "--kv-granularity", "head"],
        },
    ),
    e(
        "bench perf",
        "--kv-granularity",
        Refused {
            args: &[
                "bench",
                "perf",
                "--device",
                "cuda",
                "--kv-granularity",
                "head",
            ],
        },
    ),
    e(
        "bench perf",
        "--compare-llamacpp",
        Read {
            args: &[
                "bench",
                "perf",
                "--compare-llamacpp",
                "--llamacpp-python",
                "/no/such/python",
            ],
            error: "--compare-llamacpp",
        },
    ),
    e(
        "bench perf",
        "--compare-llamacpp",
        Refused {
            args: &["bench", "perf", "--device", "cuda", "--compare-llamacpp"],
        },
    ),
    e(
        "bench perf",
        "--llamacpp-python",
        Read {
            args: &[
                "bench",
                "perf",
                "--compare-llamacpp",
                "--llamacpp-python",
                "/no/such/python",
            ],
            error: "\"/no/such/python\"",
        },
    ),
    e(
        "bench perf",
        "--llamacpp-python",
        Refused {
            args: &["bench", "perf", "--llamacpp-python", "python3"],
        },
    ),
    e(
        "bench perf",
        "--llamacpp-python",
        RefusedEnv {
            var: "PAGEKEEPER_LLAMACPP_PYTHON",
            value: "python3",
            args: &["bench", "perf"],
        },
    ),
    e(
        "bench perf",
        "--device",
        Read {
            args: &["bench", "perf", "--device", "cuda"],
            error: "--device cuda",
        },
    ),
    e(
        "bench perf",
        "--compare-threads",
        Json {
            base: PERF,
            with: &[
                "bench",
                "perf",
                "--json",
                "--contexts",
                "64",
                "--decode-tokens",
                "2",
                "--compare-threads",
                "1",
            ],
            pointer: "/runs/0/compare_threads/0/threads",
        },
    ),
    e(
        "bench perf",
        "--compare-threads",
        Refused {
            args: &[
                "bench",
                "perf",
                "--device",
                "cuda",
                "--compare-threads",
                "1",
            ],
        },
    ),
    e(
        "bench perf",
        "--batch",
        Refused {
            args: &["bench", "perf", "--batch", "2"],
        },
    ),
    e(
        "bench perf",
        "--batch",
        Unchecked {
            why: "a batched-decode sweep of --device cuda: needs a GPU and a binary built with \
                  the cuda feature (scripts/gpu/check.sh runs it)",
        },
    ),
    // bench serve: its flags configure the servers it starts or the requests it sends.
    e("bench serve", "--help", CLAP),
    e("bench serve", "--model", BENCH_SERVE_WIRING),
    e("bench serve", "--concurrency", BENCH_SERVE_E2E),
    e("bench serve", "--requests", BENCH_SERVE_E2E),
    e(
        "bench serve",
        "--requests",
        Refused {
            args: &[
                "bench",
                "serve",
                "--replicas",
                "1",
                "--tier-redis",
                "redis://127.0.0.1:1",
                "--requests",
                "4",
            ],
        },
    ),
    e("bench serve", "--max-tokens", BENCH_SERVE_WIRING),
    e("bench serve", "--prompt-tokens", BENCH_SERVE_E2E),
    e(
        "bench serve",
        "--prompt-tokens",
        Read {
            args: &["bench", "serve", "--prompt-tokens", "100000000"],
            error: "--prompt-tokens",
        },
    ),
    e("bench serve", "--port", BENCH_SERVE_WIRING),
    e("bench serve", "--threads", BENCH_SERVE_WIRING),
    e("bench serve", "--json", BENCH_SERVE_E2E),
    e(
        "bench serve",
        "--max-prefill-tokens-while-decoding",
        BENCH_SERVE_WIRING,
    ),
    e(
        "bench serve",
        "--prefill-prune-interval-tokens",
        BENCH_SERVE_WIRING,
    ),
    e("bench serve", "--kv-policy", BENCH_SERVE_WIRING),
    e("bench serve", "--kv-budget", BENCH_SERVE_WIRING),
    e("bench serve", "--kv-capacity-tokens", BENCH_SERVE_WIRING),
    e("bench serve", "--kv-dtype", BENCH_SERVE_WIRING),
    e("bench serve", "--max-running-seqs", BENCH_SERVE_WIRING),
    e("bench serve", "--replicas", REPLICAS_E2E),
    e(
        "bench serve",
        "--replicas",
        Read {
            args: &["bench", "serve", "--replicas", "1"],
            error: "--replicas needs --tier-redis",
        },
    ),
    e("bench serve", "--tier-redis", REPLICAS_E2E),
    e(
        "bench serve",
        "--tier-redis",
        Refused {
            args: &["bench", "serve", "--tier-redis", "redis://127.0.0.1:1"],
        },
    ),
    e("bench serve", "--routing", REPLICAS_E2E),
    e(
        "bench serve",
        "--routing",
        Refused {
            args: &["bench", "serve", "--routing", "round-robin"],
        },
    ),
    e("bench serve", "--contexts", REPLICAS_E2E),
    e(
        "bench serve",
        "--contexts",
        Refused {
            args: &["bench", "serve", "--contexts", "3"],
        },
    ),
    e(
        "bench serve",
        "--rounds",
        Read {
            args: &[
                "bench",
                "serve",
                "--replicas",
                "1",
                "--tier-redis",
                "redis://127.0.0.1:1",
                "--rounds",
                "0",
            ],
            error: "and --rounds must be positive",
        },
    ),
    e(
        "bench serve",
        "--rounds",
        Refused {
            args: &["bench", "serve", "--rounds", "3"],
        },
    ),
    // bench tiers
    e("bench tiers", "--help", CLAP),
    e("bench tiers", "--model", BENCH_TIERS_E2E),
    e(
        "bench tiers",
        "--model",
        Read {
            args: &["bench", "tiers", "--model", "/no/such/model.gguf"],
            error: "/no/such/model.gguf",
        },
    ),
    e(
        "bench tiers",
        "--threads",
        Read {
            args: &["bench", "tiers", "--threads", "0"],
            error: "--threads",
        },
    ),
    e(
        "bench tiers",
        "--block-size",
        Read {
            args: &["bench", "tiers", "--block-size", "0"],
            error: "block size",
        },
    ),
    e(
        "bench tiers",
        "--kv-dtype",
        Read {
            args: &["bench", "tiers", "--kv-dtype", "q3"],
            error: "--kv-dtype",
        },
    ),
    e(
        "bench tiers",
        "--kv-dtype",
        Unchecked {
            why: "the live pool's precision shows in the TTFTs only: stored chunks are f16 \
                  whatever the pool holds",
        },
    ),
    e(
        "bench tiers",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &["bench", "tiers", "--disable-hybrid-kv-cache-manager"],
        },
    ),
    e(
        "bench tiers",
        "--disable-hybrid-kv-cache-manager",
        Unchecked {
            why: "with a sliding-window model it changes the recompute row's engine, which \
                  shows only in its timings",
        },
    ),
    e(
        "bench tiers",
        "--tier-ram",
        Refused {
            args: &["bench", "tiers", "--tier-ram", "64MiB"],
        },
    ),
    e(
        "bench tiers",
        "--tier-ram",
        Refused {
            args: &["bench", "tiers", "--config", "{cfg_ram}"],
        },
    ),
    e("bench tiers", "--tier-disk", BENCH_TIERS_E2E),
    e(
        "bench tiers",
        "--tier-disk",
        Read {
            args: &[
                "bench",
                "tiers",
                "--context-tokens",
                "256",
                "--runs",
                "1",
                "--tier-disk",
                "{dir}:1KiB",
            ],
            error: "--tier-disk: a capacity of 1024 bytes",
        },
    ),
    e("bench tiers", "--tier-redis", BENCH_TIERS_E2E),
    e(
        "bench tiers",
        "--tier-chunk-tokens",
        Json {
            base: TIERS,
            with: &[
                "bench",
                "tiers",
                "--context-tokens",
                "128",
                "--tier-chunk-tokens",
                "64",
                "--runs",
                "1",
                "--json",
            ],
            pointer: "/chunks",
        },
    ),
    e(
        "bench tiers",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "bench",
                "tiers",
                "--context-tokens",
                "128",
                "--tier-chunk-tokens",
                "128",
                "--runs",
                "1",
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e(
        "bench tiers",
        "--tier-policy",
        Refused {
            args: &["bench", "tiers", "--tier-policy", "evicpress"],
        },
    ),
    e(
        "bench tiers",
        "--evicpress-alpha",
        Refused {
            args: &["bench", "tiers", "--evicpress-alpha", "2"],
        },
    ),
    e(
        "bench tiers",
        "--evicpress-grid",
        Refused {
            args: &["bench", "tiers", "--evicpress-grid", "q8"],
        },
    ),
    e(
        "bench tiers",
        "--evicpress-copies",
        Refused {
            args: &["bench", "tiers", "--evicpress-copies", "placed-only"],
        },
    ),
    e(
        "bench tiers",
        "--evicpress-per-byte",
        Refused {
            args: &["bench", "tiers", "--evicpress-per-byte"],
        },
    ),
    e(
        "bench tiers",
        "--evicpress-profile-metric",
        Refused {
            args: &["bench", "tiers", "--evicpress-profile-metric", "f1"],
        },
    ),
    e(
        "bench tiers",
        "--config",
        Read {
            args: &["bench", "tiers", "--config", "{cfg_threads0}"],
            error: "threads",
        },
    ),
    e("bench tiers", "--context-tokens", BENCH_TIERS_E2E),
    e(
        "bench tiers",
        "--context-tokens",
        Read {
            args: &["bench", "tiers", "--context-tokens", "100"],
            error: "--context-tokens",
        },
    ),
    e("bench tiers", "--runs", BENCH_TIERS_E2E),
    e(
        "bench tiers",
        "--runs",
        Read {
            args: &["bench", "tiers", "--runs", "0"],
            error: "--runs",
        },
    ),
    e("bench tiers", "--json", BENCH_TIERS_E2E),
    // bench codecs
    e("bench codecs", "--help", CLAP),
    e(
        "bench codecs",
        "--model",
        Read {
            args: &["bench", "codecs", "--model", "/no/such/model.gguf"],
            error: "/no/such/model.gguf",
        },
    ),
    e(
        "bench codecs",
        "--threads",
        Read {
            args: &["bench", "codecs", "--threads", "0"],
            error: "--threads",
        },
    ),
    e(
        "bench codecs",
        "--block-size",
        Read {
            args: &["bench", "codecs", "--block-size", "0"],
            error: "block size",
        },
    ),
    e(
        "bench codecs",
        "--kv-dtype",
        Json {
            base: CODECS,
            with: &[
                "bench",
                "codecs",
                "--prefix-tokens",
                "64",
                "--continuation-tokens",
                "2",
                "--samples",
                "1",
                "--ratios",
                "0.5",
                "--json",
                "--kv-dtype",
                "q4",
            ],
            pointer: "/rows/0/ppl_full",
        },
    ),
    e(
        "bench codecs",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &["bench", "codecs", "--disable-hybrid-kv-cache-manager"],
        },
    ),
    e(
        "bench codecs",
        "--tier-ram",
        Refused {
            args: &["bench", "codecs", "--tier-ram", "64MiB"],
        },
    ),
    e(
        "bench codecs",
        "--tier-disk",
        Refused {
            args: &["bench", "codecs", "--tier-disk", "{dir}:1GiB"],
        },
    ),
    e(
        "bench codecs",
        "--tier-redis",
        Refused {
            args: &["bench", "codecs", "--tier-redis", "redis://127.0.0.1:1"],
        },
    ),
    e(
        "bench codecs",
        "--tier-chunk-tokens",
        Refused {
            args: &["bench", "codecs", "--tier-chunk-tokens", "64"],
        },
    ),
    e(
        "bench codecs",
        "--tier-chunk-tokens",
        Refused {
            args: &["bench", "codecs", "--config", "{cfg_chunk}"],
        },
    ),
    e(
        "bench codecs",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &["bench", "codecs", "--tier-window-checkpoint-tokens", "512"],
        },
    ),
    e(
        "bench codecs",
        "--tier-policy",
        Refused {
            args: &["bench", "codecs", "--tier-policy", "evicpress"],
        },
    ),
    e(
        "bench codecs",
        "--evicpress-alpha",
        Refused {
            args: &["bench", "codecs", "--evicpress-alpha", "2"],
        },
    ),
    e(
        "bench codecs",
        "--evicpress-grid",
        Refused {
            args: &["bench", "codecs", "--evicpress-grid", "q8"],
        },
    ),
    e(
        "bench codecs",
        "--evicpress-copies",
        Refused {
            args: &["bench", "codecs", "--evicpress-copies", "placed-only"],
        },
    ),
    e(
        "bench codecs",
        "--evicpress-per-byte",
        Refused {
            args: &["bench", "codecs", "--evicpress-per-byte"],
        },
    ),
    e(
        "bench codecs",
        "--evicpress-profile-metric",
        Refused {
            args: &["bench", "codecs", "--evicpress-profile-metric", "f1"],
        },
    ),
    e(
        "bench codecs",
        "--config",
        Read {
            args: &["bench", "codecs", "--config", "{cfg_threads0}"],
            error: "threads",
        },
    ),
    e(
        "bench codecs",
        "--prefix-tokens",
        Json {
            base: CODECS,
            with: &[
                "bench",
                "codecs",
                "--prefix-tokens",
                "96",
                "--continuation-tokens",
                "2",
                "--samples",
                "1",
                "--ratios",
                "0.5",
                "--json",
            ],
            pointer: "/rows/0/kept_tokens",
        },
    ),
    e(
        "bench codecs",
        "--continuation-tokens",
        Json {
            base: CODECS,
            with: &[
                "bench",
                "codecs",
                "--prefix-tokens",
                "64",
                "--continuation-tokens",
                "3",
                "--samples",
                "1",
                "--ratios",
                "0.5",
                "--json",
            ],
            pointer: "/rows/0/ppl_full",
        },
    ),
    e(
        "bench codecs",
        "--samples",
        Json {
            base: CODECS,
            with: &[
                "bench",
                "codecs",
                "--prefix-tokens",
                "64",
                "--continuation-tokens",
                "2",
                "--samples",
                "2",
                "--ratios",
                "0.5",
                "--json",
            ],
            pointer: "/rows/0/ppl_full",
        },
    ),
    e(
        "bench codecs",
        "--ratios",
        Json {
            base: CODECS,
            with: &[
                "bench",
                "codecs",
                "--prefix-tokens",
                "64",
                "--continuation-tokens",
                "2",
                "--samples",
                "1",
                "--ratios",
                "0.3",
                "--json",
            ],
            pointer: "/rows/5/method",
        },
    ),
    e(
        "bench codecs",
        "--json",
        Output {
            base: &[
                "bench",
                "codecs",
                "--prefix-tokens",
                "64",
                "--continuation-tokens",
                "2",
                "--samples",
                "1",
                "--ratios",
                "0.5",
            ],
            with: CODECS,
        },
    ),
    // bench evicpress: a run takes minutes, so what can be checked quickly is that each
    // flag is read (a value it cannot use is refused by name before the setup) or refused.
    e("bench evicpress", "--help", CLAP),
    e(
        "bench evicpress",
        "--model",
        Read {
            args: &[
                "bench",
                "evicpress",
                "--out",
                "{dir}",
                "--model",
                "/no/such/model.gguf",
            ],
            error: "/no/such/model.gguf",
        },
    ),
    e(
        "bench evicpress",
        "--threads",
        Read {
            args: &["bench", "evicpress", "--out", "{dir}", "--threads", "0"],
            error: "--threads",
        },
    ),
    e(
        "bench evicpress",
        "--block-size",
        Read {
            args: &["bench", "evicpress", "--out", "{dir}", "--block-size", "0"],
            error: "block size",
        },
    ),
    e(
        "bench evicpress",
        "--kv-dtype",
        Read {
            args: &["bench", "evicpress", "--out", "{dir}", "--kv-dtype", "q3"],
            error: "--kv-dtype",
        },
    ),
    e(
        "bench evicpress",
        "--disable-hybrid-kv-cache-manager",
        Refused {
            args: &["bench", "evicpress", "--disable-hybrid-kv-cache-manager"],
        },
    ),
    e(
        "bench evicpress",
        "--tier-ram",
        Refused {
            args: &["bench", "evicpress", "--tier-ram", "64MiB"],
        },
    ),
    e(
        "bench evicpress",
        "--tier-disk",
        Refused {
            args: &["bench", "evicpress", "--tier-disk", "{dir}:1GiB"],
        },
    ),
    e(
        "bench evicpress",
        "--tier-redis",
        Refused {
            args: &["bench", "evicpress", "--tier-redis", "redis://127.0.0.1:1"],
        },
    ),
    e(
        "bench evicpress",
        "--tier-chunk-tokens",
        Refused {
            args: &["bench", "evicpress", "--tier-chunk-tokens", "64"],
        },
    ),
    e(
        "bench evicpress",
        "--tier-window-checkpoint-tokens",
        Refused {
            args: &[
                "bench",
                "evicpress",
                "--tier-window-checkpoint-tokens",
                "512",
            ],
        },
    ),
    e(
        "bench evicpress",
        "--tier-policy",
        Refused {
            args: &["bench", "evicpress", "--tier-policy", "evicpress"],
        },
    ),
    e(
        "bench evicpress",
        "--evicpress-alpha",
        Refused {
            args: &["bench", "evicpress", "--evicpress-alpha", "2"],
        },
    ),
    e(
        "bench evicpress",
        "--evicpress-grid",
        Refused {
            args: &["bench", "evicpress", "--evicpress-grid", "q8"],
        },
    ),
    e(
        "bench evicpress",
        "--evicpress-copies",
        Refused {
            args: &["bench", "evicpress", "--evicpress-copies", "placed-only"],
        },
    ),
    e(
        "bench evicpress",
        "--evicpress-per-byte",
        Refused {
            args: &["bench", "evicpress", "--evicpress-per-byte"],
        },
    ),
    e(
        "bench evicpress",
        "--evicpress-profile-metric",
        Refused {
            args: &["bench", "evicpress", "--evicpress-profile-metric", "f1"],
        },
    ),
    e(
        "bench evicpress",
        "--config",
        Read {
            args: &[
                "bench",
                "evicpress",
                "--out",
                "{dir}",
                "--config",
                "{cfg_threads0}",
            ],
            error: "threads",
        },
    ),
    e(
        "bench evicpress",
        "--config",
        Refused {
            args: &["bench", "evicpress", "--config", "{cfg_ram}"],
        },
    ),
    e(
        "bench evicpress",
        "--quick",
        Read {
            args: &["bench", "evicpress", "--quick", "--full"],
            error: "'--quick' cannot be used with '--full'",
        },
    ),
    e("bench evicpress", "--full", EVICPRESS_MINUTES),
    e(
        "bench evicpress",
        "--out",
        Read {
            args: &["bench", "evicpress", "--out", "/dev/null/out"],
            error: "creating --out /dev/null/out",
        },
    ),
    e("bench evicpress", "--json", EVICPRESS_MINUTES),
    e(
        "bench evicpress",
        "--ram-fraction",
        Read {
            args: &["bench", "evicpress", "--ram-fraction", "0"],
            error: "--ram-fraction",
        },
    ),
    e(
        "bench evicpress",
        "--disk-fraction",
        Read {
            args: &[
                "bench",
                "evicpress",
                "--redis",
                "redis://127.0.0.1:1",
                "--disk-fraction",
                "0",
            ],
            error: "--disk-fraction",
        },
    ),
    e(
        "bench evicpress",
        "--disk-fraction",
        Refused {
            args: &["bench", "evicpress", "--disk-fraction", "0.3"],
        },
    ),
    e(
        "bench evicpress",
        "--redis",
        Read {
            args: &["bench", "evicpress", "--redis", "http://127.0.0.1:1"],
            error: "--redis",
        },
    ),
    e(
        "bench evicpress",
        "--alphas",
        Read {
            args: &["bench", "evicpress", "--alphas", "0"],
            error: "--alphas",
        },
    ),
    e(
        "bench evicpress",
        "--fixed",
        Read {
            args: &["bench", "evicpress", "--out", "{dir}", "--fixed", "q3"],
            error: "--fixed q3",
        },
    ),
    e(
        "bench evicpress",
        "--zipf",
        Read {
            args: &["bench", "evicpress", "--zipf=-1"],
            error: "--zipf",
        },
    ),
    e(
        "bench evicpress",
        "--rate",
        Read {
            args: &["bench", "evicpress", "--rate", "0"],
            error: "--rate",
        },
    ),
    e("bench evicpress", "--seed", EVICPRESS_MINUTES),
    e("bench evicpress", "--profile-metric", EVICPRESS_MINUTES),
    e("bench evicpress", "--loaded", EVICPRESS_MINUTES),
    e("bench evicpress", "--loaded-repeats", EVICPRESS_MINUTES),
    e(
        "bench evicpress",
        "--loaded-repeats",
        Refused {
            args: &[
                "bench",
                "evicpress",
                "--loaded",
                "false",
                "--loaded-repeats",
                "2",
            ],
        },
    ),
    e("bench evicpress", "--quality-metric", EVICPRESS_MINUTES),
    e("bench evicpress", "--cold-disk", EVICPRESS_MINUTES),
    e("bench evicpress", "--real-bounded", EVICPRESS_MINUTES),
    e(
        "bench evicpress",
        "--grid-add",
        Read {
            args: &["bench", "evicpress", "--grid-add", "kvzip-0.5,q3"],
            error: "--grid-add q3",
        },
    ),
    e(
        "bench evicpress",
        "--tiers-fractions",
        Read {
            args: &["bench", "evicpress", "--tiers-fractions", "0.5,1"],
            error: "--tiers-fractions",
        },
    ),
];
