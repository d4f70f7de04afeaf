//! Writes the PTX NVRTC makes of every kernel to a file, for reading or for
//! `ptxas -arch=sm_90 -v` (registers, spills) on a machine with the CUDA toolkit:
//!
//!     LD_LIBRARY_PATH=.nvrtc/nvidia/cu13/lib cargo run --release -p pk-cuda --example ptx_dump -- out.ptx [bf16]

use pk_cuda::kernels::{compile, nvrtc_available};
use pk_cuda::ActDtype;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| "pagekeeper.ptx".into());
    let act = if args.next().as_deref() == Some("bf16") {
        ActDtype::Bf16
    } else {
        ActDtype::F16
    };
    if !nvrtc_available() {
        eprintln!("libnvrtc not found: set LD_LIBRARY_PATH (scripts/gpu/README.md)");
        std::process::exit(1);
    }
    let ptx = compile("compute_90", act).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(&path, ptx.to_src()).expect("writing the PTX");
    eprintln!("wrote {path} ({act:?})");
}
