//! GPT-2's reversible mapping between bytes and printable Unicode characters.
//!
//! Byte-level BPE vocabularies (GPT-2, StarCoder, SmolLM, Llama 3, ...) store tokens as
//! strings in which every byte has been replaced by a visible character, so that a space
//! becomes `Ġ` and a newline `Ċ`. The mapping comes from `bytes_to_unicode()` in OpenAI's
//! `encoder.py`: the 188 printable Latin-1 bytes map to themselves and the remaining 68
//! bytes map, in ascending order, to U+0100 onwards.

/// Whether GPT-2 keeps byte `b` as the character with the same code point.
const fn is_printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// Character for each byte, built at compile time.
const BYTE_TO_CHAR: [char; 256] = {
    let mut table = ['\0'; 256];
    let mut next_extra = 256u32;
    let mut b = 0usize;
    while b < 256 {
        let code = if is_printable(b as u8) {
            b as u32
        } else {
            next_extra += 1;
            next_extra - 1
        };
        // Every code point used here is below U+0200, so the conversion cannot fail.
        table[b] = match char::from_u32(code) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    table
};

/// Byte for each character U+0000..U+01FF (`None` marks characters outside the mapping).
const CHAR_TO_BYTE: [Option<u8>; 512] = {
    let mut table = [None; 512];
    let mut b = 0usize;
    while b < 256 {
        table[BYTE_TO_CHAR[b] as usize] = Some(b as u8);
        b += 1;
    }
    table
};

/// The printable character that stands for byte `b` in a byte-level vocabulary.
pub(crate) fn byte_to_char(b: u8) -> char {
    BYTE_TO_CHAR[b as usize]
}

/// The byte a vocabulary character stands for, or `None` for characters outside the mapping.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    CHAR_TO_BYTE.get(c as usize).copied().flatten()
}

/// Maps raw bytes to the vocabulary's string form (`" hi"` becomes `"Ġhi"`).
pub(crate) fn encode_bytes(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_to_char(b)).collect()
}

/// Reverses [`encode_bytes`] for a token's text. Characters outside the mapping (which a
/// well-formed byte-level vocabulary never contains) are kept as their UTF-8 bytes so that
/// no text silently disappears.
pub(crate) fn decode_token_text(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_matches_gpt2() {
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'\r'), 'č');
        assert_eq!(byte_to_char(b'\t'), 'ĉ');
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(0xAD), 'Ń');
        assert_eq!(byte_to_char(0x00), 'Ā');
    }

    #[test]
    fn mapping_is_a_bijection() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        let distinct: std::collections::HashSet<char> = (0..=255u8).map(byte_to_char).collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(char_to_byte('€'), None);
        assert_eq!(
            decode_token_text(&encode_bytes("héllo\r\n".as_bytes())),
            "héllo\r\n".as_bytes()
        );
    }
}
