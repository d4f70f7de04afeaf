//! The sweep: for each block size (one engine each), task, length and sample, run the full
//! cache first (the calibration and the reference), then every (policy, budget) against it.
//!
//! The full run also fills the prefix cache, so key/value-scored policies reuse its blocks
//! and only prefill the last partial block; pruning then copies what it keeps. Policies
//! that score with the last `n` prompt queries (SnapKV, …) reuse all but the blocks that
//! hold those (the scheduler stops their hit there); H2O, which reads every prompt query,
//! runs with a cache salt and prefills everything.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use pk_engine::{Engine, EngineConfig};
use pk_kv::{KvGranularity, PolicySpec};
use pk_model::KvDtype;
use pk_tokenizer::ChatMessage;

use crate::config::SweepConfig;
use crate::filler;
use crate::metrics;
use crate::record::{self, Appender, CellKey, RawResult};
use crate::rng::{hash_str, SplitMix64};
use crate::runner::{self, KvSetting};
use crate::tasks::{self, Task};

/// What a sweep measured: every record of this configuration (old and new).
pub struct SweepOutcome {
    pub model: String,
    pub records: Vec<RawResult>,
    pub cells_total: usize,
    pub cells_run: usize,
}

/// One (block size, task, length, sample): the full cache and every (policy, budget).
struct Unit {
    block_size: u32,
    task: Task,
    context_tokens: usize,
    sample: usize,
    cells: Vec<Cell>,
}

/// One cache configuration of a unit: `None` policy is the full cache (always `shared`).
#[derive(Clone, Copy, Debug)]
struct Cell {
    policy: Option<PolicySpec>,
    budget: Option<u32>,
    granularity: KvGranularity,
}

impl Cell {
    const FULL: Cell = Cell {
        policy: None,
        budget: None,
        granularity: KvGranularity::Shared,
    };

    fn setting(self, keep_generated: bool) -> KvSetting {
        KvSetting {
            policy: self.policy,
            budget: self.budget,
            keep_generated,
            // The full cache evicts nothing, and the engine refuses a granularity there.
            granularity: self.policy.map(|_| self.granularity),
        }
    }
}

pub fn model_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn units(cfg: &SweepConfig) -> Vec<Unit> {
    let mut out = Vec::new();
    // Block size outermost (one engine per block size), then length, so that a sweep
    // stopped part-way has every task at the shorter lengths rather than some tasks at all.
    for &block_size in &cfg.block_sizes {
        for &context_tokens in &cfg.lengths {
            for &task in &cfg.tasks {
                let budgets = cfg.budget_tokens(context_tokens, block_size);
                for sample in 0..cfg.samples {
                    let mut cells = vec![Cell::FULL];
                    let evicting = || cfg.policies.iter().filter(|p| p.evicts());
                    // No granularity asked for: each policy runs at its own default.
                    let own = evicting().map(|&p| (p, p.default_granularity()));
                    let every = cfg
                        .granularities
                        .iter()
                        .flat_map(|&g| evicting().map(move |&p| (p, g)));
                    let every: Vec<_> = match cfg.granularities.is_empty() {
                        true => own.collect(),
                        false => every.collect(),
                    };
                    for (p, granularity) in
                        every.into_iter().chain(cfg.pinned_policies.iter().copied())
                    {
                        cells.extend(budgets.iter().map(|&b| Cell {
                            policy: Some(p),
                            budget: Some(b),
                            granularity,
                        }));
                    }
                    out.push(Unit {
                        block_size,
                        task,
                        context_tokens,
                        sample,
                        cells,
                    });
                }
            }
        }
    }
    out
}

fn key(cfg: &SweepConfig, model: &str, u: &Unit, cell: Cell) -> CellKey {
    let Cell {
        policy,
        budget,
        granularity,
    } = cell;
    CellKey {
        model: model.to_string(),
        seed: cfg.seed,
        task: u.task.name().to_string(),
        context_tokens: u.context_tokens,
        sample: u.sample,
        policy: policy.map_or_else(|| "full".to_string(), |p| p.to_string()),
        kv_budget: budget,
        block_size: u.block_size,
        kv_dtype: cfg.kv_dtype.to_string(),
        kv_granularity: granularity.name().to_string(),
        query_agnostic: cfg.query_agnostic,
    }
}

/// Creates `OUT` and checks its manifest against `cfg`; returns `OUT/results.jsonl`.
fn prepare_out_dir(cfg: &SweepConfig) -> Result<std::path::PathBuf> {
    std::fs::create_dir_all(&cfg.out_dir)
        .with_context(|| format!("creating {}", cfg.out_dir.display()))?;
    record::check_manifest(&cfg.out_dir, cfg.samples, cfg.continuation_tokens)?;
    Ok(cfg.out_dir.join("results.jsonl"))
}

/// Runs what is not yet in `OUT/results.jsonl` and returns every record of the sweep.
pub fn run_sweep(cfg: &SweepConfig) -> Result<SweepOutcome> {
    let path = prepare_out_dir(cfg)?;
    let mut done = record::load(&path)?;
    let model = model_name(&cfg.model_path);
    let units = units(cfg);
    let cells_total: usize = units.iter().map(|u| u.cells.len()).sum();
    let pending: usize = units
        .iter()
        .flat_map(|u| u.cells.iter().map(move |&c| (u, c)))
        .filter(|&(u, c)| !done.contains_key(&key(cfg, &model, u, c)))
        .count();
    eprintln!(
        "eval: {cells_total} cells x samples in this sweep, {} already in {}, {pending} to run",
        cells_total - pending,
        path.display()
    );
    let bar = progress_bar(pending as u64, cfg.progress);
    let mut out = Appender::open(&path)?;
    let mut engine: Option<Engine> = None;
    let mut reference: Option<Engine> = None;
    let max_len = cfg.lengths.iter().copied().max().unwrap_or(0);
    let mut lengths_checked = false;
    for u in &units {
        if u.cells
            .iter()
            .all(|&c| done.contains_key(&key(cfg, &model, u, c)))
        {
            continue;
        }
        if engine
            .as_ref()
            .is_none_or(|e| e.config.block_size_tokens != u.block_size)
        {
            // Free the previous engines' KV pools first.
            drop((engine.take(), reference.take()));
            let (e, r) = load_engines(cfg, u.block_size, max_len)?;
            (engine, reference) = (Some(e), r);
        }
        let e = engine.as_mut().expect("loaded above");
        if !lengths_checked {
            check_task_lengths(cfg, e)?;
            lengths_checked = true;
        }
        bar.set_message(format!(
            "{} {} B={} #{}",
            u.task.name(),
            u.context_tokens,
            u.block_size,
            u.sample
        ));
        let ctx = UnitRun {
            cfg,
            model: &model,
            unit: u,
        };
        let new = if u.task.is_generative() {
            ctx.run_generative(e, &done, &bar)?
        } else {
            ctx.run_text_kl(e, reference.as_mut(), &done, &bar)?
        };
        for r in new {
            out.append(&r)?;
            done.insert(r.key(), r);
        }
    }
    bar.finish_and_clear();
    let records: Vec<RawResult> = units
        .iter()
        .flat_map(|u| {
            u.cells
                .iter()
                .filter_map(|&c| done.get(&key(cfg, &model, u, c)).cloned())
                .collect::<Vec<_>>()
        })
        .collect();
    Ok(SweepOutcome {
        model,
        records,
        cells_total,
        cells_run: pending,
    })
}

/// The sweep's engine for one block size, and text-kl's f16 reference beside it when the
/// sweep's KV dtype is not f16.
fn load_engines(
    cfg: &SweepConfig,
    block_size: u32,
    max_len: usize,
) -> Result<(Engine, Option<Engine>)> {
    // Room for the full run's cached prompt, a policy's own run beside it, and the
    // private copies its compaction makes of the cached blocks it adopted (without
    // them the cache entries are given up, and the next policy recomputes).
    let capacity = 3 * (max_len + cfg.continuation_tokens + 64) + 4 * block_size as usize;
    let config = EngineConfig {
        block_size_tokens: block_size,
        kv_capacity_tokens: Some(capacity),
        kv_dtype: cfg.kv_dtype,
        ..Default::default()
    };
    // text-kl's reference is the f16 full cache whatever the sweep's dtype.
    let reference = (cfg.kv_dtype != KvDtype::F16)
        .then(|| {
            Engine::load(
                &cfg.model_path,
                EngineConfig {
                    kv_dtype: KvDtype::F16,
                    ..config.clone()
                },
            )
        })
        .transpose()?;
    Ok((Engine::load(&cfg.model_path, config)?, reference))
}

/// Refuses a `--lengths` entry shorter than a generative task's smallest prompt (its
/// instructions, needles and question with no filler, in the chat template): the task would
/// run at that smallest prompt and be recorded under the shorter length, so its figures
/// would sit beside the wrong context. Checked with the first engine, before any unit runs.
fn check_task_lengths(cfg: &SweepConfig, e: &Engine) -> Result<()> {
    let Some(&shortest) = cfg.lengths.iter().min() else {
        return Ok(());
    };
    let count = |s: &str| e.tokenizer.encode(s, false).len();
    for &task in cfg.tasks.iter().filter(|t| t.is_generative()) {
        let sample =
            tasks::generate(task, 0, cfg.seed, 0, 1, &count).map_err(anyhow::Error::msg)?;
        let smallest_tokens = e.tokenizer.encode_prompt(&render(e, &sample)?, true).len();
        if shortest < smallest_tokens {
            bail!(
                "--lengths {shortest}: {} needs a context of at least {smallest_tokens} tokens (its prompt with no filler), so it would run longer than the length it is recorded under",
                task.name()
            );
        }
    }
    Ok(())
}

/// A generative sample's prompt text: the user message in the model's chat template (or
/// bare), then the answer's prefix.
fn render(e: &Engine, sample: &tasks::Sample) -> Result<String> {
    Ok(match sample.chat {
        true => {
            e.chat_template.render(
                &[ChatMessage::new("user", sample.user_message.as_str())],
                true,
            )? + &sample.answer_prefix
        }
        false => sample.user_message.clone() + &sample.answer_prefix,
    })
}

fn progress_bar(len: u64, show: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(len),
        if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} cells  {elapsed_precise} ETA {eta_precise}  {msg}",
        )
        .expect("valid template"),
    );
    bar
}

struct UnitRun<'a> {
    cfg: &'a SweepConfig,
    model: &'a str,
    unit: &'a Unit,
}

impl UnitRun<'_> {
    fn base(&self, cell: Cell, prompt_tokens: usize) -> RawResult {
        let u = self.unit;
        let Cell {
            policy,
            budget,
            granularity,
        } = cell;
        RawResult {
            model: self.model.to_string(),
            seed: self.cfg.seed,
            task: u.task.name().to_string(),
            context_tokens: u.context_tokens,
            sample: u.sample,
            policy: policy.map_or_else(|| "full".to_string(), |p| p.to_string()),
            kv_budget: budget,
            block_size: u.block_size,
            prompt_tokens,
            score: 0.0,
            depth: None,
            answer: None,
            expected: Vec::new(),
            token_f1: None,
            rouge_l: None,
            kl_mean: None,
            top1_agreement: None,
            ppl_full: None,
            ppl_policy: None,
            kv_stored_tokens: 0,
            seconds: 0.0,
            kv_dtype: self.cfg.kv_dtype.to_string(),
            kv_granularity: granularity.name().to_string(),
            query_agnostic: self.cfg.query_agnostic,
        }
    }

    fn pending<'u>(
        &'u self,
        done: &'u HashMap<CellKey, RawResult>,
    ) -> impl Iterator<Item = Cell> + 'u {
        self.unit
            .cells
            .iter()
            .copied()
            .filter(move |&c| !done.contains_key(&key(self.cfg, self.model, self.unit, c)))
    }

    fn run_generative(
        &self,
        e: &mut Engine,
        done: &HashMap<CellKey, RawResult>,
        bar: &ProgressBar,
    ) -> Result<Vec<RawResult>> {
        let u = self.unit;
        let count = |s: &str| e.tokenizer.encode(s, false).len();
        let sample = tasks::generate(
            u.task,
            u.context_tokens,
            self.cfg.seed,
            u.sample,
            self.cfg.samples,
            &count,
        )
        .map_err(anyhow::Error::msg)?;
        let text = render(e, &sample)?;
        let (prompt, question) = self.split_question(e, &text, &sample);
        self.record_generative_tokens(&prompt, &question, &sample)?;
        let ctx = e.model_config().context_length;
        if prompt.len() + question.len() + sample.max_answer_tokens >= ctx {
            bail!("{} at {} tokens: the prompt has {} tokens, too many for the model's context of {ctx}", u.task.name(), u.context_tokens, prompt.len());
        }
        let mut new = Vec::new();
        // The full cache first: calibration, the reference answer, and a warm prefix cache.
        let t0 = Instant::now();
        let answer = |e: &mut Engine, kv: KvSetting, salt: Option<String>| match question.is_empty()
        {
            true => runner::generate(e, &prompt, sample.max_answer_tokens, kv, salt),
            false => {
                runner::generate_after(e, &prompt, &question, sample.max_answer_tokens, kv, salt)
            }
        };
        let full = answer(e, KvSetting::FULL, None)?;
        let mut full_rec = self.base(Cell::FULL, prompt.len());
        full_rec.seconds = t0.elapsed().as_secs_f64();
        full_rec.kv_stored_tokens = full.kv_stored_tokens;
        self.fill_answer(&mut full_rec, &sample, &full.text, &full.text);
        for cell in self.pending(done).collect::<Vec<_>>() {
            let Some(spec) = cell.policy else {
                new.push(full_rec.clone());
                bar.inc(1);
                continue;
            };
            let t0 = Instant::now();
            let out = answer(e, cell.setting(false), salt(spec, cell.budget))?;
            let mut r = self.base(cell, prompt.len());
            r.seconds = t0.elapsed().as_secs_f64();
            r.kv_stored_tokens = out.kv_stored_tokens;
            self.fill_answer(&mut r, &sample, &out.text, &full.text);
            new.push(r);
            bar.inc(1);
        }
        Ok(new)
    }

    /// The prompt's token ids, and in a query-agnostic sweep the question's: the rendered
    /// prompt is cut where the sample's question starts (the question, the template's end of
    /// turn and the answer prefix are read after the context). Empty question ids where the
    /// sweep is not query-agnostic or the task asks none (code completion).
    fn split_question(
        &self,
        e: &Engine,
        text: &str,
        sample: &tasks::Sample,
    ) -> (Vec<u32>, Vec<u32>) {
        let cut = match (self.cfg.query_agnostic, sample.question.is_empty()) {
            (true, false) => text.rfind(sample.question.as_str()),
            _ => None,
        };
        match cut {
            Some(at) => (
                e.tokenizer.encode_prompt(&text[..at], true),
                e.tokenizer.encode(&text[at..], true),
            ),
            None => (e.tokenizer.encode_prompt(text, true), Vec::new()),
        }
    }

    /// Appends the unit's token ids to `OUT/text-kl-tokens.jsonl`, so that another
    /// implementation (a kvpress run, llama.cpp) can be scored on exactly these spans.
    fn record_tokens(&self, prefix: &[u32], continuation: &[u32]) -> Result<()> {
        let u = self.unit;
        let line = serde_json::json!({"task": u.task.name(), "context_tokens": u.context_tokens, "sample": u.sample, "seed": self.cfg.seed, "prefix": prefix, "continuation": continuation});
        append_line(&self.cfg.out_dir.join("text-kl-tokens.jsonl"), &line)
    }

    /// Appends the unit's prompt and question ids, expected answers and answer length to
    /// `OUT/generative-tokens.jsonl`, so that another implementation (the NumPy KVzip
    /// reference) can answer exactly these prompts.
    fn record_generative_tokens(
        &self,
        prompt: &[u32],
        question: &[u32],
        sample: &tasks::Sample,
    ) -> Result<()> {
        let u = self.unit;
        let line = serde_json::json!({"task": u.task.name(), "context_tokens": u.context_tokens, "sample": u.sample, "seed": self.cfg.seed, "prompt": prompt, "question": question, "expected": sample.expected, "max_answer_tokens": sample.max_answer_tokens});
        append_line(&self.cfg.out_dir.join("generative-tokens.jsonl"), &line)
    }

    fn fill_answer(
        &self,
        r: &mut RawResult,
        sample: &tasks::Sample,
        answer: &str,
        full_answer: &str,
    ) {
        r.score = match sample.scoring {
            tasks::Scoring::Contains => metrics::match_score(answer, &sample.expected),
            tasks::Scoring::EditSimilarity => metrics::code_similarity(answer, &sample.expected[0]),
            tasks::Scoring::Count => metrics::count_score(answer, &sample.expected[0]),
        };
        r.depth = Some(sample.depth);
        r.expected = sample.expected.clone();
        r.answer = Some(answer.to_string());
        r.token_f1 = Some(metrics::token_f1(answer, full_answer));
        r.rouge_l = Some(metrics::rouge_l(answer, full_answer));
    }

    /// `reference`: an f16 engine for the full-cache reference when `e` is not f16.
    fn run_text_kl(
        &self,
        e: &mut Engine,
        reference: Option<&mut Engine>,
        done: &HashMap<CellKey, RawResult>,
        bar: &ProgressBar,
    ) -> Result<Vec<RawResult>> {
        let u = self.unit;
        let n_cont = self.cfg.continuation_tokens;
        if u.context_tokens <= n_cont + 16 {
            bail!("text-kl needs a context longer than the {n_cont}-token continuation");
        }
        let mut rng = SplitMix64::for_parts(&[
            self.cfg.seed,
            hash_str("text-kl"),
            u.context_tokens as u64,
            u.sample as u64,
        ]);
        let mut ids = filler::natural_text_tokens(u.context_tokens, &mut rng, &|s| {
            e.tokenizer.encode(s, false)
        });
        // A model that wants BOS (Gemma) gets it in place of the first token, as
        // llama-perplexity does; the length, and so every cell's budget, is unchanged.
        if let Some(bos) = e
            .tokenizer
            .add_bos()
            .then(|| e.tokenizer.bos_id())
            .flatten()
        {
            ids[0] = bos;
        }
        let (prefix, cont) = ids.split_at(u.context_tokens - n_cont);
        self.record_tokens(prefix, cont)?;
        let t0 = Instant::now();
        let full = runner::teacher_force(e, prefix, cont, KvSetting::FULL, None)?;
        let full_seconds = t0.elapsed().as_secs_f64();
        let reference = match reference {
            Some(f16) => runner::teacher_force(f16, prefix, cont, KvSetting::FULL, None)?.logits,
            None => full.logits.clone(),
        };
        let mut new = Vec::new();
        for cell in self.pending(done).collect::<Vec<_>>() {
            let t0 = Instant::now();
            let (logits, kv_stored_tokens) = match cell.policy {
                Some(spec) => {
                    let keep_generated = u.task == Task::TextKlKeepContinuation;
                    let o = runner::teacher_force(
                        e,
                        prefix,
                        cont,
                        cell.setting(keep_generated),
                        salt(spec, cell.budget),
                    )?;
                    (o.logits, o.kv_stored_tokens)
                }
                None => (full.logits.clone(), full.kv_stored_tokens),
            };
            let d = metrics::divergence(&reference, &logits, cont, 1);
            let mut r = self.base(cell, prefix.len());
            r.seconds = if cell.policy.is_none() {
                full_seconds
            } else {
                t0.elapsed().as_secs_f64()
            };
            r.kv_stored_tokens = kv_stored_tokens;
            r.score = d.top1_agreement;
            r.kl_mean = Some(d.kl_mean);
            r.top1_agreement = Some(d.top1_agreement);
            r.ppl_full = Some(d.ppl_full);
            r.ppl_policy = Some(d.ppl_policy);
            new.push(r);
            bar.inc(1);
        }
        Ok(new)
    }
}

/// A policy that reads every prompt query (H2O) must not start from a prefix-cache hit;
/// one that reads the last `n` (SnapKV, TOVA, …) may, since the scheduler stops its hit
/// `n` tokens before the prompt's end (`Scheduler::cacheable_ids`).
fn salt(spec: PolicySpec, budget: Option<u32>) -> Option<String> {
    (spec.build().prefill_queries() == pk_kv::QueryNeed::All)
        .then(|| format!("eval|{spec}|{budget:?}"))
}

/// Appends one JSON line to `path`.
fn append_line(path: &std::path::Path, line: &serde_json::Value) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{line}").with_context(|| format!("writing {}", path.display()))
}
