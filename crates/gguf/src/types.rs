//! GGML tensor types: ids as written in GGUF files, block geometry, and names.
//!
//! The ids and block layouts follow ggml's `ggml.h` / `ggml-common.h`. Only the types
//! our models use are "supported" (we can dequantise them); the rest are named so that
//! an error message can say what the file contains.

/// A GGML tensor element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
    /// pagekeeper's own 6-bit format, never found in (or written to) a file: Q6_K's quants
    /// regrouped into 32-element blocks that the integer SIMD kernels run directly (see
    /// `pk_model::kquant`). A block is 28 bytes: `d0: f16` @0 scales elements 0..16, `d1:
    /// f16` @2 elements 16..32, `ql[16]` @4 (element `e < 16` in the low nibble of `ql[e]`,
    /// `16 + e` in its high nibble), `qh[8]` @20 (the two high bits of element `e` in bits
    /// `2(e % 4)..2(e % 4) + 2` of byte `e / 4`); `y[e] = d_{e/16} · (q[e] − 32)`, `q` in 0..64.
    /// That is 7 bits a weight.
    Q6S,
}

impl GgmlType {
    /// Maps a type id from the file; unknown or unsupported ids come back as `Err(name)`.
    pub fn from_id(type_id: u32) -> Result<GgmlType, &'static str> {
        Ok(match type_id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            7 => return Err("Q5_1"),
            9 => return Err("Q8_1"),
            10 => return Err("Q2_K"),
            11 => return Err("Q3_K"),
            13 => return Err("Q5_K"),
            15 => return Err("Q8_K"),
            16..=23 => return Err("IQ*"),
            _ => return Err("unknown"),
        })
    }

    /// The GGUF type id; [`GgmlType::Q6S`], which exists only in memory, has none and gives
    /// `u32::MAX` (it is never written to a file).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
            // Internal only: no GGUF id, never written, and `from_id` never yields it.
            GgmlType::Q6S => u32::MAX,
        }
    }

    /// Elements per quantisation block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q6S => 32,
            GgmlType::Q4K | GgmlType::Q6K => 256,
        }
    }

    /// Bytes per quantisation block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4K => 144,
            GgmlType::Q6K => 210,
            GgmlType::Q6S => 28,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::Q6S => "Q6S",
        }
    }

    /// Bytes of a row of `n_elems` elements, or None when the row is not a whole number of blocks.
    pub fn row_bytes(self, n_elems: usize) -> Option<usize> {
        if !n_elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        Some(n_elems / self.block_elems() * self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
