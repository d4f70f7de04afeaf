//! Property test: every policy, random K/V and queries, random shapes, block sizes, budgets
//! (>= 3 blocks), prompt and decode lengths, with and without prefix-cache sharing of the
//! prompt, driven through `KvCacheManager` by the miniature engine in `common`.
//!
//! After every step the engine asserts: `check_invariants()`; stored tokens <= budget + one
//! block (and <= budget right after an eviction); `next_position` == tokens ever appended;
//! the policy's block state is as long as the table's full blocks; every stored index
//! holds the K/V of the expected position (so compaction moves are checked by content);
//! prefix-cache hits still hold the prompt's K/V. At the end every block is free.
//! Here we add what only a whole run shows: which positions survive.

mod common;

use common::{run, Data, Shape, Sharing, Sim};
use pk_kv::PolicySpec;
use proptest::prelude::*;

/// Deterministic pseudo-random numbers from a key (SplitMix64), so data is a pure
/// function of (seed, position, layer, head, dim) like a model's K/V.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn uniform(key: &[u64]) -> f32 {
    let hash = key.iter().fold(0u64, |h, &k| mix(h ^ k));
    (hash >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

struct RandomData {
    seed: u64,
}

impl Data for RandomData {
    fn kv(&self, position: u64, layer: usize, kv_head: usize, key: &mut [f32], value: &mut [f32]) {
        let id = [self.seed, position, layer as u64, kv_head as u64];
        // Per-token scales spread the norms, so the scores differ.
        let key_scale = 2.0 + 1.9 * uniform(&[id[0], id[1], id[2], id[3], 101]);
        let value_scale = 2.0 + 1.9 * uniform(&[id[0], id[1], id[2], id[3], 102]);
        for (dim, (k, v)) in key.iter_mut().zip(value.iter_mut()).enumerate() {
            *k = key_scale * uniform(&[id[0], id[1], id[2], id[3], dim as u64, 1]);
            *v = value_scale * uniform(&[id[0], id[1], id[2], id[3], dim as u64, 2]);
        }
    }

    fn query(&self, position: u64, layer: usize, head: usize, query: &mut [f32]) {
        for (dim, q) in query.iter_mut().enumerate() {
            *q = 3.0
                * uniform(&[
                    self.seed,
                    position,
                    layer as u64,
                    head as u64,
                    dim as u64,
                    3,
                ]);
        }
    }
}

fn specs() -> Vec<PolicySpec> {
    let mut specs = PolicySpec::all_defaults();
    for name in [
        "streaming-llm:n-sink=1",
        "snapkv:window=5:kernel=3",
        "snapkv:kernel=1",
        "expected-attention:window=7:n-sink=0",
        "paged-eviction:v-norm:local=1",
        "paged-eviction:inv-k-norm:local=4",
    ] {
        specs.push(name.parse().unwrap());
    }
    specs
}

fn sharing_strategy() -> impl Strategy<Value = Sharing> {
    prop_oneof![
        Just(Sharing::None),
        Just(Sharing::SelfCached),
        Just(Sharing::DonorAlive),
        Just(Sharing::DonorFreed),
    ]
}

fn sim_strategy() -> impl Strategy<Value = Sim> {
    (
        (1usize..=2, 1usize..=2, 1usize..=2, 1usize..=4),
        prop_oneof![Just(1u32), Just(2), Just(3), Just(4), Just(8)],
        0u32..=24,
        0u32..=70,
        0u32..=50,
        sharing_strategy(),
    )
        .prop_map(
            |(
                (n_layers, n_kv_heads, group, head_dim),
                block_size,
                extra,
                prompt_len,
                decode_len,
                sharing,
            )| Sim {
                shape: Shape {
                    n_layers,
                    n_kv_heads,
                    n_heads: n_kv_heads * group,
                    head_dim,
                },
                block_size,
                budget: 3 * block_size + extra,
                prompt_len,
                decode_len,
                sharing,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    #[test]
    fn every_policy_respects_the_budget_and_the_invariants(
        spec_index in 0usize..18,
        sim in sim_strategy(),
        seed in any::<u64>(),
    ) {
        let specs = specs();
        let spec = specs[spec_index % specs.len()];
        if let PolicySpec::StreamingLlm { n_sink_tokens: Some(n) } = spec {
            prop_assume!(n <= sim.block_size);
        }
        let trace = run(spec, sim, &RandomData { seed });
        let (t, b) = (sim.prompt_len as u64, sim.block_size as u64);

        // Prefill keeps everything under the budget, and a sorted subset otherwise.
        if !spec.evicts() || t <= sim.budget as u64 {
            prop_assert_eq!(&trace.kept, &(0..t).collect::<Vec<_>>());
        } else {
            prop_assert_eq!(trace.kept.len() as u64, sim.budget as u64);
        }
        // Block-wise policies protect what they promise at prefill.
        let protects_first_block = matches!(spec, PolicySpec::PagedEviction { .. } | PolicySpec::StreamingLlm { n_sink_tokens: None });
        if protects_first_block && t > sim.budget as u64 {
            prop_assert_eq!(&trace.kept[..b as usize], &(0..b).collect::<Vec<_>>()[..]);
        }
        if matches!(spec, PolicySpec::PagedEviction { .. }) && t > sim.budget as u64 {
            let tail = b + t % b;
            let kept_tail = &trace.kept[trace.kept.len() - tail as usize..];
            prop_assert_eq!(kept_tail, &(t - tail..t).collect::<Vec<_>>()[..]);
        }
        // Decode never evicts the partial block or the newest full block, so the newest
        // decode tokens (up to one block plus the partial block) are all still stored.
        let total = t + sim.decode_len as u64;
        let num_stored = trace.stored.len() as u64;
        let newest = (num_stored % b + b).min(sim.decode_len as u64).min(num_stored);
        let stored = &trace.stored;
        prop_assert!(stored.windows(2).all(|p| p[0] < p[1]), "stored positions out of order");
        prop_assert_eq!(&stored[stored.len() - newest as usize..], &(total - newest..total).collect::<Vec<_>>()[..]);
        if !spec.evicts() {
            prop_assert_eq!(stored.len() as u64, total);
        }
    }
}
