//! Scalar dequantisation, exact to ggml's block formats (`ggml-quants.c`, `dequantize_row_*`).
//!
//! These are the reference definitions: fast kernels elsewhere are tested against them.
//! Each function takes whole blocks of raw bytes and writes `n_blocks * block_elems` floats.

use half::{bf16, f16};

use crate::types::GgmlType;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises `data` (a whole number of blocks of `ty`) into `out`.
///
/// Panics if the lengths disagree: callers derive both from a validated tensor info.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    let n_blocks = data.len() / ty.block_bytes();
    assert_eq!(
        data.len(),
        n_blocks * ty.block_bytes(),
        "partial block in {ty} data"
    );
    assert_eq!(
        out.len(),
        n_blocks * ty.block_elems(),
        "output length mismatch for {ty}"
    );
    let bb = ty.block_bytes();
    let be = ty.block_elems();
    for (blk, y) in data.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match ty {
            GgmlType::F32 => y[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
            GgmlType::F16 => y[0] = f16_at(blk, 0),
            GgmlType::BF16 => y[0] = bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            GgmlType::Q4_0 => q4_0(blk, y),
            GgmlType::Q4_1 => q4_1(blk, y),
            GgmlType::Q5_0 => q5_0(blk, y),
            GgmlType::Q8_0 => q8_0(blk, y),
            GgmlType::Q4K => q4_k(blk, y),
            GgmlType::Q6K => q6_k(blk, y),
            GgmlType::Q6S => q6_s(blk, y),
        }
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0f) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((qs[j] as u32 & 0x0f) | xh0) as i32 - 16;
        let x1 = ((qs[j] as u32 >> 4) | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K (and Q5_K) block.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * chunk..32 * chunk + 32];
        let out = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0x0f) as f32 - min1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let ql_all = &b[0..128];
    let qh_all = &b[128..192];
    let sc_all = &b[192..208];
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &ql_all[64 * half..];
        let qh = &qh_all[32 * half..];
        let sc = &sc_all[8 * half..];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// pagekeeper's internal [`GgmlType::Q6S`]: two f16 scales, one per 16 elements, then the
/// low nibbles (as Q4_0's) and 2 high bits per element, four elements a byte.
fn q6_s(b: &[u8], y: &mut [f32]) {
    let (d0, d1) = (f16_at(b, 0), f16_at(b, 2));
    let (ql, qh) = (&b[4..20], &b[20..28]);
    for e in 0..32 {
        let lo = if e < 16 {
            ql[e] & 0x0f
        } else {
            ql[e - 16] >> 4
        };
        let hi = (qh[e / 4] >> (2 * (e % 4))) & 3;
        let q = (lo | (hi << 4)) as i32 - 32;
        y[e] = if e < 16 { d0 } else { d1 } * q as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q4_0_known_block() {
        let mut b = vec![];
        b.extend(h(0.5));
        // Nibble pairs: low nibble j, high nibble 15 - j.
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut y);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(y[j + 16], ((15 - j) as f32 - 8.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_known_block() {
        let mut b = vec![];
        b.extend(h(0.25));
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| j | (3 << 4)));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q4_1, &b, &mut y);
        assert_eq!(y[5], 5.0 * 0.25 - 1.0);
        assert_eq!(y[20], 3.0 * 0.25 - 1.0);
    }

    #[test]
    fn q5_0_high_bits() {
        let mut b = vec![];
        b.extend(h(1.0));
        // High bit set for element 0 and element 16 + 1.
        let qh: u32 = 1 | (1 << 17);
        b.extend(qh.to_le_bytes());
        b.extend([0u8; 16]);
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q5_0, &b, &mut y);
        assert_eq!(y[0], 0.0); // 16 - 16
        assert_eq!(y[1], -16.0);
        assert_eq!(y[17], 0.0);
        assert_eq!(y[16], -16.0);
    }

    #[test]
    fn q8_0_known_block() {
        let mut b = vec![];
        b.extend(h(2.0));
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut y);
        for (j, &yj) in y.iter().enumerate() {
            assert_eq!(yj, (j as f32 - 16.0) * 2.0);
        }
    }

    #[test]
    fn q4_k_scales_unpack() {
        // Scales 0..3 in the low 6 bits, mins in bytes 4..8; sub-blocks 4..8 use the split layout.
        let mut scales = [0u8; 12];
        for j in 0..4 {
            scales[j] = (j as u8 + 1) | (1 << 6); // high bits feed sub-block j+4's scale
            scales[j + 4] = 10 + j as u8;
            scales[j + 8] = 0x21; // low nibble scale 1, high nibble min 2
        }
        // Sub-block 0 reads the low 6 bits only, so byte 0's high bits do not leak in.
        assert_eq!(scale_min_k4(0, &scales), (1, 10));
        // Sub-block 4's scale takes its high bits from byte 0 (set above); its min takes them
        // from byte 4, whose value 10 has both top bits clear, so the min is the nibble alone.
        assert_eq!(scale_min_k4(4, &scales), (1 | (1 << 4), 2));
        let mut b = vec![];
        b.extend(h(1.0));
        b.extend(h(0.5));
        b.extend(scales);
        b.extend([0x21u8; 128]);
        let mut y = [0f32; 256];
        dequantize(GgmlType::Q4K, &b, &mut y);
        assert_eq!(y[0], 1.0 * 1.0 - 0.5 * 10.0);
        assert_eq!(y[32], 2.0 * 2.0 - 0.5 * 11.0);
    }

    #[test]
    fn q6_k_known_values() {
        let mut b = vec![0u8; 210];
        b[0] = 0x0f; // ql[0] low nibble 15 -> element 0, high nibble 0 -> element 64
        b[128] = 0b11; // qh[0] bits 0..2 -> element 0 high bits 3
        for i in 0..16 {
            b[192 + i] = (i as i8 - 8) as u8;
        }
        b[208..210].copy_from_slice(&h(0.5));
        let mut y = [0f32; 256];
        dequantize(GgmlType::Q6K, &b, &mut y);
        assert_eq!(y[0], 0.5 * -8.0 * (63 - 32) as f32);
        assert_eq!(y[64], 0.5 * -4.0 * -32.0);
    }

    #[test]
    fn q6_s_known_values() {
        let mut b = vec![];
        b.extend(h(0.5));
        b.extend(h(-2.0));
        // Element j < 16: low nibble j; element 16 + j: high nibble 15 - j.
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        // High bits of element e: e % 4 (so q = lo + 16 · (e % 4)).
        b.extend([0b11_10_01_00u8; 8]);
        assert_eq!(b.len(), GgmlType::Q6S.block_bytes());
        let mut y = [0f32; 32];
        dequantize(GgmlType::Q6S, &b, &mut y);
        for j in 0..16 {
            assert_eq!(
                y[j],
                ((j + 16 * (j % 4)) as f32 - 32.0) * 0.5,
                "element {j}"
            );
            let e = 16 + j;
            assert_eq!(
                y[e],
                ((15 - j + 16 * (e % 4)) as f32 - 32.0) * -2.0,
                "element {e}"
            );
        }
        assert_eq!(y[0], -16.0);
        assert_eq!(y[31], (0.0 + 48.0 - 32.0) * -2.0);
    }
}
