//! Quantization: exact round trips on grid data, the scale/2 error bound on random data,
//! and the bytes per token of every codec at SmolLM2-135M's KV shape.

mod common;

use common::*;
use pk_codec::{compressed_bytes_estimate, decode, encode, KvShape, Method, Precision, QuantSpec};
use Precision::*;

fn round_trip(method: &Method, ctx: &pk_codec::KvContext) -> pk_codec::KvContext {
    let bytes = encode(ctx, method, None, &FP).unwrap();
    assert_eq!(
        bytes.len(),
        compressed_bytes_estimate(method, &ctx.shape()),
        "{method:?}"
    );
    decode(&bytes, &FP).unwrap()
}

#[test]
fn grid_data_round_trips_exactly() {
    let precisions = [F16, Q8, Q4, Q2];
    // Shapes with partial token groups, partial channel groups (dim 12, group 8) and odd
    // code counts per packed run (dim 5 at 2 bits).
    let cases = [
        (shape(2, 3, 16, 70), 32u16),
        (shape(1, 2, 12, 19), 8),
        (shape(2, 1, 5, 9), 4),
        (shape(1, 1, 8, 6), 1),
    ];
    for (s, group) in cases {
        for key in precisions {
            for value in precisions {
                for fp_window_tokens in [0, 5, 1000] {
                    let q = QuantSpec {
                        key,
                        value,
                        group_size: group,
                        fp_window_tokens,
                    };
                    let ctx = grid_context(s, &q, 7);
                    let back = round_trip(&Method::Quant(q), &ctx);
                    assert_eq!(back, ctx, "{q:?} {s:?}");
                }
            }
        }
    }
    let ctx = grid_context(shape(2, 2, 8, 33), &QuantSpec::uniform(F16), 3);
    assert_eq!(round_trip(&Method::None, &ctx), ctx);
}

#[test]
fn random_data_error_is_within_half_a_scale_per_group() {
    let s = shape(3, 2, 64, 100); // 100 tokens: three full key groups and a partial one.
    let ctx = random_context(s, 11);
    for p in [Q8, Q4, Q2] {
        for (key, value) in [(p, p), (Q8, p)] {
            let q = QuantSpec::kv(key, value);
            let bytes = encode(&ctx, &Method::Quant(q), None, &FP).unwrap();
            let back = decode(&bytes, &FP).unwrap();
            let payload_start = pk_codec::FIXED_HEADER_BYTES + 4 * s.n_tokens;
            let payload = &bytes[payload_start..bytes.len() - pk_codec::CHECKSUM_BYTES];
            let (k_scales, v_scales) = element_scales(payload, s, &q);
            let mut worst_ratio = 0.0f32;
            for (orig, dec, scales) in [(&ctx.k, &back.k, &k_scales), (&ctx.v, &back.v, &v_scales)]
            {
                for ((&x, &y), &scale) in orig.iter().zip(dec).zip(scales) {
                    let err = (x - y).abs();
                    // f32 rounding of min + code·scale adds at most a few ulps of |x|.
                    assert!(
                        err <= scale / 2.0 + 4.0 * f32::EPSILON * x.abs().max(1.0),
                        "{q:?}: {x} -> {y}, scale {scale}"
                    );
                    worst_ratio = worst_ratio.max(err / scale);
                }
            }
            // Scales are tight: they cover each group's range and not much more.
            let max_range = ctx
                .k
                .iter()
                .chain(&ctx.v)
                .fold(0.0f32, |a, &x| a.max(x.abs()))
                * 2.0;
            assert!(k_scales
                .iter()
                .all(|&s| s <= max_range / common::levels(key) * 1.01));
            println!("{q:?}: max |err| / scale = {worst_ratio:.4}");
        }
    }
}

#[test]
fn keys_are_grouped_per_channel_so_an_outlier_channel_costs_only_itself() {
    // One channel 1000x larger: per-channel key groups keep the others precise.
    let s = shape(1, 1, 8, 32);
    let mut ctx = random_context(s, 5);
    for t in 0..32 {
        ctx.k[t * 8 + 3] *= 1000.0;
    }
    let back = round_trip(&Method::Quant(QuantSpec::uniform(Q4)), &ctx);
    for t in 0..32 {
        for c in (0..8).filter(|&c| c != 3) {
            let i = t * 8 + c;
            assert!(
                (ctx.k[i] - back.k[i]).abs() < 0.2,
                "channel {c} hurt by the outlier channel"
            );
        }
    }
}

#[test]
fn bytes_per_token_at_smollm2_shape() {
    let s = KvShape {
        n_layers: 30,
        n_kv_heads: 3,
        head_dim: 64,
        n_tokens: 256,
    };
    assert_eq!(s.f16_bytes_per_token(), 23_040);
    let overhead_bytes = pk_codec::FIXED_HEADER_BYTES + pk_codec::CHECKSUM_BYTES + 4 * s.n_tokens;
    let payload_per_token =
        |m: Method| (compressed_bytes_estimate(&m, &s) - overhead_bytes) as f64 / 256.0;
    // Per (layer, head, token), head_dim 64, group 32: f16 = 256 B; Q8 = K (64 codes + 8 B
    // of group params amortized over 32 tokens) + V (64 + 2 groups × 4 B) = 144 B; Q4 = 80;
    // Q2 = 48; K8V4 = 112. Times 90 heads.
    assert_eq!(payload_per_token(Method::None), 23_040.0);
    assert_eq!(
        payload_per_token(Method::Quant(QuantSpec::uniform(F16))),
        23_040.0
    );
    assert_eq!(
        payload_per_token(Method::Quant(QuantSpec::uniform(Q8))),
        12_960.0
    );
    assert_eq!(
        payload_per_token(Method::Quant(QuantSpec::uniform(Q4))),
        7_200.0
    );
    assert_eq!(
        payload_per_token(Method::Quant(QuantSpec::uniform(Q2))),
        4_320.0
    );
    assert_eq!(
        payload_per_token(Method::Quant(QuantSpec::kv(Q8, Q4))),
        10_080.0
    );
    // A 32-token f16 window over Q4: 224 tokens at 80 B + 32 at 256 B per head.
    let windowed = QuantSpec {
        fp_window_tokens: 32,
        ..QuantSpec::uniform(Q4)
    };
    assert_eq!(
        payload_per_token(Method::Quant(windowed)),
        (224.0 * 7_200.0 + 32.0 * 23_040.0) / 256.0
    );
}

#[test]
fn f16_input_constructor_matches_f32() {
    let ctx = grid_context(shape(1, 2, 4, 3), &QuantSpec::uniform(F16), 1);
    let half = |xs: &[f32]| {
        xs.iter()
            .map(|&x| half::f16::from_f32(x))
            .collect::<Vec<_>>()
    };
    let from_f16 =
        pk_codec::KvContext::from_f16(1, 2, 4, ctx.positions.clone(), &half(&ctx.k), &half(&ctx.v))
            .unwrap();
    assert_eq!(from_f16, ctx);
}
