//! Shared test helpers: context generators (random, and "on the grid" so that
//! quantization is exactly invertible) and a walker over the documented payload layout.
#![allow(dead_code)]

use half::f16;
use pk_codec::{KvContext, KvShape, Precision, QuantSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const FP: [u8; 32] = [0xAB; 32];

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn shape(n_layers: usize, n_kv_heads: usize, head_dim: usize, n_tokens: usize) -> KvShape {
    KvShape {
        n_layers,
        n_kv_heads,
        head_dim,
        n_tokens,
    }
}

fn context(s: KvShape, k: Vec<f32>, v: Vec<f32>) -> KvContext {
    // Positions with gaps and an offset, so that tests notice if they are renumbered.
    let positions = (0..s.n_tokens as u32).map(|t| 100 + 3 * t).collect();
    KvContext::new(s.n_layers, s.n_kv_heads, s.head_dim, positions, k, v).unwrap()
}

/// Roughly KV-like random data: per-channel offsets and scales (keys have outlier
/// channels), plus uniform noise.
pub fn random_context(s: KvShape, seed: u64) -> KvContext {
    let mut r = rng(seed);
    let mut gen = |outliers: bool| -> Vec<f32> {
        let chan: Vec<(f32, f32)> = (0..s.head_dim)
            .map(|_| {
                let spread = if outliers && r.gen_bool(0.1) {
                    20.0
                } else {
                    1.0
                };
                (r.gen_range(-2.0..2.0), spread)
            })
            .collect();
        (0..s.elements(s.n_tokens))
            .map(|i| {
                let (off, spread) = chan[i % s.head_dim];
                off + spread * r.gen_range(-1.0f32..1.0)
            })
            .collect()
    };
    let k = gen(true);
    let v = gen(false);
    context(s, k, v)
}

/// A value exactly representable in f16 (and so stored losslessly as f16).
fn f16_exact(r: &mut StdRng) -> f32 {
    r.gen_range(-64i32..64) as f32 / 8.0
}

/// Data on the quantization grid of `q`: every group spans exactly `min + [0, levels] ·
/// scale` with dyadic `min` and `scale` (exact in f16 and in f32 arithmetic), so a codec
/// that follows its documented rules must round-trip it bit for bit. F16 sections and the
/// full-precision window get f16-exact values.
pub fn grid_context(s: KvShape, q: &QuantSpec, seed: u64) -> KvContext {
    let mut r = rng(seed);
    let (d, g) = (s.head_dim, q.group_size as usize);
    let n_window = (q.fp_window_tokens as usize).min(s.n_tokens);
    let n_quant = s.n_tokens - n_window;
    let mut k = vec![0.0; s.elements(s.n_tokens)];
    let mut v = vec![0.0; s.elements(s.n_tokens)];
    for (kh, vh) in k
        .chunks_exact_mut(s.n_tokens * d)
        .zip(v.chunks_exact_mut(s.n_tokens * d))
    {
        kh.iter_mut()
            .chain(vh.iter_mut())
            .for_each(|x| *x = f16_exact(&mut r));
        if q.key != Precision::F16 {
            // Keys: a group is (channel, run of g tokens); its first token gets code 0,
            // its second the top code.
            for t0 in (0..n_quant).step_by(g) {
                let len = g.min(n_quant - t0);
                for c in 0..d {
                    let mut codes = grid_codes(&mut r, len, q.key);
                    let (min, scale) = grid_params(&mut r);
                    for (i, code) in codes.drain(..).enumerate() {
                        kh[(t0 + i) * d + c] = min + code as f32 * scale;
                    }
                }
            }
        }
        if q.value != Precision::F16 {
            for row in vh[..n_quant * d].chunks_exact_mut(d) {
                for group in row.chunks_mut(g) {
                    let codes = grid_codes(&mut r, group.len(), q.value);
                    let (min, scale) = grid_params(&mut r);
                    for (x, code) in group.iter_mut().zip(codes) {
                        *x = min + code as f32 * scale;
                    }
                }
            }
        }
    }
    context(s, k, v)
}

fn grid_codes(r: &mut StdRng, len: usize, p: Precision) -> Vec<u32> {
    let levels = (1u32 << p.bits()) - 1;
    let mut codes: Vec<u32> = (0..len).map(|_| r.gen_range(0..=levels)).collect();
    codes[0] = 0;
    if len > 1 {
        codes[1] = levels;
    }
    codes
}

fn grid_params(r: &mut StdRng) -> (f32, f32) {
    (
        r.gen_range(-16i32..16) as f32 / 8.0,
        r.gen_range(1i32..=64) as f32 / 64.0,
    )
}

pub fn levels(p: Precision) -> f32 {
    ((1u32 << p.bits()) - 1) as f32
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The per-group scales stored in `payload`, walked per the layout documented in
/// `format`/`quant`, as `[layer·head][token][channel] -> scale` lookups for K and V
/// (one scale per element, so tests can compare element by element).
pub fn element_scales(payload: &[u8], s: KvShape, q: &QuantSpec) -> (Vec<f32>, Vec<f32>) {
    assert!(q.key != Precision::F16 && q.value != Precision::F16 && q.fp_window_tokens == 0);
    let (d, g, n) = (s.head_dim, q.group_size as usize, s.n_tokens);
    let mut at = 0;
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    for _ in 0..s.n_layers * s.n_kv_heads {
        let mut head = vec![0.0; n * d];
        for t0 in (0..n).step_by(g) {
            let len = g.min(n - t0);
            for c in 0..d {
                let scale = f16_at(payload, at + 2 * d + 2 * c);
                for t in t0..t0 + len {
                    head[t * d + c] = scale;
                }
            }
            at += 4 * d + (len * d * q.key.bits() as usize).div_ceil(8);
        }
        ks.extend(head);
        let n_groups = d.div_ceil(g);
        for _ in 0..n {
            for c in 0..d {
                vs.push(f16_at(payload, at + 2 * n_groups + 2 * (c / g)));
            }
            at += 4 * n_groups + (d * q.value.bits() as usize).div_ceil(8);
        }
    }
    assert_eq!(
        at,
        payload.len(),
        "layout walk must consume the payload exactly"
    );
    (ks, vs)
}
