//! The on-disk entry format: a fixed 64-byte header, then the payload.
//!
//! ```text
//! offset size field
//!      0    8 magic  b"PKTIER\0\x01"
//!      8    4 format version (u32 LE) = 1
//!     12    4 reserved, zero
//!     16   32 chunk key
//!     48    8 payload length in bytes (u64 LE)
//!     56    4 CRC32C of the payload (u32 LE)
//!     60    4 CRC32C of bytes 0..60 (u32 LE)
//! ```
//!
//! NOTE 1: the header has its own checksum so the restart scan can trust the key and length
//! after reading 64 bytes, without reading payloads; the payload checksum is verified on load.
//! NOTE 2: the file length must equal 64 + payload length exactly, which catches truncation
//! (and trailing garbage) at scan time already.

use crate::ChunkKey;

pub const HEADER_LEN: usize = 64;
pub const FORMAT_VERSION: u32 = 1;
const MAGIC: [u8; 8] = *b"PKTIER\0\x01";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryHeader {
    pub key: ChunkKey,
    pub payload_len: u64,
    pub payload_crc32c: u32,
}

impl EntryHeader {
    pub fn for_payload(key: ChunkKey, payload: &[u8]) -> EntryHeader {
        EntryHeader {
            key,
            payload_len: payload.len() as u64,
            payload_crc32c: crc32c::crc32c(payload),
        }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[16..48].copy_from_slice(&self.key.0);
        h[48..56].copy_from_slice(&self.payload_len.to_le_bytes());
        h[56..60].copy_from_slice(&self.payload_crc32c.to_le_bytes());
        let header_crc = crc32c::crc32c(&h[0..60]);
        h[60..64].copy_from_slice(&header_crc.to_le_bytes());
        h
    }

    /// Why a header is rejected, for logs.
    pub fn decode(h: &[u8]) -> Result<EntryHeader, &'static str> {
        if h.len() < HEADER_LEN {
            return Err("shorter than a header");
        }
        if h[0..8] != MAGIC {
            return Err("bad magic");
        }
        if u32::from_le_bytes(h[60..64].try_into().unwrap()) != crc32c::crc32c(&h[0..60]) {
            return Err("header checksum mismatch");
        }
        if u32::from_le_bytes(h[8..12].try_into().unwrap()) != FORMAT_VERSION {
            return Err("unknown format version");
        }
        Ok(EntryHeader {
            key: ChunkKey(h[16..48].try_into().unwrap()),
            payload_len: u64::from_le_bytes(h[48..56].try_into().unwrap()),
            payload_crc32c: u32::from_le_bytes(h[56..60].try_into().unwrap()),
        })
    }

    pub fn file_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload_len
    }
}

/// Why an entry file is not served: each is detected on read or on the open scan, counted,
/// and the file deleted (the chunk is recomputed).
#[derive(Debug, thiserror::Error)]
pub enum Corruption {
    #[error("not an entry file name")]
    NotAnEntry,
    #[error("truncated header")]
    TruncatedHeader,
    #[error("bad header: {0}")]
    BadHeader(&'static str),
    #[error("header names another key")]
    OtherKey,
    #[error("file is {file_bytes} bytes, header says {header_bytes}")]
    Length { file_bytes: u64, header_bytes: u64 },
    #[error("payload checksum mismatch")]
    Checksum,
    #[error("unreadable: {0}")]
    Unreadable(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejections() {
        let h = EntryHeader::for_payload(ChunkKey([7; 32]), b"hello");
        let bytes = h.encode();
        assert_eq!(EntryHeader::decode(&bytes), Ok(h));
        let mut flipped = bytes;
        flipped[50] ^= 1;
        assert_eq!(
            EntryHeader::decode(&flipped),
            Err("header checksum mismatch")
        );
        assert_eq!(
            EntryHeader::decode(&bytes[..10]),
            Err("shorter than a header")
        );
        assert_eq!(EntryHeader::decode(&[0u8; 64]), Err("bad magic"));
    }
}
