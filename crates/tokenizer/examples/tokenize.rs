//! Prints the token ids and pieces of a text: `cargo run -p pk-tokenizer --example tokenize -- MODEL.gguf "text"`.
//! Special tokens in the text (`<|im_start|>`) are parsed; `\n` in the argument stays literal.
use std::time::Instant;

use clap::Parser;

/// Prints the token ids and pieces of a text.
#[derive(Parser)]
#[command(name = "tokenize")]
struct Args {
    /// The GGUF model whose tokenizer is read.
    #[arg(value_name = "MODEL.gguf")]
    model: String,
    /// The text; after `--` where it starts with `-`, so that a mistyped flag is refused.
    text: String,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Args { model: path, text } = Args::parse();
    let started = Instant::now();
    let file = pk_gguf::GgufFile::open(&path)?;
    let tokenizer = pk_tokenizer::Tokenizer::from_gguf(&file)?;
    eprintln!("loaded {tokenizer:?} in {:?}", started.elapsed());
    for id in tokenizer.encode(&text, true) {
        println!(
            "{id:>7} {:?}",
            String::from_utf8_lossy(tokenizer.token_bytes(id))
        );
    }
    Ok(())
}
