//! CPU compute kernels used by the model code.
//!
//! The model calls only the functions re-exported here; which implementation runs
//! (portable scalar reference or SIMD chosen at run time) is decided inside this module,
//! so faster kernels can replace slow ones without the model code changing.

#[cfg(target_arch = "x86_64")]
mod amx;
pub mod attn;
#[cfg(target_arch = "x86_64")]
pub mod attn512;
#[cfg(target_arch = "x86_64")]
pub mod attn512q;
pub mod hugebuf;
pub mod kv_quant;
mod matmul;
mod ops;
mod pack;
pub mod pool;
mod q8;
mod split_attn;
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

/// Whether this process may execute AMX instructions (CPU, OS and Linux's permission);
/// false off x86-64.
pub fn amx_permitted() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::permitted();
    #[cfg(not(target_arch = "x86_64"))]
    false
}
pub use split_attn::split_attention;
