//! Weights repacked at load time into groups of 8 interleaved rows, the layout the SIMD
//! integer kernels read (the idea of ggml's `q4_0_8x8` repacking, adapted to our formats).
//!
//! For each group of [`GROUP_ROWS`] rows and each 32-element block, one "group block" holds
//! the 8 rows' f16 scales side by side, then their quants arranged so that one 32-byte load
//! gives 4 consecutive quants of each of the 8 rows (4 bytes per row, rows in order). An
//! integer multiply-add of that vector with 4 activation bytes broadcast to every lane
//! (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`) then accumulates one row per 32-bit lane: no
//! horizontal sums, and the per-block scaling is one vector op for 8 rows.
//!
//! Group block layouts (byte offsets), `d`/`m` are 8 × f16:
//! - Q4_0: `d` @0, nibbles @16 (128 B). Q4_1: `d` @0, `m` @16, nibbles @32 (128 B).
//!   Nibble vector k (k < 4) has row r's original `qs[4k..4k+4]` at bytes `4r..4r+4`, so its
//!   low nibbles are elements `4k..4k+4` and its high nibbles elements `16+4k..16+4k+4`.
//! - Q8_0: `d` @0, bytes @16 (256 B): vector k has row r's elements `4k..4k+4` as `q ^ 0x80`
//!   (unsigned `q + 128`, because `vpdpbusd` wants its first operand unsigned).
//! - Q5_0: `d` @0, nibbles @16 (128 B, laid out as Q4_0's), high bits @144 (32 B): byte
//!   `4r + i` of the high-bit vector holds, in bit `j`, the fifth bit of the element whose
//!   low nibble is in nibble vector `j % 4`'s byte `4r + i` (low nibble for `j < 4`, high
//!   for `j >= 4`), so the kernel rebuilds the unsigned value `q + 16` of unpacked vector
//!   `j` with one shift and mask. Five bits a weight, as in the file: the byte-per-weight
//!   layout used before read 8.5 bits a weight, and decode of a Q5_0 model is bound by the
//!   bytes it reads (Qwen2.5-Coder-0.5B: 267 → 173 MB of its 502 MB a token).
//! - Q6S (pagekeeper's 6-bit format, converted from Q6_K at load): `d0` @0 and `d1` @16
//!   (each 8 × f16: the scales of elements 0..16 and 16..32), nibbles @32 (128 B, laid out
//!   as Q4_0's), then two high-bit vectors, H0 @160 and H1 @192 (32 B each). Byte `4r + i`
//!   of H0 holds, in bits `2j..2j+2` (j < 4), the two high bits of element `4j + i` of row
//!   r, which is the element unpacked vector `j` holds there; H1 does the same for elements
//!   `16 + 4j + i` (unpacked vectors `4 + j`). The kernel so rebuilds the unsigned value
//!   `q` (0..64) of every unpacked vector with one shift and one mask. Seven bits a weight,
//!   with no requantisation: Qwen2.5-Coder-1.5B's Q6_K tensors were converted to Q8_0
//!   before, which read 458 MB a decoded token where the file holds 354 MB.
//!
//! - Q4K (Q4_K run natively, 256-element super-blocks of eight 32-element sub-blocks, each
//!   with a 6-bit scale `sc` and min `m` under the super-block's f16 `d` and `dmin`; a value
//!   is `d·sc·q − dmin·m`): one group block per sub-block, 148 bytes: @0 four bytes of the
//!   super-block's 32-byte scale header (the 8 rows' f16 `d`, then their 8 `dmin`), group
//!   block `j` holding header bytes `4j..4j + 4`, so the header is eight 32-bit loads away;
//!   `sc` @4 and `m` @12 (8 × u8 each, widened from 6 bits), nibbles @20
//!   (128 B, laid out as Q4_1's). 4.625 bits a weight against the file's 4.5 (the 6-bit
//!   fields are widened so that a kernel reads them with one load each) and the 5 of the
//!   Q4_1 blocks Q4_K was converted to before (`kquant`): Qwen2.5-Coder-1.5B reads about
//!   50 MB less a decoded token.
//!
//! - Q6K (Q6_K run natively, 256-element super-blocks of sixteen 16-element sub-blocks,
//!   each with a signed 8-bit scale `sc` under the super-block's f16 `d`; a value is
//!   `d·sc·(q − 32)` with 6-bit `q`): one group block per 32 elements, 210 bytes: @0 two
//!   bytes of the super-block's header (the 8 rows' f16 `d`, group block `j` holding row
//!   `j`'s), the 8 rows' `sc` of elements 0..16 @2 and of 16..32 @10, then six 32-byte
//!   quant vectors B0..B5 @18, three a half. Byte `4r + i` of B`j` (j < 3) holds in its low
//!   six bits element `4j + i` of row r, the one unpacked vector `j` holds there, and in its
//!   top two bits bits `2j..2j + 2` of element `12 + i`'s (unpacked vector 3's); B3..B5 do
//!   the same for elements `16..32` (vectors 4..7). So six of the eight unpacked vectors
//!   are one mask each and the other two eight operations, 22 a group block where nibbles
//!   plus separate high bits (Q6S's layout, which Q6K had before) took 34: on the Zen 4
//!   host one-token Q6_K products were bound by those operations (BENCHMARKS.md, "what
//!   bounds one-thread decode"). 6.5625 bits a weight, as in the file, against Q6S's 7.
//!
//! Every group block but Q4K's is the same size as the 8 original blocks,
//! and [`Packed::row_gguf`] restores a row's original bytes exactly, so the GGUF copy need
//! not be kept. The last group is padded with zero rows (scale 0).

use std::ops::Range;
use std::sync::Arc;

use pk_gguf::GgmlType;

use super::hugebuf::HugeBuf;

pub const GROUP_ROWS: usize = 8;
const QK: usize = 32;

#[derive(Clone)]
pub struct Packed {
    pub ty: GgmlType,
    pub rows: usize,
    pub blocks_per_row: usize,
    data: Bytes,
}

/// Where a packed matrix's bytes live: its own `Vec` after packing, or a range of a
/// huge-page arena shared by all of a model's matrices ([`place_in_arena`]).
#[derive(Clone)]
enum Bytes {
    Own(Vec<u8>),
    Arena(Arc<HugeBuf>, Range<usize>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Own(v) => v,
            Bytes::Arena(buf, r) => &buf[r.clone()],
        }
    }
}

/// Alignment of each matrix in an arena: a cache line, so no line holds two matrices.
const ARENA_ALIGN: usize = 64;

/// Moves the bytes of `mats` into one huge-page buffer, one after another in the given
/// order (callers pass the order the forward pass reads them in, so that a decode step is
/// one long sequential stream), and returns the buffer's size.
pub fn place_in_arena(mats: &mut [&mut Packed]) -> usize {
    let mut starts = Vec::with_capacity(mats.len());
    let mut end = 0usize;
    for m in mats.iter() {
        let start = end.next_multiple_of(ARENA_ALIGN);
        starts.push(start);
        end = start + m.data().len();
    }
    let lens: Vec<usize> = mats.iter().map(|m| m.data().len()).collect();
    // Each matrix's own bytes are taken out (and freed once copied) as the arena is filled.
    let parts = mats.iter_mut().zip(&starts).map(|(m, &start)| {
        let bytes = match std::mem::replace(&mut m.data, Bytes::Own(Vec::new())) {
            Bytes::Own(v) => v,
            Bytes::Arena(buf, r) => buf[r].to_vec(),
        };
        (start, bytes)
    });
    let buf = Arc::new(HugeBuf::from_parts(end, parts));
    for ((m, &start), &len) in mats.iter_mut().zip(&starts).zip(&lens) {
        m.data = Bytes::Arena(buf.clone(), start..start + len);
    }
    end
}

/// Bytes of one group block of `ty`, or `None` when `ty` has no packed layout.
pub fn group_block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 => Some(16 + 128),
        GgmlType::Q4_1 => Some(32 + 128),
        GgmlType::Q8_0 => Some(16 + 256),
        GgmlType::Q5_0 => Some(16 + 128 + 32),
        GgmlType::Q6S => Some(32 + 128 + 64),
        GgmlType::Q4K => Some(Q4K_GROUP_BLOCK_BYTES),
        GgmlType::Q6K => Some(Q6K_GROUP_BLOCK_BYTES),
        _ => None,
    }
}

/// A Q4K group block's bytes, and where its fields start (see the module's comment).
pub const Q4K_GROUP_BLOCK_BYTES: usize = 4 + 8 + 8 + 128;
pub const Q4K_SC_AT: usize = 4;
pub const Q4K_M_AT: usize = 12;
pub const Q4K_QS_AT: usize = 20;
/// Sub-blocks (and so group blocks) per Q4_K super-block, and its bytes in the file.
const Q4K_SUBS: usize = 8;
const Q4K_BLOCK_BYTES: usize = 144;
/// A Q6K group block's bytes, and where its fields start (see the module's comment).
pub const Q6K_GROUP_BLOCK_BYTES: usize = 2 + 8 + 8 + 128 + 64;
pub const Q6K_SC_AT: usize = 2;
pub const Q6K_QS_AT: usize = 18;

impl Packed {
    /// Repacks row-major GGUF blocks; `None` for formats without a packed layout.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, gguf: &[u8]) -> Option<Packed> {
        let gbb = group_block_bytes(ty)?;
        let (bpr, src_bb) = (cols / QK, ty.block_bytes());
        let n_groups = rows.div_ceil(GROUP_ROWS);
        let mut data = vec![0u8; n_groups * bpr * gbb];
        if ty == GgmlType::Q4K || ty == GgmlType::Q6K {
            let pack = if ty == GgmlType::Q4K {
                pack_q4k
            } else {
                pack_q6k
            };
            for r in 0..rows {
                let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
                for s in 0..bpr / Q4K_SUBS {
                    let src = &gguf[(r * bpr / Q4K_SUBS + s) * src_bb..][..src_bb];
                    let at = (g * bpr + s * Q4K_SUBS) * gbb;
                    pack(src, &mut data[at..at + Q4K_SUBS * gbb], lane);
                }
            }
            return Some(Packed {
                ty,
                rows,
                blocks_per_row: bpr,
                data: Bytes::Own(data),
            });
        }
        for r in 0..rows {
            let (g, lane) = (r / GROUP_ROWS, r % GROUP_ROWS);
            for b in 0..bpr {
                let src = &gguf[(r * bpr + b) * src_bb..(r * bpr + b + 1) * src_bb];
                let dst = &mut data[(g * bpr + b) * gbb..(g * bpr + b + 1) * gbb];
                pack_block(ty, src, dst, lane);
            }
        }
        Some(Packed {
            ty,
            rows,
            blocks_per_row: bpr,
            data: Bytes::Own(data),
        })
    }

    /// All group blocks, group after group.
    pub fn data(&self) -> &[u8] {
        self.data.as_slice()
    }

    pub fn group_block_bytes(&self) -> usize {
        group_block_bytes(self.ty).unwrap()
    }

    /// The packed bytes of row group `g` (all its blocks, in order).
    pub fn group(&self, g: usize) -> &[u8] {
        let n = self.blocks_per_row * self.group_block_bytes();
        &self.data()[g * n..(g + 1) * n]
    }

    /// Writes row `r`'s original GGUF bytes into `out` (`blocks_per_row × block_bytes`).
    pub fn row_gguf(&self, r: usize, out: &mut [u8]) {
        let (g, lane, gbb, sbb) = (
            r / GROUP_ROWS,
            r % GROUP_ROWS,
            self.group_block_bytes(),
            self.ty.block_bytes(),
        );
        if self.ty == GgmlType::Q4K || self.ty == GgmlType::Q6K {
            let unpack = if self.ty == GgmlType::Q4K {
                unpack_q4k
            } else {
                unpack_q6k
            };
            for s in 0..self.blocks_per_row / Q4K_SUBS {
                let at = (g * self.blocks_per_row + s * Q4K_SUBS) * gbb;
                let src = &self.data()[at..at + Q4K_SUBS * gbb];
                unpack(src, &mut out[s * sbb..(s + 1) * sbb], lane);
            }
            return;
        }
        for b in 0..self.blocks_per_row {
            let src = &self.data()[(g * self.blocks_per_row + b) * gbb..][..gbb];
            unpack_block(self.ty, src, &mut out[b * sbb..(b + 1) * sbb], lane);
        }
    }
}

/// Moves one GGUF block of row lane `lane` into its places in a group block.
fn pack_block(ty: GgmlType, src: &[u8], dst: &mut [u8], lane: usize) {
    dst[2 * lane..2 * lane + 2].copy_from_slice(&src[0..2]);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (qs, at) = if ty == GgmlType::Q4_1 {
                dst[16 + 2 * lane..18 + 2 * lane].copy_from_slice(&src[2..4]);
                (&src[4..20], 32)
            } else {
                (&src[2..18], 16)
            };
            for k in 0..4 {
                dst[at + 32 * k + 4 * lane..][..4].copy_from_slice(&qs[4 * k..4 * k + 4]);
            }
        }
        GgmlType::Q8_0 => {
            for e in 0..QK {
                dst[16 + 32 * (e / 4) + 4 * lane + e % 4] = src[2 + e] ^ 0x80;
            }
        }
        GgmlType::Q5_0 => {
            let qs = &src[6..22];
            for k in 0..4 {
                dst[16 + 32 * k + 4 * lane..][..4].copy_from_slice(&qs[4 * k..4 * k + 4]);
            }
            let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
            for i in 0..4 {
                dst[Q5_HIGH_AT + 4 * lane + i] = (0..8).fold(0u8, |acc, j| {
                    acc | ((((qh >> q5_element(j, i)) & 1) as u8) << j)
                });
            }
        }
        GgmlType::Q6S => {
            dst[16 + 2 * lane..18 + 2 * lane].copy_from_slice(&src[2..4]);
            for k in 0..4 {
                dst[32 + 32 * k + 4 * lane..][..4].copy_from_slice(&src[4 + 4 * k..8 + 4 * k]);
            }
            // Element e's high bits are bits 2(e % 4).. of qh[e / 4]: element 4j + i (or
            // 16 + 4j + i) sits in qh[j] (or qh[4 + j]) at bits 2i.., and moves to bits 2j..
            // of byte 4·lane + i of H0 (or H1), a 4 × 4 transpose of 2-bit fields.
            let qh = &src[20..28];
            for (h, at) in [Q6_HIGH_AT, Q6_HIGH_AT + 32].into_iter().enumerate() {
                for i in 0..4 {
                    dst[at + 4 * lane + i] = (0..4).fold(0u8, |acc, j| {
                        acc | (((qh[4 * h + j] >> (2 * i)) & 3) << (2 * j))
                    });
                }
            }
        }
        _ => unreachable!("no packed layout for {ty:?}"),
    }
}

/// Where row lane `lane`'s super-block scales (the file block's bytes 0..4: its f16 `d`, then
/// `dmin`) go in the super-block's eight group blocks, as (offset there, byte in the file
/// block): header byte h sits in group block h / 4 at offset h % 4, with `d` at h = 2·lane
/// and `dmin` at 16 + 2·lane.
fn q4k_header_places(lane: usize) -> [(usize, usize); 4] {
    [
        (2 * lane, 0),
        (2 * lane + 1, 1),
        (16 + 2 * lane, 2),
        (17 + 2 * lane, 3),
    ]
    .map(|(h, byte)| (h / 4 * Q4K_GROUP_BLOCK_BYTES + h % 4, byte))
}

/// Moves one Q4_K super-block of row lane `lane` into its places in the super-block's eight
/// group blocks `dst`.
fn pack_q4k(src: &[u8], dst: &mut [u8], lane: usize) {
    let gbb = Q4K_GROUP_BLOCK_BYTES;
    for (at, byte) in q4k_header_places(lane) {
        dst[at] = src[byte];
    }
    let (scales, qs) = (&src[4..16], &src[16..Q4K_BLOCK_BYTES]);
    for sub in 0..Q4K_SUBS {
        let blk = &mut dst[sub * gbb..(sub + 1) * gbb];
        let (sc, m) = pk_gguf::scale_min_k4(sub, scales);
        blk[Q4K_SC_AT + lane] = sc;
        blk[Q4K_M_AT + lane] = m;
        // Sub-block 2j holds the low nibbles of qs[32j..32j + 32], 2j + 1 the high ones; the
        // packed nibble vectors want Q4_1's order (element i < 16 in byte i's low nibble, 16 + i
        // in its high nibble).
        let q = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
        let nib = |l: usize| if sub % 2 == 0 { q[l] & 0x0f } else { q[l] >> 4 };
        for k in 0..4 {
            for i in 0..4 {
                let e = 4 * k + i;
                blk[Q4K_QS_AT + 32 * k + 4 * lane + i] = nib(e) | (nib(16 + e) << 4);
            }
        }
    }
}

/// Moves one Q6_K super-block of row lane `lane` into its places in the super-block's eight
/// group blocks `dst`: its `d` into group block `lane`'s header bytes, then each 32-element
/// block's two scales and its quants in the six vectors the module's comment describes.
fn pack_q6k(src: &[u8], dst: &mut [u8], lane: usize) {
    let gbb = Q6K_GROUP_BLOCK_BYTES;
    dst[lane * gbb..lane * gbb + 2].copy_from_slice(&src[208..210]);
    let q = crate::kquant::q6_k_quants(src);
    for (k, q) in q.chunks_exact(QK).enumerate() {
        let blk = &mut dst[k * gbb..(k + 1) * gbb];
        blk[Q6K_SC_AT + lane] = src[192 + 2 * k];
        blk[Q6K_SC_AT + 8 + lane] = src[193 + 2 * k];
        for (e, &q) in q.iter().enumerate() {
            match q6k_place(e, lane) {
                (at, false) => blk[at] |= q,
                // Vector 3's (7's) three bit pairs go to the top of the half's three vectors.
                (at, true) => {
                    for j in 0..3 {
                        blk[at + 32 * j] |= ((q >> (2 * j)) & 3) << 6;
                    }
                }
            }
        }
    }
}

/// Where element `e` (< 32) of row lane `lane` goes in a Q6K group block: its byte, and
/// `false` if it is that byte's low six bits, or `true` if its three bit pairs are the top
/// two bits of that byte and of the same byte in the half's next two vectors.
fn q6k_place(e: usize, lane: usize) -> (usize, bool) {
    let (half, f) = (e / 16, e % 16);
    let (v, i) = (f / 4, f % 4);
    let first = Q6K_QS_AT + 32 * 3 * half + 4 * lane + i;
    if v < 3 {
        (first + 32 * v, false)
    } else {
        (first, true)
    }
}

/// The exact inverse of [`pack_q6k`].
fn unpack_q6k(src: &[u8], dst: &mut [u8], lane: usize) {
    let gbb = Q6K_GROUP_BLOCK_BYTES;
    dst[208..210].copy_from_slice(&src[lane * gbb..lane * gbb + 2]);
    let mut q = [0u8; 256];
    for k in 0..8 {
        let blk = &src[k * gbb..(k + 1) * gbb];
        dst[192 + 2 * k] = blk[Q6K_SC_AT + lane];
        dst[193 + 2 * k] = blk[Q6K_SC_AT + 8 + lane];
        for e in 0..QK {
            q[32 * k + e] = match q6k_place(e, lane) {
                (at, false) => blk[at] & 0x3f,
                (at, true) => (0..3).map(|j| (blk[at + 32 * j] >> 6) << (2 * j)).sum(),
            };
        }
    }
    // The file's order (see `kquant::q6_k_quants`): each half of 128 takes 64 bytes of `ql`
    // and 32 of `qh`.
    for h in 0..2 {
        for l in 0..32 {
            let e = 128 * h + l;
            dst[64 * h + l] = (q[e] & 0x0f) | ((q[e + 64] & 0x0f) << 4);
            dst[64 * h + l + 32] = (q[e + 32] & 0x0f) | ((q[e + 96] & 0x0f) << 4);
            dst[128 + 32 * h + l] = (q[e] >> 4)
                | ((q[e + 32] >> 4) << 2)
                | ((q[e + 64] >> 4) << 4)
                | ((q[e + 96] >> 4) << 6);
        }
    }
}

/// The exact inverse of [`pack_q4k`]: the 6-bit fields are packed back as Q4_K packs them.
fn unpack_q4k(src: &[u8], dst: &mut [u8], lane: usize) {
    let gbb = Q4K_GROUP_BLOCK_BYTES;
    for (at, byte) in q4k_header_places(lane) {
        dst[byte] = src[at];
    }
    let sc = |j: usize| src[j * gbb + Q4K_SC_AT + lane];
    let m = |j: usize| src[j * gbb + Q4K_M_AT + lane];
    for j in 0..4 {
        dst[4 + j] = sc(j) | ((sc(j + 4) >> 4) << 6);
        dst[8 + j] = m(j) | ((m(j + 4) >> 4) << 6);
        dst[12 + j] = (sc(j + 4) & 0x0f) | ((m(j + 4) & 0x0f) << 4);
    }
    for sub in 0..Q4K_SUBS {
        let blk = &src[sub * gbb..(sub + 1) * gbb];
        let byte = |e: usize| blk[Q4K_QS_AT + 32 * (e % 16 / 4) + 4 * lane + e % 4];
        for l in 0..32 {
            let nib = if l < 16 { byte(l) & 0x0f } else { byte(l) >> 4 };
            let q = &mut dst[16 + 32 * (sub / 2) + l];
            *q = if sub % 2 == 0 {
                (*q & 0xf0) | nib
            } else {
                (*q & 0x0f) | (nib << 4)
            };
        }
    }
}

/// Where a Q6S group block's high-bit vectors start (H0; H1 follows 32 bytes later).
pub const Q6_HIGH_AT: usize = 32 + 128;

/// Where a Q5_0 group block's high-bit vector starts.
pub const Q5_HIGH_AT: usize = 16 + 128;

/// The element of a 32-element block that unpacked vector `j` (0..8) holds at byte `4r + i`:
/// `4j + i` for the low nibbles (`j < 4`), `16 + 4(j − 4) + i` for the high ones.
fn q5_element(j: usize, i: usize) -> usize {
    if j < 4 {
        4 * j + i
    } else {
        16 + 4 * (j - 4) + i
    }
}

/// The exact inverse of [`pack_block`].
fn unpack_block(ty: GgmlType, src: &[u8], dst: &mut [u8], lane: usize) {
    dst[0..2].copy_from_slice(&src[2 * lane..2 * lane + 2]);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (at, qs_at) = if ty == GgmlType::Q4_1 {
                dst[2..4].copy_from_slice(&src[16 + 2 * lane..18 + 2 * lane]);
                (32, 4)
            } else {
                (16, 2)
            };
            for k in 0..4 {
                dst[qs_at + 4 * k..qs_at + 4 * k + 4]
                    .copy_from_slice(&src[at + 32 * k + 4 * lane..][..4]);
            }
        }
        GgmlType::Q8_0 => {
            for e in 0..QK {
                dst[2 + e] = src[16 + 32 * (e / 4) + 4 * lane + e % 4] ^ 0x80;
            }
        }
        GgmlType::Q5_0 => {
            for k in 0..4 {
                dst[6 + 4 * k..6 + 4 * k + 4].copy_from_slice(&src[16 + 32 * k + 4 * lane..][..4]);
            }
            let mut qh = 0u32;
            for i in 0..4 {
                let bits = src[Q5_HIGH_AT + 4 * lane + i];
                for j in 0..8 {
                    qh |= (((bits >> j) & 1) as u32) << q5_element(j, i);
                }
            }
            dst[2..6].copy_from_slice(&qh.to_le_bytes());
        }
        GgmlType::Q6S => {
            dst[2..4].copy_from_slice(&src[16 + 2 * lane..18 + 2 * lane]);
            for k in 0..4 {
                dst[4 + 4 * k..8 + 4 * k].copy_from_slice(&src[32 + 32 * k + 4 * lane..][..4]);
            }
            for (h, at) in [Q6_HIGH_AT, Q6_HIGH_AT + 32].into_iter().enumerate() {
                for j in 0..4 {
                    dst[20 + 4 * h + j] = (0..4).fold(0u8, |acc, i| {
                        acc | (((src[at + 4 * lane + i] >> (2 * j)) & 3) << (2 * i))
                    });
                }
            }
        }
        _ => unreachable!("no packed layout for {ty:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn pack_roundtrips_every_row_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q5_0,
            GgmlType::Q6S,
            GgmlType::Q4K,
            GgmlType::Q6K,
        ] {
            let (rows, cols) = if ty == GgmlType::Q4K || ty == GgmlType::Q6K {
                (19, 768)
            } else {
                assert_eq!(
                    group_block_bytes(ty),
                    Some(GROUP_ROWS * ty.block_bytes()),
                    "{ty:?}"
                );
                (19, 96)
            };
            let mut gguf = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
            rng.fill(&mut gguf[..]);
            let p = Packed::new(ty, rows, cols, &gguf).unwrap();
            let rb = ty.row_bytes(cols).unwrap();
            let mut row = vec![0u8; rb];
            for r in 0..rows {
                p.row_gguf(r, &mut row);
                assert_eq!(row, gguf[r * rb..(r + 1) * rb], "{ty:?} row {r}");
            }
        }
    }

    #[test]
    fn arena_keeps_every_matrix_exact() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let shapes = [
            (GgmlType::Q4_1, 19, 96),
            (GgmlType::Q8_0, 8, 64),
            (GgmlType::Q4_0, 3, 32),
        ];
        let mut mats: Vec<Packed> = shapes
            .iter()
            .map(|&(ty, rows, cols)| {
                let mut gguf = vec![0u8; rows * ty.row_bytes(cols).unwrap()];
                rng.fill(&mut gguf[..]);
                Packed::new(ty, rows, cols, &gguf).unwrap()
            })
            .collect();
        let before: Vec<Vec<u8>> = mats.iter().map(|m| m.data().to_vec()).collect();
        let total = place_in_arena(&mut mats.iter_mut().collect::<Vec<_>>());
        assert!(total >= before.iter().map(|b| b.len()).sum::<usize>());
        for (m, b) in mats.iter().zip(&before) {
            assert_eq!(m.data(), &b[..]);
            assert_eq!(m.data().as_ptr() as usize % ARENA_ALIGN, 0);
        }
    }
}
