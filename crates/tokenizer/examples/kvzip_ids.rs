//! Prints, as JSON, the token ids KVzip's reconstruction pass needs in a model's vocabulary
//! (issue 37; kvpress 0.5.5's `KVzipPress.prepare`): `first`, the prompt before the first
//! chunk ("\n\nRepeat the previous context exactly."), `later`, the one before later
//! chunks (followed there by the previous chunk's last tokens), and `suffix`, what the
//! model's own chat template writes between a user turn's text and the assistant's answer
//! (found as kvpress does: a one-message conversation rendered with the generation prompt,
//! split after a separator), and `prefix`, what the template writes before a user turn's
//! text (the system turn and the user header, with the BOS a prompt starts with), which
//! the authors' KVzip keeps whole and does not repeat. For `scripts/kvpress_reference.py
//! --kvzip-ids` and `scripts/kvzip_reference_answers.py`.
//!
//! `cargo run --release -p pk-tokenizer --example kvzip_ids -- MODEL.gguf > ids.json`

use clap::Parser;
use pk_tokenizer::{ChatTemplate, Tokenizer};

const FIRST: &str = "\n\nRepeat the previous context exactly.";
const LATER: &str = "\n\nRepeat the part of the previous context exactly, starting with";

/// Prints, as JSON, the token ids KVzip's reconstruction pass needs in a model's vocabulary.
#[derive(Parser)]
#[command(name = "kvzip_ids")]
struct Args {
    /// The GGUF model whose tokenizer and chat template are read.
    #[arg(value_name = "MODEL.gguf")]
    model: String,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = Args::parse().model;
    let file = pk_gguf::GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let template = ChatTemplate::from_gguf(&file)?;
    let suffix = template.user_turn_suffix()?;
    let suffix = suffix.as_str();
    let prefix = template.user_turn_prefix()?;
    let ids = serde_json::json!({
        "first": tokenizer.encode(FIRST, false),
        "later": tokenizer.encode(LATER, false),
        "suffix": tokenizer.encode(suffix, true),
        "suffix_text": suffix,
        "prefix": tokenizer.encode_prompt(&prefix, true),
        "prefix_text": prefix,
    });
    println!("{ids}");
    Ok(())
}
