//! The CUDA C sources of every kernel, and their compilation with NVRTC at run time.
//!
//! Sources live in `kernels/*.cu` and are embedded in the binary; at start-up they are
//! concatenated after `prelude.cu` and compiled once for the device's architecture, with
//! the GEMM operand type (`act_t`) fixed by a define. NVRTC needs no GPU, which is what lets
//! `tests/nvrtc_compile.rs` check every source on a machine without one.

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::{ActDtype, CudaError};

const PRELUDE: &str = include_str!("kernels/prelude.cu");

/// Every source file after the prelude, by name (for error messages).
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("dequant.cu", include_str!("kernels/dequant.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("transfer.cu", include_str!("kernels/transfer.cu")),
];

/// Every `extern "C"` kernel the forward pass loads; a missing one fails at load time.
pub const KERNEL_NAMES: &[&str] = &[
    "rmsnorm",
    "rope",
    "swiglu",
    "embed",
    "argmax_rows",
    "kv_write",
    "rope_kv_write",
    "random_fill",
    "dequant_q4_0",
    "dequant_q4_1",
    "dequant_q8_0",
    "dequant_f16",
    "dequant_bf16",
    "dequant_f32",
    "paged_attention",
    "attn_combine",
    "kv_scatter",
    "kv_gather",
];

/// The whole program text: the prelude, then each source.
pub fn program_source() -> String {
    let mut src = String::from(PRELUDE);
    for (name, text) in SOURCES {
        src.push_str(&format!("\n// ---- {name} ----\n"));
        src.push_str(text);
    }
    src
}

/// NVRTC's virtual architecture for a compute capability. PTX (not machine code) is what we
/// load: the driver compiles it for the exact chip, and NVRTC then need not be newer than
/// the driver's own compiler for the chip's machine code.
pub fn virtual_arch(major: i32, minor: i32) -> Result<&'static str, CudaError> {
    Ok(match (major, minor) {
        (7, 0) => "compute_70",
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => {
            return Err(CudaError::Unsupported(format!(
                "compute capability {major}.{minor}"
            )))
        }
    })
}

/// Compiles the program for `arch` (e.g. "compute_90") with `act` as the GEMM operand type.
pub fn compile(arch: &'static str, act: ActDtype) -> Result<Ptx, CudaError> {
    compile_source(&program_source(), arch, act)
}

/// Compiles `src` as [`compile`] compiles the program (tests give it broken sources).
pub fn compile_source(src: &str, arch: &'static str, act: ActDtype) -> Result<Ptx, CudaError> {
    let mut options = vec!["--std=c++17".to_string()];
    if act == ActDtype::Bf16 {
        options.push("-DPK_ACT_BF16".into());
    }
    // Precise division, square roots and denormals: the kernels are compared with the CPU's
    // f32 arithmetic, and none is bound by those instructions.
    let opts = CompileOptions {
        arch: Some(arch),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(true),
        options,
        name: Some("pagekeeper.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => {
            CudaError::Compile(log.to_string_lossy().into_owned())
        }
        other => CudaError::Compile(other.to_string()),
    })
}

/// The program compiled to machine code for one real architecture (`sm_arch`, e.g.
/// "sm_90"): an ELF cubin. The loader's fallback when the driver refuses the PTX, which
/// happens when the machine's NVRTC is newer than its driver (the driver cannot JIT a newer
/// PTX ISA; minor-version compatibility covers machine code, not PTX).
pub fn compile_cubin(src: &str, sm_arch: &str, act: ActDtype) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    let mut options = vec![
        "--std=c++17".to_string(),
        format!("--gpu-architecture={sm_arch}"),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=true".into(),
    ];
    if act == ActDtype::Bf16 {
        options.push("-DPK_ACT_BF16".into());
    }
    let fail = |what: &str, e: &dyn std::fmt::Display| CudaError::Compile(format!("{what}: {e}"));
    let src_c = std::ffi::CString::new(src).map_err(|e| fail("source", &e))?;
    let name = std::ffi::CString::new("pagekeeper.cu").expect("no NUL");
    let prog =
        result::create_program(&src_c, Some(&name)).map_err(|e| fail("nvrtcCreateProgram", &e))?;
    // SAFETY: `prog` was just created and is destroyed once, below, on every path.
    let out = unsafe {
        let compiled = result::compile_program(prog, &options);
        let out = match compiled {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        std::ffi::CStr::from_ptr(l.as_ptr())
                            .to_string_lossy()
                            .into_owned()
                    })
                    .unwrap_or_default();
                Err(CudaError::Compile(format!("{e}\n{log}")))
            }
            Ok(()) => {
                let mut size = 0usize;
                match sys::nvrtcGetCUBINSize(prog, &mut size) {
                    sys::nvrtcResult::NVRTC_SUCCESS => {
                        let mut cubin = vec![0u8; size];
                        match sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut std::ffi::c_char)
                        {
                            sys::nvrtcResult::NVRTC_SUCCESS => Ok(cubin),
                            e => Err(CudaError::Compile(format!("nvrtcGetCUBIN: {e:?}"))),
                        }
                    }
                    e => Err(CudaError::Compile(format!("nvrtcGetCUBINSize: {e:?}"))),
                }
            }
        };
        let _ = result::destroy_program(prog);
        out
    };
    out
}

/// Whether libnvrtc can be opened (it is loaded on first use; a missing library would
/// otherwise panic inside cudarc).
pub fn nvrtc_available() -> bool {
    // SAFETY: the call takes no arguments and only tries to dlopen libnvrtc by its candidate
    // names, dropping the handle again; loading runs the library's initialisers, as every
    // later use of NVRTC does anyway.
    std::panic::catch_unwind(|| unsafe { cudarc::nvrtc::sys::is_culib_present() }).unwrap_or(false)
}
