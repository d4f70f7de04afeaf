//! The backends' developer switches (`PK_*` environment variables): a bad value is refused
//! before anything loads, with an `error:` line naming the variable and exit status 2,
//! whatever the CPU (some are read only on AMX CPUs or for some models), and a good value
//! passes the check. The kernels read the switches lazily and panicked on a bad value (a
//! backtrace, no `error:` line), or never read them on a CPU that lacks the feature.

use std::process::{Command, Output};

/// `pagekeeper info` on a model that does not exist, with `var=value`: the switch check runs
/// first, so a refused switch fails before the model is looked for.
fn info_with(var: &str, value: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
        .args(["info", "--model", "/nonexistent/switch-test.gguf"])
        .env(var, value)
        .output()
        .expect("running pagekeeper")
}

const BAD: [(&str, &str); 15] = [
    ("PK_Q4K", "q4_0"),
    ("PK_Q6K", "yes"),
    ("PK_ISA", "sse2"),
    ("PK_AMX", "off"),
    ("PK_KVZIP_SCORES_AVX2", "true"),
    ("PK_GEMM_PASS_BYTES", "lots"),
    ("PK_PREFETCH_PLAN", "far-away"),
    ("PK_PREFETCH_FAR_BYTES", "100"),
    ("PK_POOL_SPIN_US", "-1"),
    ("PK_POOL_YIELD_US", "2000000"),
    ("PK_POOL_TUNE", "2"),
    ("PK_DECODE_THREADS", "0"),
    ("PK_CUDA_ACT", "fp32"),
    ("PK_CUDA_GRAPHS", "no"),
    ("PK_CUDA_REQUIRE", "yes"),
];

#[test]
fn a_bad_switch_is_refused_by_name_before_anything_loads() {
    for (var, value) in BAD {
        let o = info_with(var, value);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{var}={value}: {stderr}");
        assert!(
            stderr.starts_with(&format!("error: {var}=\"{value}\"")),
            "{var}={value}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{var}={value}: {stderr}");
    }
}

#[test]
fn a_good_switch_passes_the_check() {
    let good = [
        ("PK_Q4K", "q4_1"),
        ("PK_Q6K", "native"),
        ("PK_AMX", "0"),
        ("PK_KVZIP_SCORES_AVX2", "1"),
        ("PK_GEMM_PASS_BYTES", "0"),
        ("PK_PREFETCH_PLAN", "l2"),
        ("PK_PREFETCH_FAR_BYTES", "8192"),
        ("PK_POOL_SPIN_US", "0"),
        ("PK_POOL_YIELD_US", "1000000"),
        ("PK_POOL_TUNE", "0"),
        ("PK_DECODE_THREADS", "2"),
        ("PK_CUDA_ACT", "bf16"),
        ("PK_CUDA_GRAPHS", "0"),
        ("PK_CUDA_REQUIRE", "0"),
    ];
    for (var, value) in good {
        let o = info_with(var, value);
        let stderr = String::from_utf8_lossy(&o.stderr);
        // The switch passes; the missing model is what fails.
        assert_eq!(o.status.code(), Some(1), "{var}={value}: {stderr}");
        assert!(
            stderr.contains("switch-test.gguf"),
            "{var}={value}: {stderr}"
        );
        assert!(!stderr.contains(var), "{var}={value}: {stderr}");
    }
}
