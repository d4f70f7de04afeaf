//! CPU compute kernels used by the model code.
//!
//! The model calls only the functions re-exported here; which implementation runs
//! (portable scalar reference or SIMD chosen at run time) is decided inside this module,
//! so faster kernels can replace slow ones without the model code changing.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod amx_kquant;
pub mod attn;
#[cfg(target_arch = "x86_64")]
pub mod attn512;
#[cfg(target_arch = "x86_64")]
pub mod attn512q;
pub mod hugebuf;
pub mod kv_quant;
#[cfg(target_arch = "x86_64")]
mod kvzip_scores;
#[cfg(target_arch = "x86_64")]
mod kvzip_scores512;
mod matmul;
mod ops;
mod pack;
pub mod pool;
mod q8;
mod q8k;
mod silu;
mod split_attn;
pub mod stream;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use matmul::{
    matmul, matmul_isa, matmul_multi, matmul_q8_scalar, matmul_reference, place_in_arena, QMatrix,
};
pub use ops::{
    add_in_place, dot_f32, gelu_mul_in_place, rmsnorm, rmsnorm_rows_in_place, silu_mul_in_place,
    softmax_in_place,
};
pub use q8::Q8Acts;

/// KVzip's scores of one (layer, KV head) on AVX2/FMA; false where the CPU lacks them
/// (and off x86-64), leaving the caller to run `pk_kv::kvzip_unit_pass_scores`.
pub fn kvzip_max_attention(
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    n_queries: usize,
    n_sink: usize,
    chunk_scores: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    return kvzip_scores::kvzip_max_attention(
        keys,
        queries,
        head_dim,
        n_queries,
        n_sink,
        chunk_scores,
    );
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (keys, queries, head_dim, n_queries, n_sink, chunk_scores);
        false
    }
}

/// KVzip's scores of one (layer, KV head) from the chunk's keys and the pass rows'
/// log-sum-exp (`Captures::lse`); false where the CPU lacks the AVX-512 kernel (and off
/// x86-64), leaving the caller to score the whole span.
pub fn kvzip_max_attention_lse(
    chunk_keys: &[f32],
    queries: &[f32],
    lse: &[f32],
    head_dim: usize,
    chunk_scores: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    return kvzip_scores::kvzip_max_attention_lse(chunk_keys, queries, lse, head_dim, chunk_scores);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (chunk_keys, queries, lse, head_dim, chunk_scores);
        false
    }
}

/// Whether this process may execute AMX instructions (CPU, OS and Linux's permission);
/// false off x86-64.
pub fn amx_permitted() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::permitted();
    #[cfg(not(target_arch = "x86_64"))]
    false
}
pub use split_attn::split_attention;

/// A developer switch `name` that takes "0" or "1": `None` when unset. Any other value is
/// refused by name, like the other `PK_*` switches, rather than read as the default.
fn switch_value(name: &str) -> Result<Option<bool>, String> {
    match std::env::var(name).as_deref() {
        Err(_) => Ok(None),
        Ok("0") => Ok(Some(false)),
        Ok("1") => Ok(Some(true)),
        Ok(other) => Err(format!("{name}={other:?} is not \"0\" or \"1\"")),
    }
}

/// [`switch_value`] where a kernel reads it lazily: [`check_switches`] has refused a bad
/// value before any kernel runs in the programs that call it, so the panic is for the rest.
#[cfg(target_arch = "x86_64")]
fn env_switch(name: &str) -> Option<bool> {
    switch_value(name).unwrap_or_else(|e| panic!("{e}"))
}

/// Checks every `PK_*` developer switch the CPU kernels read, as they would read it, so that
/// a program can refuse a bad value with an error naming the variable before any kernel
/// runs. The kernels read their switches lazily, some only on the CPUs or models that use
/// them (`PK_AMX` on an AMX CPU, `PK_Q4K` where a model has Q4_K tensors), and panic on a
/// bad value; this reads them all, on every CPU.
pub fn check_switches() -> Result<(), String> {
    crate::kquant::q4_k_choice()?;
    crate::kquant::q6_k_choice()?;
    pool::check_switches()?;
    switch_value("PK_AMX")?;
    switch_value("PK_KVZIP_SCORES_AVX2")?;
    #[cfg(target_arch = "x86_64")]
    x86::check_switches()?;
    Ok(())
}
