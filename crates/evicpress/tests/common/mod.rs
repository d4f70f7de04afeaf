//! What the store tests share: synthetic KV and a RAM + disk store configuration whose
//! delay model makes the disk a thousand times slower than RAM.

use std::sync::Arc;

use pk_codec::KvContext;
use pk_evicpress::{DelayModel, Grid, Policy, StoreConfig, TierSpec};
use pk_tiers::Tier;

/// A context of `n_tokens` tokens (2 layers, 2 KV heads, head size 16), its K/V a
/// function of `seed`.
pub fn kv(seed: u32, n_tokens: usize) -> KvContext {
    let (layers, heads, dim) = (2, 2, 16);
    let len = layers * heads * n_tokens * dim;
    let f =
        |i: usize, s: u32| (((i as u32).wrapping_mul(2654435761) ^ s) % 1000) as f32 / 500.0 - 1.0;
    KvContext::new(
        layers,
        heads,
        dim,
        (0..n_tokens as u32).collect(),
        (0..len).map(|i| f(i, seed)).collect(),
        (0..len).map(|i| f(i, seed + 7)).collect(),
    )
    .unwrap()
}

/// A store configuration over `ram` and `disk` with logical `capacities_bytes`.
pub fn ram_disk_config(
    (ram, disk): (Arc<dyn Tier>, Arc<dyn Tier>),
    capacities_bytes: [u64; 2],
    grid: &str,
    policy: Policy,
) -> StoreConfig {
    let spec = |n: &str, bw: f64| TierSpec {
        name: n.into(),
        capacity_bytes: 0,
        read_bytes_per_s: bw,
        access_latency_s: 1e-4,
    };
    StoreConfig {
        tiers: vec![ram, disk],
        capacities_bytes: capacities_bytes.to_vec(),
        grid: Grid::parse(grid).unwrap(),
        policy,
        fingerprint: [3; 32],
        delay: DelayModel {
            tiers: vec![spec("ram", 1e10), spec("disk", 1e6)],
            decode_s_per_byte: 0.0,
            restore_s_per_token: 0.0,
            prefill_tokens_per_s: 100.0,
            query_tokens: 8,
        },
        frequency_half_life_s: 60.0,
        reprofile_threshold: 0.1,
        max_pending_bytes: 64 << 20,
        max_queries_per_context: 2,
        copies: pk_evicpress::Copies::MasterAndPlaced,
    }
}
