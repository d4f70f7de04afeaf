//! Writes the PTX NVRTC makes of every kernel to a file, for reading or for
//! `ptxas -arch=sm_90 -v` (registers, spills) on a machine with the CUDA toolkit:
//!
//!     LD_LIBRARY_PATH=.nvrtc/nvidia/cu13/lib cargo run --release -p pk-cuda --example ptx_dump -- out.ptx [bf16]

use clap::{Parser, ValueEnum};
use pk_cuda::kernels::{compile, nvrtc_available};
use pk_cuda::ActDtype;

/// Writes the PTX that NVRTC makes of every kernel to a file.
#[derive(Parser)]
#[command(name = "ptx_dump")]
struct Args {
    /// Where the PTX is written.
    #[arg(default_value = "pagekeeper.ptx")]
    path: String,
    /// The activations' dtype the kernels are compiled for.
    #[arg(value_enum, default_value_t = Act::F16)]
    act: Act,
}

/// The activation dtypes the kernels are compiled for, as named on the command line.
#[derive(Clone, Copy, ValueEnum)]
enum Act {
    F16,
    Bf16,
}

fn main() {
    let args = Args::parse();
    let path = args.path;
    let act = match args.act {
        Act::F16 => ActDtype::F16,
        Act::Bf16 => ActDtype::Bf16,
    };
    if !nvrtc_available() {
        eprintln!("libnvrtc not found: set LD_LIBRARY_PATH (scripts/gpu/README.md)");
        std::process::exit(1);
    }
    let ptx = compile("compute_90", act).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&path, ptx.to_src()).expect("writing the PTX");
    eprintln!("wrote {path} ({act:?})");
}
