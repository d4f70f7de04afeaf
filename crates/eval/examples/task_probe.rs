//! Diagnoses a task's calibration: generates samples of one task at several lengths and
//! prints the full cache's greedy answer for each, with optional changes to the prompt
//! (how the 1024-token passkey failure of issue 5 was traced).
//!
//! `cargo run --release -p pk-eval --example task_probe -- TASK LENGTHS SAMPLES [--show-prompt] [--no-prefix] [--prefix TEXT] [--max-batch-tokens N]`

use anyhow::{Context, Result};
use pk_engine::{Engine, EngineConfig};
use pk_eval::runner::{self, KvSetting};
use pk_eval::tasks::{self, Task};
use pk_tokenizer::ChatMessage;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let task = Task::parse(args.first().context("TASK")?).map_err(anyhow::Error::msg)?;
    let lengths: Vec<usize> = args
        .get(1)
        .context("LENGTHS")?
        .split(',')
        .map(|s| s.parse())
        .collect::<Result<_, _>>()?;
    let samples: usize = args.get(2).context("SAMPLES")?.parse()?;
    let show_prompt = args.iter().any(|a| a == "--show-prompt");
    let no_prefix = args.iter().any(|a| a == "--no-prefix");
    let prefix_override = args
        .iter()
        .position(|a| a == "--prefix")
        .map(|i| args[i + 1].clone());
    let max_batch_tokens = args
        .iter()
        .position(|a| a == "--max-batch-tokens")
        .map(|i| args[i + 1].parse())
        .transpose()?
        .unwrap_or(512);
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
