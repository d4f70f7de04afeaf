//! Compiles every kernel source with NVRTC to PTX for sm_90 (the H100/H200), for both GEMM
//! operand types. NVRTC needs no GPU, so this is the one check of the CUDA code that runs
//! on machines without one; it skips (passes, saying so) when libnvrtc cannot be opened.
//! Point it at a library with `LD_LIBRARY_PATH` (scripts/gpu/README.md says how).

use pk_cuda::kernels::{compile, nvrtc_available, program_source, KERNEL_NAMES};
use pk_cuda::ActDtype;

#[test]
fn every_kernel_compiles_for_sm90() {
    if !nvrtc_available() {
        eprintln!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to a folder holding libnvrtc.so.13 or .so.12)");
        return;
    }
    for act in [ActDtype::F16, ActDtype::Bf16] {
        let ptx = compile("compute_90", act).unwrap_or_else(|e| panic!("{act:?}: {e}"));
        let text = ptx.to_src();
        for name in KERNEL_NAMES {
            assert!(text.contains(&format!(".entry {name}(")), "{act:?}: kernel {name} missing from the PTX");
        }
        eprintln!("{act:?}: {} kernels, {} bytes of PTX for compute_90", KERNEL_NAMES.len(), text.len());
    }
}

#[test]
fn every_named_kernel_is_defined_once() {
    let src = program_source();
    for name in KERNEL_NAMES {
        let n = src.matches(&format!("__global__ void {name}(")).count();
        assert_eq!(n, 1, "kernel {name} defined {n} times");
    }
    assert_eq!(src.matches("extern \"C\" __global__").count(), KERNEL_NAMES.len(), "a kernel is not listed in KERNEL_NAMES");
}
