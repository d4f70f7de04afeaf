//! Prints the token ids and pieces of a text: `cargo run -p pk-tokenizer --example tokenize -- MODEL.gguf "text"`.
//! Special tokens in the text (`<|im_start|>`) are parsed; `\n` in the argument stays literal.
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(path), Some(text)) = (args.next(), args.next()) else {
        return Err("usage: tokenize MODEL.gguf TEXT".into());
    };
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
