//! [`StreamDecoder`]: turns a stream of token ids into printable text, one token at a time.
//!
//! A byte-level token can end in the middle of a UTF-8 character (emoji and CJK text are
//! often split across two or three tokens), so printing each token's bytes on its own
//! would show replacement characters. The decoder holds back an incomplete trailing
//! sequence until the next token completes it; bytes that can never become valid UTF-8
//! are replaced by U+FFFD immediately, so the buffer never grows beyond three bytes.

use crate::tokenizer::Tokenizer;

/// Incremental decoder for generated tokens.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds one token and returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.token_bytes(id))
    }

    /// Adds raw bytes and returns the text that is now complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // `from_utf8` already checked this prefix, so the lossy call copies it as is.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete sequence at the end: wait for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Returns whatever is still held back (lossily), e.g. when generation stops mid-character.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_incomplete_characters() {
        let mut d = StreamDecoder::new();
        let euro = "€".as_bytes();
        assert_eq!(d.push_bytes(b"a"), "a");
        assert_eq!(d.push_bytes(&euro[..1]), "");
        assert_eq!(d.push_bytes(&euro[1..2]), "");
        assert_eq!(d.push_bytes(&[euro[2], b'b']), "€b");
        assert_eq!(d.push_bytes(&[0xFF, b'c']), "\u{FFFD}c");
        assert_eq!(d.push_bytes(&euro[..2]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        assert_eq!(d.finish(), "");
    }
}
