//! Contexts stored with KV cache groups (`KvContext::window`): the grouped container
//! round-trips, drops only the full-attention layers, costs what the estimate says, and
//! refuses every corruption with an error, never a panic.

mod common;

use common::*;
use pk_codec::{
    context_bytes_estimate, decode, decode_into, encode, inspect, CodecError, DropSpec, KvContext,
    Method, Precision, QuantSpec, WindowKv, CHECKSUM_BYTES, GROUPED_MAGIC,
};
use proptest::prelude::*;

const N_TOKENS: usize = 40;
const WINDOW_TOKENS: usize = 9;

/// Six model layers, of which 1, 2, 4 and 5 are sliding-window layers: the main part holds
/// layers 0 and 3 for every token, the window part the last 9 positions.
fn grouped_context() -> KvContext {
    let main = random_context(shape(2, 2, 12, N_TOKENS), 1);
    let main = KvContext::new(2, 2, 12, (0..N_TOKENS as u32).collect(), main.k, main.v).unwrap();
    let tail = random_context(shape(4, 2, 12, WINDOW_TOKENS), 2);
    let first = (N_TOKENS - WINDOW_TOKENS) as u32;
    let tail =
        KvContext::new(4, 2, 12, (first..N_TOKENS as u32).collect(), tail.k, tail.v).unwrap();
    let ctx = KvContext {
        window: Some(Box::new(WindowKv {
            layers: vec![1, 2, 4, 5],
            kv: tail,
        })),
        ..main
    };
    ctx.validate().unwrap();
    ctx
}

fn scores() -> Vec<f32> {
    (0..N_TOKENS).map(|i| ((i * 37) % 11) as f32).collect()
}

fn methods() -> Vec<Method> {
    let q = QuantSpec {
        group_size: 8,
        ..QuantSpec::kv(Precision::Q8, Precision::Q4)
    };
    vec![
        Method::None,
        Method::Quant(q),
        Method::Drop(DropSpec::new(0.5)),
        Method::DropQuant(DropSpec::new(0.3), q),
    ]
}

#[test]
fn uncompressed_round_trip_is_exact() {
    // f32 data through f16 storage: compare against the f16-rounded input.
    let ctx = grouped_context();
    let back = decode(&encode(&ctx, &Method::None, None, &FP).unwrap(), &FP).unwrap();
    let round = |xs: &[f32]| -> Vec<f32> {
        xs.iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect()
    };
    assert_eq!(back.k, round(&ctx.k));
    let (w, bw) = (ctx.window.as_ref().unwrap(), back.window.as_ref().unwrap());
    assert_eq!(bw.layers, w.layers);
    assert_eq!(bw.kv.positions, w.kv.positions);
    assert_eq!(bw.kv.v, round(&w.kv.v));
}

#[test]
fn dropping_touches_only_the_full_attention_layers_and_the_estimate_is_exact() {
    let ctx = grouped_context();
    for m in methods() {
        let bytes = encode(&ctx, &m, Some(&scores()), &FP).unwrap();
        assert_eq!(bytes.len(), context_bytes_estimate(&m, &ctx), "{m:?}");
        assert_eq!(&bytes[..4], &GROUPED_MAGIC);
        let back = decode(&bytes, &FP).unwrap();
        let w = back.window.as_ref().unwrap();
        assert_eq!(
            w.kv.n_tokens(),
            WINDOW_TOKENS,
            "{m:?}: the tail is never dropped"
        );
        assert_eq!(back.n_original_tokens, N_TOKENS);
        let kept = m
            .drop_spec()
            .map_or(N_TOKENS, |d| pk_codec::drop::n_kept_tokens(N_TOKENS, &d));
        assert_eq!(back.n_tokens(), kept, "{m:?}");
        assert_eq!(inspect(&bytes).unwrap().shape.n_layers, 2);
    }
}

#[test]
fn decode_into_reuses_and_clears_the_window_part() {
    let ctx = grouped_context();
    let grouped = encode(&ctx, &Method::None, None, &FP).unwrap();
    let plain_ctx = random_context(shape(2, 2, 12, N_TOKENS), 3);
    let plain = encode(&plain_ctx, &Method::None, None, &FP).unwrap();
    let mut out = decode(&plain, &FP).unwrap();
    decode_into(&grouped, &FP, &mut out).unwrap();
    assert!(out.window.is_some());
    decode_into(&plain, &FP, &mut out).unwrap();
    assert!(
        out.window.is_none(),
        "a one-frame context has no window part"
    );
}

#[test]
fn wrong_model_and_bad_window_parts_are_refused() {
    let bytes = encode(&grouped_context(), &Method::None, None, &FP).unwrap();
    assert_eq!(
        decode(&bytes, &[0; 32]),
        Err(CodecError::FingerprintMismatch)
    );
    let mut ctx = grouped_context();
    ctx.window.as_mut().unwrap().layers = vec![1, 1, 4, 5];
    assert!(
        encode(&ctx, &Method::None, None, &FP).is_err(),
        "repeated layer"
    );
    let mut ctx = grouped_context();
    ctx.n_original_tokens += 1;
    assert!(
        encode(&ctx, &Method::None, None, &FP).is_err(),
        "a tail that does not end at the context's last position"
    );
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = encode(&grouped_context(), &Method::None, None, &FP).unwrap();
    for len in 0..bytes.len() {
        assert!(decode(&bytes[..len], &FP).is_err(), "truncated to {len}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn single_byte_corruptions_are_rejected(which in 0usize..4, at in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let m = methods()[which];
        let mut bytes = encode(&grouped_context(), &m, Some(&scores()), &FP).unwrap();
        let i = at.index(bytes.len());
        bytes[i] ^= xor;
        prop_assert!(decode(&bytes, &FP).is_err());
    }

    #[test]
    fn resealed_edits_never_panic(at in 0usize..64, value in any::<u8>()) {
        // An edit with a recomputed trailer reaches the field checks behind it.
        let mut bytes = encode(&grouped_context(), &Method::None, None, &FP).unwrap();
        let at = at.min(bytes.len() - CHECKSUM_BYTES - 1);
        bytes[at] = value;
        let n = bytes.len() - CHECKSUM_BYTES;
        let sum = blake3::hash(&bytes[..n]);
        bytes[n..].copy_from_slice(sum.as_bytes());
        let _ = decode(&bytes, &FP);
    }
}
