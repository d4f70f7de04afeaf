//! Where the model runs (`--device cpu|cuda`): [`check_device`] and the engine on a device
//! ([`engine`]). With `cuda` the engine runs over a `CudaBackend` (pk-cuda, cargo feature
//! `cuda`): the scheduler, prefix cache, eviction policies and tiers are the CPU's, only the
//! forward pass and the KV pool live on the device. Without the feature, every
//! `--device cuda` says how to build it.
//!
//! This file names no command's flags, so every command can build its engine through it;
//! the standalone CUDA paths of `bench perf` and `perplexity` are in gpu.rs.

use std::path::Path;

use pk_engine::{Engine, EngineConfig};

/// What every `--device cuda` says in a binary built without the feature.
pub const NO_FEATURE: &str = "--device cuda needs a binary built with the cuda feature: cargo build --release -p pagekeeper --features cuda";

/// Fails unless `device` can run in this binary (before a server binds its port).
pub fn check_device(device: &str) -> anyhow::Result<()> {
    if device == "cuda" && !cfg!(feature = "cuda") {
        anyhow::bail!(NO_FEATURE);
    }
    Ok(())
}

/// Refuses a bad value of any developer switch the backends read (`PK_*`; the CPU
/// kernels' are listed by `pk_model::kernels::check_switches`, the CUDA backend's here),
/// naming the variable. The backends read them lazily, deep in a run or only on some CPUs,
/// GPUs or models, where a bad value would panic or be read as the default; this reads them
/// all before anything loads, in every binary.
pub fn check_switches() -> anyhow::Result<()> {
    pk_model::kernels::check_switches().map_err(anyhow::Error::msg)?;
    let one_of = |name: &str, allowed: &[&str]| match std::env::var(name) {
        Ok(v) if !allowed.contains(&v.as_str()) => {
            anyhow::bail!("{name}={v:?}: expected one of {}", allowed.join(", "))
        }
        _ => Ok(()),
    };
    one_of("PK_CUDA_ACT", &["f16", "bf16"])?;
    one_of("PK_CUDA_GRAPHS", &["0", "1"])?;
    one_of("PK_CUDA_REQUIRE", &["0", "1"])
}

/// The engine on `device` ("cpu" or "cuda") for a model file.
pub fn engine(device: &str, path: &Path, config: EngineConfig) -> anyhow::Result<Engine> {
    match device {
        "cuda" => cuda_engine(path, config),
        _ => Engine::load(path, config),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_engine(_path: &Path, _config: EngineConfig) -> anyhow::Result<Engine> {
    anyhow::bail!(NO_FEATURE)
}

#[cfg(feature = "cuda")]
use imp::cuda_engine;
#[cfg(feature = "cuda")]
pub use imp::open_gpu;

#[cfg(feature = "cuda")]
mod imp {
    use anyhow::{bail, Context, Result};
    use pk_cuda::{ActDtype, CudaBackend, Gpu};
    use pk_engine::{Engine, EngineConfig};

    /// The engine over a `CudaBackend` on device 0: weights dequantised to f16 GEMM operands
    /// (or `PK_CUDA_ACT`), an f16 KV pool of the engine's geometry.
    pub fn cuda_engine(path: &std::path::Path, config: EngineConfig) -> Result<Engine> {
        let gpu = open_gpu(ActDtype::F16)?;
        Engine::load_with(path, config, |f, geometry, dtype| {
            Ok(Box::new(CudaBackend::from_gguf(gpu, f, geometry, dtype)?))
        })
    }

    /// Opens device 0 with `default` as the GEMM operand type unless `PK_CUDA_ACT` (f16 or
    /// bf16) says otherwise.
    pub fn open_gpu(default: ActDtype) -> Result<Gpu> {
        let act = match std::env::var("PK_CUDA_ACT").as_deref() {
            Ok("f16") => ActDtype::F16,
            Ok("bf16") => ActDtype::Bf16,
            Ok(other) => bail!("PK_CUDA_ACT={other:?}: expected f16 or bf16"),
            Err(_) => default,
        };
        let g = Gpu::new(0, act).context("opening CUDA device 0")?;
        eprintln!(
            "device: {} ({} multiprocessors), GEMM operands {act:?}",
            g.name, g.sm_count
        );
        Ok(g)
    }
}
