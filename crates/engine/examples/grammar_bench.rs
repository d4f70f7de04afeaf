//! The cost of structured output: the same greedy chat request with and without a JSON
//! schema grammar, side by side, on the default model (or the model given as the first
//! argument). Prints the grammar engine's start-up time, the time to compile the schema,
//! the mean time of one token mask, and decode speed with and without the mask.
//!
//!     cargo run --release -p pk-engine --example grammar_bench [MODEL.gguf] [ROUNDS]

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use pk_engine::{Engine, EngineConfig, GenerateParams, Grammar, GrammarCompiler, GrammarSpec};

/// A schema of the kind the prompt asks for, with an array and a free-text field.
fn city_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "population": {"type": "integer"},
            "country": {"type": "string"},
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "notes": {"type": "string"}
        },
        "required": ["name", "population", "country", "landmarks", "notes"]
    })
}

/// The cost of structured output: the same chat request with and without a JSON schema.
#[derive(Parser)]
#[command(name = "grammar_bench")]
struct Args {
    /// The GGUF model; without it, the default model (fetched if missing).
    model: Option<PathBuf>,
    /// Rounds of the plain and the constrained request, each printed.
    #[arg(default_value_t = 3)]
    rounds: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let model = match args.model {
        Some(p) => p,
        None => pk_engine::model_store::resolve_model(None, true)?,
    };
    let rounds = args.rounds;
    let mut engine = Engine::load(&model, EngineConfig::default())?;
    let msgs = [pk_tokenizer::ChatMessage::new(
        "user",
        "Describe a fictional city: its name, population, country and three landmarks.",
    )];
    let prompt = engine
        .tokenizer
        .encode_prompt(&engine.chat_template.render(&msgs, true)?, true);
    let schema = city_schema();
    let plain = GenerateParams {
        max_tokens: 96,
        ..Default::default()
    };
    let constrained = GenerateParams {
        grammar: Some(Grammar::new(
            GrammarSpec::JsonSchema(schema),
            "response_format",
        )),
        ..plain.clone()
    };
    // The first grammar request builds the token trie.
    let t0 = Instant::now();
    engine.generate(
        &prompt,
        &GenerateParams {
            max_tokens: 1,
            ..constrained.clone()
        },
        &mut |_| {},
    )?;
    println!(
        "grammar engine start-up + 1 token: {:.3} s",
        t0.elapsed().as_secs_f64()
    );
    print_compile_time(&engine, constrained.grammar.as_ref().expect("set above"))?;
    for round in 0..rounds {
        let rates = [&plain, &constrained].map(|params| run(&mut engine, &prompt, params, round));
        let rates = rates.into_iter().collect::<anyhow::Result<Vec<f64>>>()?;
        println!(
            "round {round} decode with / without the grammar: {:.2}x",
            rates[1] / rates[0]
        );
    }
    Ok(())
}

/// What a fresh schema costs once the trie exists (what the server pays per request, on its
/// blocking pool): the best of 5 compilations.
fn print_compile_time(engine: &Engine, grammar: &Grammar) -> anyhow::Result<()> {
    let compiler = GrammarCompiler::new(std::sync::Arc::new(engine.tokenizer.clone()))?;
    let mut best_s = f64::INFINITY;
    for _ in 0..5 {
        let t0 = Instant::now();
        compiler.compile(grammar)?;
        best_s = best_s.min(t0.elapsed().as_secs_f64());
    }
    println!("one schema compiled: {:.2} ms", best_s * 1e3);
    Ok(())
}

/// One timed request; prints its decode speed and mask cost, returns tokens per second.
fn run(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    round: usize,
) -> anyhow::Result<f64> {
    let (masks, mask_s) = (
        engine.stats.grammar_masks,
        engine.stats.grammar_mask_seconds,
    );
    let out = engine.generate(prompt, params, &mut |_| {})?;
    let n = out.token_ids.len();
    let masks = engine.stats.grammar_masks - masks;
    let mask_s = engine.stats.grammar_mask_seconds - mask_s;
    let rate = n.saturating_sub(1) as f64 / out.decode_seconds.max(1e-9);
    let kind = if params.grammar.is_some() {
        "json schema"
    } else {
        "plain"
    };
    let mask_note = match masks {
        0 => String::new(),
        _ => format!(
            ", {masks} masks, {:.1} µs per mask",
            1e6 * mask_s / masks as f64
        ),
    };
    println!("round {round} {kind:>11}: {n} tokens, decode {rate:.1} tok/s{mask_note}");
    Ok(rate)
}
