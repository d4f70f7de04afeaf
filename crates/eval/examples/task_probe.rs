//! Diagnoses a task's calibration: generates samples of one task at several lengths and
//! prints the full cache's greedy answer for each, with optional changes to the prompt
//! (how the 1024-token passkey failure of issue 5 was traced).
//!
//! `cargo run --release -p pk-eval --example task_probe -- TASK LENGTHS SAMPLES [--show-prompt] [--no-prefix] [--prefix TEXT] [--max-batch-tokens N]`

use anyhow::Result;
use clap::Parser;
// The engine examples' argument helpers, compiled here too.
#[path = "../../engine/examples/common/mod.rs"]
mod common;
use common::comma_list;
use pk_engine::{Engine, EngineConfig};
use pk_eval::runner::{self, KvSetting};
use pk_eval::tasks::{self, Task};
use pk_tokenizer::ChatMessage;

/// Prints the full cache's greedy answer to samples of one task at several lengths.
#[derive(Parser)]
#[command(name = "task_probe")]
struct Args {
    /// The task, as `pagekeeper eval` names it.
    #[arg(value_parser = Task::parse)]
    task: Task,
    /// Prompt lengths in tokens, comma-separated.
    // `::std::vec::Vec`, so that clap takes one argument and `comma_list` splits it, rather
    // than a run of positionals that would swallow the next one.
    #[arg(value_parser = comma_list::<usize>)]
    lengths: ::std::vec::Vec<usize>,
    /// Samples generated at each length.
    samples: usize,
    /// Print each prompt before its answer.
    #[arg(long)]
    show_prompt: bool,
    /// Let the model answer freely instead of after the task's answer prefix.
    #[arg(long)]
    no_prefix: bool,
    /// Text that replaces the task's answer prefix.
    #[arg(long = "prefix", value_name = "TEXT", allow_hyphen_values = true)]
    prefix_override: Option<String>,
    /// The engine's bound on tokens per forward pass (`max_batch_tokens`).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
}

fn main() -> Result<()> {
    let Args {
        task,
        lengths,
        samples,
        show_prompt,
        no_prefix,
        prefix_override,
        max_batch_tokens,
    } = Args::parse();
    let model = pk_engine::model_store::resolve_model(None, false)?;
    let config = EngineConfig {
        max_batch_tokens,
        kv_capacity_tokens: Some(10_000),
        ..Default::default()
    };
    let mut e = Engine::load(&model, config)?;
    for &len in &lengths {
        for i in 0..samples {
            let count = |s: &str| e.tokenizer.encode(s, false).len();
            let s =
                tasks::generate(task, len, 1, i, samples, &count).map_err(anyhow::Error::msg)?;
            // `--no-prefix`: let the model answer freely instead of after RULER's answer prefix.
            let prefix = if no_prefix {
                ""
            } else {
                prefix_override
                    .as_deref()
                    .unwrap_or(s.answer_prefix.as_str())
            };
            let text = e
                .chat_template
                .render(&[ChatMessage::new("user", s.user_message.as_str())], true)?
                + prefix;
            let ids = e.tokenizer.encode(&text, true);
            if show_prompt {
                println!("----- prompt ({} tokens) -----\n{text}\n-----", ids.len());
            }
            let out = runner::generate(
                &mut e,
                &ids,
                s.max_answer_tokens + 16,
                KvSetting::FULL,
                Some(format!("probe{len}-{i}")),
            )?;
            println!(
                "{} len={len} prompt={} sample={i} depth={:.2} expected={:?} answer={:?}",
                task.name(),
                ids.len(),
                s.depth,
                s.expected,
                out.text
            );
        }
    }
    Ok(())
}
