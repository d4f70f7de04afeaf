//! Compiles every kernel source with NVRTC to PTX for sm_90 (the H100/H200), for both GEMM
//! operand types. NVRTC needs no GPU, so this check of the CUDA code runs on every machine:
//! scripts/test.sh (the README's test command) fetches libnvrtc from its PyPI wheel and puts
//! it on `LD_LIBRARY_PATH`. A test here FAILS when libnvrtc cannot be opened, because passing
//! without compiling anything would claim a check that did not happen. To run these tests
//! outside scripts/test.sh, point `LD_LIBRARY_PATH` at a folder holding libnvrtc.so.13 (or
//! .so.12), for example `$PAGEKEEPER_HOME/test-deps/nvrtc/nvidia/cu13/lib` once test.sh
//! has run.

use pk_cuda::kernels::{
    compile, compile_cubin, compile_source, nvrtc_available, program_source, KERNEL_NAMES,
};
use pk_cuda::ActDtype;

/// Fails the test unless libnvrtc can be opened, saying where it is expected to come from.
fn require_nvrtc() {
    assert!(
        nvrtc_available(),
        "libnvrtc not found: set LD_LIBRARY_PATH to a folder holding libnvrtc.so.13 or .so.12 \
         (scripts/test.sh fetches it from the PyPI wheel nvidia-cuda-nvrtc into \
         $PAGEKEEPER_HOME/test-deps/nvrtc and does this)"
    );
}

#[test]
fn every_kernel_compiles_for_sm90() {
    require_nvrtc();
    for act in [ActDtype::F16, ActDtype::Bf16] {
        let ptx = compile("compute_90", act).unwrap_or_else(|e| panic!("{act:?}: {e}"));
        let text = ptx.to_src();
        for name in KERNEL_NAMES {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "{act:?}: kernel {name} missing from the PTX"
            );
        }
        eprintln!(
            "{act:?}: {} kernels, {} bytes of PTX for compute_90",
            KERNEL_NAMES.len(),
            text.len()
        );
    }
}

#[test]
fn every_named_kernel_is_defined_once() {
    // The name before the parameter list of each `extern "C" __global__` line (past a
    // `__launch_bounds__(…)` where there is one).
    let src = program_source();
    let mut defined: Vec<&str> = src
        .lines()
        .filter(|l| l.starts_with("extern \"C\" __global__"))
        .map(|l| {
            let l = l
                .split_once("__launch_bounds__(")
                .map_or(l, |(_, rest)| rest.split_once(')').unwrap().1);
            l[..l.find('(').expect("a parameter list")]
                .rsplit(' ')
                .next()
                .unwrap()
        })
        .collect();
    defined.sort_unstable();
    let mut listed = KERNEL_NAMES.to_vec();
    listed.sort_unstable();
    assert_eq!(
        defined, listed,
        "kernels defined in the sources vs KERNEL_NAMES"
    );
}

/// The check would catch a broken kernel: a type error fails with NVRTC's log.
#[test]
fn a_type_error_fails_with_the_compiler_log() {
    require_nvrtc();
    let broken = program_source()
        + "\nextern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }\n";
    let err = compile_source(&broken, "compute_90", ActDtype::F16)
        .expect_err("a type error must not compile");
    assert!(
        err.to_string().contains("undefined_name"),
        "log without the error: {err}"
    );
}

/// The loader's fallback (a driver older than NVRTC refuses its PTX): machine code for sm_90.
#[test]
fn every_kernel_compiles_to_sm90_machine_code() {
    require_nvrtc();
    for act in [ActDtype::F16, ActDtype::Bf16] {
        let cubin = compile_cubin(&program_source(), "sm_90", act)
            .unwrap_or_else(|e| panic!("{act:?}: {e}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "{act:?}: not an ELF cubin");
        for name in KERNEL_NAMES {
            assert!(
                cubin.windows(name.len()).any(|w| w == name.as_bytes()),
                "{act:?}: kernel {name} missing from the cubin"
            );
        }
        eprintln!("{act:?}: {} bytes of sm_90 machine code", cubin.len());
    }
}
