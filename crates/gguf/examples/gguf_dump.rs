//! Prints a GGUF file's metadata (arrays abbreviated) and tensor table: `cargo run -p pk-gguf --example gguf_dump -- FILE`.
use clap::Parser;

/// Prints a GGUF file's metadata and tensor table.
#[derive(Parser)]
#[command(name = "gguf_dump")]
struct Args {
    /// The GGUF file.
    file: String,
}

fn main() {
    let path = Args::parse().file;
    let f = pk_gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    for (k, v) in &f.metadata {
        match v {
            pk_gguf::MetaValue::Array(a) => {
                println!("{k}: array[{}] first={:?}", a.len(), a.first())
            }
            pk_gguf::MetaValue::String(s) if s.len() > 200 => println!("{k}: {:?}...", &s[..200]),
            v => println!("{k}: {v:?}"),
        }
    }
    for t in &f.tensors {
        println!("{} {:?} {}", t.name, t.dims, t.ggml_type);
    }
}
