//! The decoder against hostile input: every malformed encoding is a specific `CodecError`,
//! never a panic or an out-of-bounds read. Property tests feed random bytes, single-byte
//! corruptions, truncations, and header edits with a recomputed (valid) checksum.

mod common;

use common::*;
use pk_codec::{
    decode, encode, inspect, CodecError, DropSpec, Method, Precision, QuantSpec, CHECKSUM_BYTES,
    FIXED_HEADER_BYTES, MAGIC,
};
use proptest::prelude::*;

/// Small valid encodings of every method kind.
fn samples() -> Vec<Vec<u8>> {
    let ctx = random_context(shape(2, 2, 12, 40), 1);
    let sc: Vec<f32> = (0..40).map(|i| ((i * 37) % 11) as f32).collect();
    let q = QuantSpec {
        group_size: 8,
        fp_window_tokens: 3,
        ..QuantSpec::kv(Precision::Q4, Precision::Q2)
    };
    let methods = [
        Method::None,
        Method::Quant(QuantSpec::uniform(Precision::Q8)),
        Method::Quant(q),
        Method::Drop(DropSpec::new(0.5)),
        Method::DropQuant(
            DropSpec {
                ratio: 0.3,
                keep_first_tokens: 4,
                keep_last_tokens: 2,
            },
            q,
        ),
    ];
    methods
        .iter()
        .map(|m| encode(&ctx, m, Some(&sc), &FP).unwrap())
        .collect()
}

/// Replaces the checksum trailer with the correct one for the edited bytes, so the edit
/// reaches the field validation behind the checksum.
fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - CHECKSUM_BYTES;
    let sum = blake3::hash(&bytes[..n]);
    bytes[n..].copy_from_slice(sum.as_bytes());
}

#[test]
fn samples_decode() {
    for s in samples() {
        decode(&s, &FP).unwrap();
    }
}

#[test]
fn specific_errors() {
    let good = samples().swap_remove(2);
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    assert!(matches!(
        decode(&bad_magic, &FP),
        Err(CodecError::BadMagic { .. })
    ));

    let mut version = good.clone();
    version[4] = 9;
    assert_eq!(
        decode(&version, &FP),
        Err(CodecError::UnsupportedVersion {
            found: 9,
            supported: 1
        })
    );

    let mut flipped = good.clone();
    flipped[FIXED_HEADER_BYTES + 200] ^= 1;
    assert_eq!(decode(&flipped, &FP), Err(CodecError::ChecksumMismatch));

    assert_eq!(
        decode(&good, &[0; 32]),
        Err(CodecError::FingerprintMismatch)
    );

    let mut longer = good.clone();
    longer.push(0);
    assert!(matches!(
        decode(&longer, &FP),
        Err(CodecError::TrailingBytes { .. })
    ));
    assert!(matches!(
        decode(&good[..good.len() - 1], &FP),
        Err(CodecError::Truncated { .. })
    ));
    assert!(matches!(
        decode(&good[..10], &FP),
        Err(CodecError::Truncated { .. })
    ));

    // Shapes that disagree with the payload, behind a valid checksum: head_dim 12 -> 13
    // (payload length no longer matches), and stored tokens > original tokens.
    let mut dim = good.clone();
    dim[36] = 13;
    reseal(&mut dim);
    assert!(matches!(
        decode(&dim, &FP),
        Err(CodecError::ShapeMismatch { .. })
    ));
    let mut original = good.clone();
    original[44] = 39;
    reseal(&mut original);
    assert!(matches!(
        decode(&original, &FP),
        Err(CodecError::ShapeMismatch { .. })
    ));

    // Unknown tag, bits, reserved byte, and a non-canonical drop field on a quant method.
    for (at, value) in [(6, 9u8), (7, 3), (9, 1), (16, 0x3f)] {
        let mut h = good.clone();
        h[at] = value;
        reseal(&mut h);
        assert!(
            matches!(decode(&h, &FP), Err(CodecError::InvalidHeader { .. })),
            "byte {at} = {value}"
        );
    }
    let mut unordered = good.clone();
    unordered[FIXED_HEADER_BYTES..FIXED_HEADER_BYTES + 8]
        .copy_from_slice(&[5, 0, 0, 0, 5, 0, 0, 0]);
    reseal(&mut unordered);
    assert!(matches!(
        decode(&unordered, &FP),
        Err(CodecError::InvalidHeader {
            field: "positions",
            ..
        })
    ));
}

#[test]
fn every_truncation_is_an_error() {
    for s in samples() {
        for len in 0..s.len() {
            assert!(
                inspect(&s[..len]).is_err(),
                "prefix of {len} bytes accepted"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_are_rejected(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        prop_assert!(decode(&bytes, &FP).is_err());
    }

    #[test]
    fn random_bytes_behind_a_valid_prefix_are_rejected(
        tail in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&1u16.to_le_bytes());
        bytes.extend(tail);
        prop_assert!(decode(&bytes, &FP).is_err());
    }

    #[test]
    fn single_byte_corruptions_are_rejected(which in 0usize..5, at in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let mut s = samples().swap_remove(which);
        let i = at.index(s.len());
        s[i] ^= xor;
        prop_assert!(decode(&s, &FP).is_err());
    }

    /// Header edits behind a valid checksum: anything may be accepted or refused, but
    /// nothing may panic, and whatever is accepted decodes to a consistent context.
    #[test]
    fn resealed_header_edits_never_panic(which in 0usize..5, at in 0usize..FIXED_HEADER_BYTES + 16, value in any::<u8>()) {
        let mut s = samples().swap_remove(which);
        s[at] = value;
        reseal(&mut s);
        if let Ok(ctx) = decode(&s, &FP) {
            prop_assert!(ctx.validate().is_ok());
        }
    }
}
