//! Token dropping through the format: kept tokens, their positions, composition with
//! quantization, and size estimates.

mod common;

use common::*;
use pk_codec::drop::{n_kept_tokens, select_kept_tokens};
use pk_codec::{
    compressed_bytes_estimate, decode, encode, inspect, CodecError, DropSpec, Method, Precision,
    QuantSpec,
};

fn scores(n: usize, seed: u64) -> Vec<f32> {
    use rand::Rng;
    let mut r = rng(seed);
    (0..n).map(|_| r.gen_range(0.0..1.0)).collect()
}

#[test]
fn dropped_context_keeps_original_positions_and_values() {
    let s = shape(2, 3, 8, 100);
    let ctx = grid_context(s, &QuantSpec::uniform(Precision::F16), 1);
    let sc = scores(100, 2);
    for ratio in [0.0, 0.2, 0.5, 0.8, 0.9, 1.0] {
        let spec = DropSpec::new(ratio);
        let bytes = encode(&ctx, &Method::Drop(spec), Some(&sc), &FP).unwrap();
        assert_eq!(
            bytes.len(),
            compressed_bytes_estimate(&Method::Drop(spec), &s)
        );
        let back = decode(&bytes, &FP).unwrap();
        let kept = select_kept_tokens(&sc, &spec);
        assert_eq!(kept.len(), n_kept_tokens(100, &spec));
        assert_eq!(back, ctx.retain_tokens(&kept), "ratio {ratio}");
        assert_eq!(back.n_original_tokens, 100);
        assert_eq!(
            back.positions,
            kept.iter().map(|&t| ctx.positions[t]).collect::<Vec<_>>()
        );
        // The first block and the last block always survive.
        assert_eq!(&back.positions[..16], &ctx.positions[..16]);
        assert_eq!(
            &back.positions[back.positions.len() - 16..],
            &ctx.positions[84..]
        );
    }
}

#[test]
fn drop_then_quantize_equals_quantizing_the_kept_tokens() {
    let s = shape(2, 2, 16, 90);
    let ctx = random_context(s, 3);
    let sc = scores(90, 4);
    let (d, q) = (
        DropSpec::new(0.6),
        QuantSpec::kv(Precision::Q8, Precision::Q4),
    );
    let bytes = encode(&ctx, &Method::DropQuant(d, q), Some(&sc), &FP).unwrap();
    assert_eq!(
        bytes.len(),
        compressed_bytes_estimate(&Method::DropQuant(d, q), &s)
    );
    let kept_ctx = ctx.retain_tokens(&select_kept_tokens(&sc, &d));
    let quantized_kept = decode(
        &encode(&kept_ctx, &Method::Quant(q), None, &FP).unwrap(),
        &FP,
    )
    .unwrap();
    let back = decode(&bytes, &FP).unwrap();
    assert_eq!(
        (back.k, back.v, back.positions),
        (quantized_kept.k, quantized_kept.v, quantized_kept.positions)
    );
    let header = inspect(&bytes).unwrap();
    assert_eq!(header.method, Method::DropQuant(d, q));
    assert_eq!((header.shape.n_tokens, header.n_original_tokens), (36, 90));
}

#[test]
fn dropping_needs_one_score_per_token() {
    let ctx = random_context(shape(1, 1, 4, 20), 1);
    let m = Method::Drop(DropSpec::new(0.5));
    assert_eq!(
        encode(&ctx, &m, None, &FP),
        Err(CodecError::Scores {
            expected_len: 20,
            actual_len: None
        })
    );
    assert_eq!(
        encode(&ctx, &m, Some(&[0.0; 19]), &FP),
        Err(CodecError::Scores {
            expected_len: 20,
            actual_len: Some(19)
        })
    );
}

#[test]
fn invalid_methods_and_contexts_are_errors() {
    let ctx = random_context(shape(1, 1, 4, 20), 1);
    let bad = [
        Method::Drop(DropSpec::new(1.5)),
        Method::Drop(DropSpec::new(f32::NAN)),
        Method::Quant(QuantSpec {
            group_size: 0,
            ..QuantSpec::uniform(Precision::Q4)
        }),
    ];
    for m in bad {
        assert!(
            matches!(
                encode(&ctx, &m, Some(&[0.0; 20]), &FP),
                Err(CodecError::InvalidMethod { .. })
            ),
            "{m:?}"
        );
    }
    let mut short = ctx.clone();
    short.v.pop();
    let mut unordered = ctx.clone();
    unordered.positions.swap(0, 1);
    for c in [short, unordered] {
        assert!(matches!(
            encode(&c, &Method::None, None, &FP),
            Err(CodecError::InvalidContext { .. })
        ));
    }
}

#[test]
fn re_encoding_a_dropped_context_keeps_its_original_length() {
    let ctx = random_context(shape(1, 2, 8, 64), 9);
    let sc = scores(64, 1);
    let dropped = decode(
        &encode(&ctx, &Method::Drop(DropSpec::new(0.5)), Some(&sc), &FP).unwrap(),
        &FP,
    )
    .unwrap();
    let again = encode(
        &dropped,
        &Method::Quant(QuantSpec::uniform(Precision::Q4)),
        None,
        &FP,
    )
    .unwrap();
    let header = inspect(&again).unwrap();
    assert_eq!((header.shape.n_tokens, header.n_original_tokens), (32, 64));
}

#[test]
fn decode_into_reuses_a_context_of_another_shape() {
    let big = random_context(shape(2, 2, 16, 64), 1);
    let small = grid_context(shape(1, 3, 8, 20), &QuantSpec::uniform(Precision::Q4), 2);
    let m = Method::Quant(QuantSpec::uniform(Precision::Q4));
    let mut out = decode(&encode(&big, &m, None, &FP).unwrap(), &FP).unwrap();
    pk_codec::decode_into(&encode(&small, &m, None, &FP).unwrap(), &FP, &mut out).unwrap();
    assert_eq!(out, small);
}
