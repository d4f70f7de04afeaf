//! Golden traces in the vLLM style: for small hand-made K/V, the exact positions each
//! policy keeps at prefill and the exact order of blocks it evicts during decode.
//!
//! Every run goes through the miniature engine in `common` (prefill, `select_prefill`,
//! `KvCacheManager::compact`, decode, `on_block_filled`, `choose_victim`, `remove_block`),
//! which checks the cache's invariants and contents after every step.
//!
//! Shape: 2 layers, 2 KV heads, 4 query heads (GQA group 2), head_dim 4, B = 4. Prompt of
//! 30 tokens, 16 decode tokens (4 blocks fill), budget 16 unless noted. Decode fills blocks
//! at positions 30..34, 34..38, 38..42 and 42..46; each fill exceeds the budget, so each
//! evicts one block. An eviction is `(table index, first position of the evicted block)`.
//!
//! The expected values were derived by hand (comments) and, for the attention-based
//! policies, checked against an independent float reference.

mod common;

use common::{run, Data, Eviction, FnData, Shape, Sharing, Sim};
use pk_kv::{DenseKv, EvictionPolicy, PolicySpec};

const SHAPE: Shape = Shape {
    n_layers: 2,
    n_kv_heads: 2,
    n_heads: 4,
    head_dim: 4,
};

fn sim(budget: u32) -> Sim {
    Sim {
        shape: SHAPE,
        block_size: 4,
        budget,
        prompt_len: 30,
        decode_len: 16,
        sharing: Sharing::None,
    }
}

fn trace(spec: &str, budget: u32, data: &dyn Data) -> (Vec<u64>, Vec<(usize, u64)>) {
    let spec: PolicySpec = spec.parse().unwrap();
    let trace = run(spec, sim(budget), data);
    let evictions = trace
        .evictions
        .iter()
        .map(
            |&Eviction {
                 index,
                 first_position,
             }| (index, first_position),
        )
        .collect();
    (trace.kept, evictions)
}

fn positions(ranges: &[std::ops::Range<u64>]) -> Vec<u64> {
    ranges.iter().flat_map(|r| r.clone()).collect()
}

// ---------------------------------------------------------------------------------------
// Data set A: norms. Key (‖k‖, 0, 0, 0), value (0, ‖v‖, 0, 0), the same in every head.
// Ratio S = ‖v‖/‖k‖ per position (mean over layers for 13 and 15):
//   0..4: 0.25 (sinks, low on purpose)      24..30: 0.25 (tail, low on purpose)
//   5: 8   9: 4   13: L0 8 / L1 0 = 4   15: L0 4 / L1 2 = 3   10, 18, 20, 22: 2 (exact ties)
//   12: ‖k‖ 8, ‖v‖ 8 (S 1; the largest ‖v‖)   7: ‖k‖ 0.25, ‖v‖ 0.25 (S 1; the smallest ‖k‖)
//   other middle tokens: ‖k‖ 2, ‖v‖ 1 (S 0.5)
// Decode blocks: 30..34 (‖k‖ 1, ‖v‖ 1), 34..38 (1, 3), 38..42 (2, 1), 42..46 (1, 2).
// ---------------------------------------------------------------------------------------

fn norms(position: u64, layer: usize) -> (f32, f32) {
    match position {
        0..=3 => (4.0, 1.0),
        5 => (1.0, 8.0),
        7 => (0.25, 0.25),
        9 => (1.0, 4.0),
        10 | 18 | 20 | 22 => (1.0, 2.0),
        12 => (8.0, 8.0),
        13 if layer == 0 => (1.0, 8.0),
        13 => (1.0, 0.0),
        15 if layer == 0 => (1.0, 4.0),
        15 => (1.0, 2.0),
        4..=23 => (2.0, 1.0),
        24..=29 => (4.0, 1.0),
        30..=33 => (1.0, 1.0),
        34..=37 => (1.0, 3.0),
        38..=41 => (2.0, 1.0),
        _ => (1.0, 2.0),
    }
}

fn norms_data() -> impl Data {
    FnData {
        kv: |position: u64, layer: usize, _: usize, key: &mut [f32], value: &mut [f32]| {
            let (key_norm, value_norm) = norms(position, layer);
            key.copy_from_slice(&[key_norm, 0.0, 0.0, 0.0]);
            value.copy_from_slice(&[0.0, value_norm, 0.0, 0.0]);
        },
        query: |_: u64, _: usize, _: usize, query: &mut [f32]| query.fill(0.0),
    }
}

#[test]
fn paged_eviction_keeps_sink_block_tail_and_highest_ratio() {
    // T = 30, B = 4: tail = B + 30 mod 4 = 6 tokens (24..30). Middle 4..24 keeps
    // C - 2B - 2 = 6: 5 (8), 9 and 13 (4), 15 (3), then of the ties at 2 the lower
    // indices 10 and 18 (20 and 22 dropped).
    let (kept, evictions) = trace("paged-eviction:ratio:global", 16, &norms_data());
    assert_eq!(
        kept,
        vec![0, 1, 2, 3, 5, 9, 10, 13, 15, 18, 24, 25, 26, 27, 28, 29]
    );
    // Block scores: [sinks, 4.5 (5 9 10 13), 1.375 (15 18 24 25), 0.25 (26..30)], then
    // decode blocks 1, 3, 0.5, 2. The newest full block is never a candidate.
    // fill 30: min(4.5, 1.375, 0.25) -> 3 (26) | fill 34: min(4.5, 1.375, 1) -> 3 (30)
    // fill 38: min(4.5, 1.375, 3) -> 2 (15)    | fill 42: min(4.5, 3, 0.5) -> 3 (38)
    assert_eq!(evictions, vec![(3, 26), (3, 30), (2, 15), (3, 38)]);
}

#[test]
fn paged_eviction_v_norm_keeps_large_values() {
    // ‖v‖ in the middle: 5 and 12: 8, 9 and 13: 4, 15: 3, then 10 (2, lowest of the ties).
    let (kept, evictions) = trace("paged-eviction:v-norm:global", 16, &norms_data());
    assert_eq!(
        kept,
        vec![0, 1, 2, 3, 5, 9, 10, 12, 13, 15, 24, 25, 26, 27, 28, 29]
    );
    // Blocks: 5.5 (5 9 10 12), 2.25 (13 15 24 25), 1 (26..30); decode 1, 3, 1, 2.
    // fill 30: -> 3 (26) | fill 34: min(5.5, 2.25, 1) -> 3 (30)
    // fill 38: min(5.5, 2.25, 3) -> 2 (13) | fill 42: min(5.5, 3, 1) -> 3 (38)
    assert_eq!(evictions, vec![(3, 26), (3, 30), (2, 13), (3, 38)]);
}

#[test]
fn paged_eviction_inv_k_norm_keeps_small_keys() {
    // 1/‖k‖ in the middle: 7: 4, then ties at 1 (5 9 10 13 15 18 20 22): 5 9 10 13 15.
    let (kept, evictions) = trace("paged-eviction:inv-k-norm:global", 16, &norms_data());
    assert_eq!(
        kept,
        vec![0, 1, 2, 3, 5, 7, 9, 10, 13, 15, 24, 25, 26, 27, 28, 29]
    );
    // Blocks: 1.75 (5 7 9 10), 0.625 (13 15 24 25), 0.25 (26..30); decode 1, 1, 0.5, 1.
    // fill 30: -> 3 (26) | fill 34: min(1.75, 0.625, 1) -> 2 (13)
    // fill 38: min(1.75, 1, 1) tie -> 2 (30) | fill 42: min(1.75, 1, 0.5) -> 3 (38)
    assert_eq!(evictions, vec![(3, 26), (2, 13), (2, 30), (3, 38)]);
}

#[test]
fn paged_eviction_local_restricts_candidates_to_the_oldest_blocks() {
    let (kept, evictions) = trace("paged-eviction:ratio:local=2", 16, &norms_data());
    assert_eq!(
        kept,
        vec![0, 1, 2, 3, 5, 9, 10, 13, 15, 18, 24, 25, 26, 27, 28, 29]
    );
    // Only table indices 1 and 2 are candidates.
    // fill 30: min(4.5, 1.375) -> 2 (15) | fill 34: min(4.5, 0.25) -> 2 (26)
    // fill 38: min(4.5, 1) -> 2 (30)     | fill 42: min(4.5, 3) -> 2 (34)
    assert_eq!(evictions, vec![(2, 15), (2, 26), (2, 30), (2, 34)]);
}

#[test]
fn paged_eviction_tail_is_last_full_block_plus_partial_block() {
    // T = 31: 31 mod 4 = 3, so the tail is 7 tokens (24..31) and the middle keeps
    // 16 - 8 - 3 = 5: 5, 9, 13, 15, 10. Sinks and tail have the lowest scores of all.
    let kv = DenseKv::from_fn(2, 2, 4, 31, |layer, _, token, key, value| {
        let (key_norm, value_norm) = norms(token as u64, layer);
        let (key_norm, value_norm) = if token == 30 {
            (4.0, 1.0)
        } else {
            (key_norm, value_norm)
        };
        key.copy_from_slice(&[key_norm, 0.0, 0.0, 0.0]);
        value.copy_from_slice(&[0.0, value_norm, 0.0, 0.0]);
    });
    let mut policy = "paged-eviction:ratio"
        .parse::<PolicySpec>()
        .unwrap()
        .build();
    let keep = policy.select_prefill(&kv, None, 16, 4);
    assert_eq!(
        keep,
        vec![0, 1, 2, 3, 5, 9, 10, 13, 15, 24, 25, 26, 27, 28, 29, 30]
    );
    assert_eq!(policy.num_scored_blocks(), 4);
}

/// A prompt of 13 tokens, B = 4, budget 12: keep the first block, the tail (4 + 1 = 5
/// tokens, 8..13) and 3 of the 4 middle tokens 4..8. Middle token `i` has key norm
/// `keys[i - 4]` and value norm `values[i - 4]`; all other tokens have norms 1.
fn prefill_13(spec: &str, keys: [f32; 4], values: [f32; 4]) -> Vec<u32> {
    let kv = DenseKv::from_fn(2, 2, 4, 13, |_, _, token, key, value| {
        let (k, v) = match token {
            4..=7 => (keys[token - 4], values[token - 4]),
            _ => (1.0, 1.0),
        };
        key.copy_from_slice(&[0.0, 0.0, k, 0.0]);
        value.copy_from_slice(&[0.0, 0.0, 0.0, v]);
    });
    let mut policy = spec.parse::<PolicySpec>().unwrap().build();
    policy.select_prefill(&kv, None, 12, 4)
}

#[test]
fn paged_eviction_polarity_drops_the_lowest_score() {
    let all_but_6 = vec![0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12];
    // Ratio: ‖v‖/‖k‖ = 1, 2, 0.5, 3 -> token 6 goes, although its ‖v‖ is not the lowest.
    assert_eq!(
        prefill_13(
            "paged-eviction:ratio",
            [2.0, 1.0, 4.0, 1.0],
            [2.0, 2.0, 2.0, 3.0]
        ),
        all_but_6
    );
    // High ‖v‖ with equal keys is kept; high ‖k‖ with equal values is dropped.
    assert_eq!(
        prefill_13("paged-eviction:ratio", [1.0; 4], [1.0, 2.0, 0.5, 3.0]),
        all_but_6
    );
    assert_eq!(
        prefill_13("paged-eviction:ratio", [1.0, 0.5, 2.0, 0.25], [1.0; 4]),
        all_but_6
    );
    assert_eq!(
        prefill_13("paged-eviction:v-norm", [9.0; 4], [1.0, 2.0, 0.5, 3.0]),
        all_but_6
    );
    assert_eq!(
        prefill_13(
            "paged-eviction:inv-k-norm",
            [1.0, 0.5, 2.0, 0.25],
            [9.0, 0.0, 9.0, 0.0]
        ),
        all_but_6
    );
}

#[test]
fn paged_eviction_averages_over_layers() {
    // Middle tokens 4..8, S per layer (L0, L1): 4 (10, 0), 5 (4, 8), 6 (1, 1), 7 (4.5, 4.5).
    // T = 14: the tail is 4 + 2 tokens (8..14), so budget 12 keeps 2 of them. Layer means 5, 6, 1, 4.5 keep 4 and 5; layer 0 alone
    // would keep 4 and 7, layer 1 alone 5 and 7.
    let kv = DenseKv::from_fn(2, 1, 2, 14, |layer, _, token, key, value| {
        let v = match (token, layer) {
            (4, 0) => 10.0,
            (4, _) => 0.0,
            (5, 0) => 4.0,
            (5, _) => 8.0,
            (7, _) => 4.5,
            _ => 1.0,
        };
        key.copy_from_slice(&[1.0, 0.0]);
        value.copy_from_slice(&[0.0, v]);
    });
    let mut policy = PolicySpec::default().build();
    assert_eq!(
        policy.select_prefill(&kv, None, 14, 4).len(),
        14,
        "T <= budget keeps all"
    );
    let keep = policy.select_prefill(&kv, None, 12, 4);
    assert_eq!(keep, vec![0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]);
}

#[test]
fn knorm_keeps_the_smallest_keys() {
    // -‖k‖: 7 (0.25), the eight ‖k‖ = 1 tokens, then seven of the ‖k‖ = 2 tokens by index.
    // No sink protection at prefill (faithful to the paper).
    let (kept, evictions) = trace("knorm", 16, &norms_data());
    assert_eq!(
        kept,
        vec![4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 20, 22]
    );
    // Blocks: [-1.3125 (4..8), -1.5 (8..12), -1.5 (13..17), -1.25 (17 18 20 22)];
    // decode -1, -1, -2, -1.
    // fill 30: tie -1.5 -> 1 (8)        | fill 34: min(-1.5, -1.25, -1) -> 1 (13)
    // fill 38: min(-1.25, -1, -1) -> 1 (17) | fill 42: min(-1, -1, -2) -> 3 (38)
    assert_eq!(evictions, vec![(1, 8), (1, 13), (1, 17), (3, 38)]);
}

#[test]
fn streaming_llm_keeps_first_block_and_most_recent() {
    let (kept, evictions) = trace("streaming-llm", 16, &norms_data());
    assert_eq!(kept, positions(&[0..4, 18..30]));
    assert_eq!(evictions, vec![(1, 18), (1, 22), (1, 26), (1, 30)]);

    let (kept, evictions) = trace("streaming-llm:n-sink=2", 16, &norms_data());
    assert_eq!(kept, positions(&[0..2, 16..30]));
    // Block 0 is 0 1 16 17 and stays; block 1 (18..22) is the oldest evictable one.
    assert_eq!(evictions, vec![(1, 18), (1, 22), (1, 26), (1, 30)]);
}

#[test]
fn full_cache_keeps_everything() {
    let spec: PolicySpec = "full".parse().unwrap();
    let trace = run(spec, sim(16), &norms_data());
    assert_eq!(trace.kept, (0..30).collect::<Vec<u64>>());
    assert!(trace.evictions.is_empty());
    assert_eq!(trace.stored, (0..46).collect::<Vec<u64>>());
}

// ---------------------------------------------------------------------------------------
// Data set B: key directions, for KeyDiff. Unit keys: -e0 at 5, 6 and 30..34; e1 at 10
// and 38, -e1 at 11 and 39 (adjacent pairs, so the anchor's e1 part is exactly 0); e2 at
// 20; e0 elsewhere. The anchor stays along +e0 (more e0 than -e0 keys are stored at
// every fill), so the score -cos(k, a) is about +1 for -e0, 0 for ±e1, -0.04 for e2 (a
// small e2 part of the prefill anchor) and -1 for e0.
// ---------------------------------------------------------------------------------------

fn directions_data() -> impl Data {
    FnData {
        kv: |position: u64, _: usize, _: usize, key: &mut [f32], value: &mut [f32]| {
            let direction: [f32; 4] = match position {
                5 | 6 | 30..=33 => [-1.0, 0.0, 0.0, 0.0],
                10 | 38 => [0.0, 1.0, 0.0, 0.0],
                11 | 39 => [0.0, -1.0, 0.0, 0.0],
                20 => [0.0, 0.0, 1.0, 0.0],
                _ => [1.0, 0.0, 0.0, 0.0],
            };
            key.copy_from_slice(&direction);
            value.copy_from_slice(&[0.0, 1.0, 0.0, 0.0]);
        },
        query: |_: u64, _: usize, _: usize, query: &mut [f32]| query.fill(0.0),
    }
}

#[test]
fn keydiff_keeps_keys_unlike_the_mean_direction() {
    // 5, 6 (+1), 10, 11 (0), 20 (-0.04), then eleven e0 keys by index.
    let (kept, evictions) = trace("keydiff", 16, &directions_data());
    assert_eq!(kept, positions(&[0..15, 20..21]));
    // Blocks: [sinks, 0 (4 5 6 7), -0.5 (8..12), -0.76 (12 13 14 20)].
    // fill 30 (+1): min(0, -0.5, -0.76) -> 3 (12) | fill 34 (-1): min(0, -0.5, 1) -> 2 (8)
    // fill 38 (-0.5): min(0, 1, -1) -> 3 (34)     | fill 42 (-1): min(0, 1, -0.5) -> 3 (38)
    assert_eq!(evictions, vec![(3, 12), (2, 8), (3, 34), (3, 38)]);
}

// ---------------------------------------------------------------------------------------
// Data set C: attention. Every query is (4, 0, 0, 0); key j is (a_j, 0, 0, 0), so the
// logit is 2·a_j and attention is proportional to exp(2·a_j):
//   a = 3 at 2 and 13 (e^6 = 403), 2 at 7 (55), 2.5 at 21 (148), 1.5 at 26 (20),
//   1 at 14 (7.4), 5 at 35 (22026, a decode token), 0 elsewhere (1).
// Values (0, ‖v‖, 0, 0) with ‖v‖ = 1, except 0.001 at 14.
// ---------------------------------------------------------------------------------------

fn attention_data() -> impl Data {
    FnData {
        kv: |position: u64, _: usize, _: usize, key: &mut [f32], value: &mut [f32]| {
            let salience = match position {
                2 | 13 => 3.0,
                7 => 2.0,
                14 => 1.0,
                21 => 2.5,
                26 => 1.5,
                35 => 5.0,
                _ => 0.0,
            };
            let value_norm = if position == 14 { 0.001 } else { 1.0 };
            key.copy_from_slice(&[salience, 0.0, 0.0, 0.0]);
            value.copy_from_slice(&[0.0, value_norm, 0.0, 0.0]);
        },
        query: |_: u64, _: usize, _: usize, query: &mut [f32]| {
            query.copy_from_slice(&[4.0, 0.0, 0.0, 0.0])
        },
    }
}

#[test]
fn tova_keeps_what_the_newest_query_attends_to() {
    // The six salient tokens, then ten a = 0 tokens by index.
    let (kept, evictions) = trace("tova", 16, &attention_data());
    assert_eq!(kept, positions(&[0..12, 13..15, 21..22, 26..27]));
    // Blocks (÷ Z = 1061): [sinks, 57.6/4 (4..8), 4/4 (8..12), 579/4 (13 14 21 26)].
    // fill 30: -> 2 (8) | fill 34: the 30..34 block (1/Z) -> 3 (30)
    // fill 38: min(4..8, 13.., 34..38 with e^10) -> 1 (4) | fill 42: 38..42 -> 3 (38)
    assert_eq!(evictions, vec![(2, 8), (3, 30), (1, 4), (3, 38)]);
}

#[test]
fn h2o_keeps_heavy_hitters_and_the_recent_half() {
    // Recent: 22..30 (budget / 2). Heavy (attention averaged over the queries that see
    // the token): 2 (0.62), 13 (0.42), 21 (0.14), 7 (0.072), 0 (0.051: the first query
    // sees only token 0), 1 (0.019), 14 (0.0076), 3 (0.0015, earliest of the rest).
    let (kept, evictions) = trace("h2o", 16, &attention_data());
    assert_eq!(kept, positions(&[0..4, 7..8, 13..15, 21..30]));
    // Candidates: table indices below num_full - 2 (the recent half is two blocks).
    // fill 30: min(7 13 14 21: 0.16, 22..26: 0.001) -> 2 (22)
    // fill 34: min(0.16, 26..30: 0.005) -> 2 (26) | fill 38: min(0.16, 30..34) -> 2 (30)
    // fill 42: min(0.16, 34..38: 0.24, the e^10 token) -> 1 (7)
    assert_eq!(evictions, vec![(2, 22), (2, 26), (2, 30), (1, 7)]);
}

#[test]
fn snapkv_keeps_window_and_pooled_neighbours() {
    // Window 8 (22..30) kept; 12 more from 0..22 by max-pooled (kernel 5) attention:
    // e^6 reaches 0..5 and 11..16 (ten tokens, all kept), e^5 (21) reaches 19..22, of
    // which the lower indices 19 and 20 fill the budget: 21 itself loses the tie.
    let (kept, evictions) = trace("snapkv:window=8", 20, &attention_data());
    assert_eq!(kept, positions(&[0..5, 11..16, 19..21, 22..30]));
    // Blocks: [sinks, 4 11 12 13: 0.38, 14 15 19 20: 0.26, 22..26: 0.010, 26..30: 0.015].
    // fill 30: -> 3 (22) | fill 34: 30..34 (0.0004) -> 4 (30)
    // fill 38: 26..30 -> 3 (26) | fill 42: 38..42 -> 4 (38)
    assert_eq!(evictions, vec![(3, 22), (4, 30), (3, 26), (4, 38)]);
}

#[test]
fn expected_attention_weighs_expected_attention_by_value_norm() {
    // Identical queries: μ = q, Σ = 0, so the score is softmax(2·a_j)·‖v_j‖. Sinks 0..4
    // kept; then 13, 21, 7, 26 and eight a = 0 tokens: 14 (tiny ‖v‖) loses to 12.
    let (kept, evictions) = trace("expected-attention", 16, &attention_data());
    assert_eq!(kept, positions(&[0..14, 21..22, 26..27]));
    // Blocks: [sinks, 4..8: 0.0136, 8..12: 0.00094, 12 13 21 26: 0.135].
    // fill 30: -> 2 (8) | fill 34: -> 3 (30) | fill 38: -> 1 (4) | fill 42: -> 3 (38)
    assert_eq!(evictions, vec![(2, 8), (3, 30), (1, 4), (3, 38)]);
}

#[test]
fn expected_attention_uses_the_query_covariance() {
    // Queries alternate ±(0, 4, 0, 0): mean 0, variance 16 along e1. Keys are
    // (0, c_j, 0, 0): the logit is c_j²·16/(2·4) = 2·c_j², so large |c_j| is kept
    // whatever its sign. Tokens 4..8 have c = 0, 2, -2, 1: token 4 (c = 0) and 7 go.
    let kv = DenseKv::from_fn(1, 1, 4, 13, |_, _, token, key, value| {
        let c = match token {
            5 => 2.0,
            6 => -2.0,
            7 => 1.0,
            4 => 0.0,
            _ => 3.0,
        };
        key.copy_from_slice(&[0.0, c, 0.0, 0.0]);
        value.copy_from_slice(&[1.0, 0.0, 0.0, 0.0]);
    });
    let queries = pk_kv::DenseQueries::from_fn(1, 1, 4, (5..13).collect(), |_, _, position, q| {
        let sign = if position % 2 == 0 { 1.0 } else { -1.0 };
        q.copy_from_slice(&[0.0, 4.0 * sign, 0.0, 0.0]);
    });
    let mut policy = "expected-attention".parse::<PolicySpec>().unwrap().build();
    let keep = policy.select_prefill(&kv, Some(&queries), 11, 1);
    assert_eq!(keep, vec![0, 1, 2, 3, 5, 6, 8, 9, 10, 11, 12]);
}

#[test]
fn every_policy_holds_one_score_per_full_block_after_prefill() {
    for spec in PolicySpec::all_defaults() {
        let mut policy: Box<dyn EvictionPolicy> = spec.build();
        let kv = DenseKv::from_fn(1, 1, 2, 23, |_, _, token, key, value| {
            key.copy_from_slice(&[1.0 + token as f32, 0.5]);
            value.copy_from_slice(&[1.0, token as f32]);
        });
        let queries = pk_kv::DenseQueries::from_fn(1, 2, 2, (0..23).collect(), |_, _, _, q| {
            q.copy_from_slice(&[0.1, 0.2])
        });
        // KVzip's scores come from the engine's reconstruction passes: hand some over.
        if spec.reconstruction_chunk_tokens().is_some() {
            policy.set_prior_scores((0..23).map(|t| (t % 7) as f32).collect());
        }
        // 23 tokens under a budget of 18 with B = 4: 18 kept (full keeps 23).
        let keep = policy.select_prefill(&kv, Some(&queries), 18, 4);
        let expected = if spec.evicts() { 18 } else { 23 };
        assert_eq!(keep.len(), expected, "{spec}");
        assert_eq!(policy.num_scored_blocks(), expected / 4, "{spec}");
    }
}
