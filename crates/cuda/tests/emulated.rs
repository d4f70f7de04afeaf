//! The CUDA kernels, unchanged, on the host emulator (`emu/cuda_emu.h`): compiled with the
//! system's C++ compiler and checked against naive references (`emu/emu_test.cpp`). This
//! checks the kernels' logic (indexing, block tables, split-K merging, barriers, warp
//! reductions) on machines without a GPU. It needs x86-64 (the emulator's half conversions
//! use F16C): elsewhere cargo's summary counts it as ignored. On x86-64 it FAILS when the CPU
//! lacks F16C or no C++20 compiler with <barrier> is found (`c++`, or `$CXX`), because a pass
//! that compiled nothing would claim a check that did not happen; the README lists the
//! compiler among what the tests need.

use std::path::{Path, PathBuf};
use std::process::Command;

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// Compiles `src` into `out` with the flags the emulator needs.
fn compile(src: &Path, out: &Path) -> std::io::Result<std::process::Output> {
    Command::new(compiler())
        .args([
            "-std=c++20",
            "-O1",
            "-mf16c",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-o",
        ])
        .arg(out)
        .arg(src)
        .output()
}

#[test]
#[cfg_attr(
    not(target_arch = "x86_64"),
    ignore = "the host emulator needs x86-64 with F16C"
)]
fn kernels_on_the_host_emulator_match_naive_references() {
    #[cfg(target_arch = "x86_64")]
    assert!(
        std::arch::is_x86_feature_detected!("f16c"),
        "this CPU lacks F16C, which the host emulator's half conversions use"
    );
    let dir = std::env::temp_dir().join(format!("pk-cuda-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A compiler that cannot build a C++20 barrier is a missing tool, not a kernel bug: the
    // failure says so, apart from the kernels' own compile errors below.
    let probe = dir.join("probe.cpp");
    std::fs::write(
        &probe,
        "#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n",
    )
    .unwrap();
    match compile(&probe, &dir.join("probe")) {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "{} cannot build a C++20 program with <barrier> (install g++ 11 or later, or set \
             CXX):\n{}",
            compiler(),
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!(
            "no C++ compiler: running `{}` failed ({e}); install g++ 11 or later, or set CXX",
            compiler()
        ),
    }
    let src: PathBuf = [env!("CARGO_MANIFEST_DIR"), "emu", "emu_test.cpp"]
        .iter()
        .collect();
    let exe = dir.join("emu_test");
    let built = compile(&src, &exe).expect("running the C++ compiler");
    assert!(
        built.status.success(),
        "the kernels do not compile on the emulator:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe)
        .output()
        .expect("running the emulated kernels");
    let report = String::from_utf8_lossy(&run.stdout);
    eprintln!("{report}");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        run.status.success(),
        "emulated kernels differ from the references:\n{report}"
    );
}
