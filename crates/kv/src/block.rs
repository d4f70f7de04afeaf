//! Block identifiers: the two small value types every other module passes around.
//!
//! Design: mistral.rs addresses KV blocks by `u32` indices into one table allocated at
//! start-up, and vLLM v1 names a full block's contents by a chained hash. A `BlockId` is
//! therefore a plain index (no pointer, no `Arc`), and a `BlockHash` is the 32-byte BLAKE3
//! digest produced by [`crate::hash::hash_block`].

use std::fmt;

/// Index of one physical KV block, in `0..BlockPool::num_blocks()`.
///
/// The physical K/V storage (another crate) is indexed by this id, so an id is only
/// meaningful together with the pool that handed it out.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The id as a `usize`, for indexing per-block arrays.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Content hash of one full block, chained over every token before it (see `hash.rs`).
///
/// Two blocks with equal hashes hold the K/V of the same tokens at the same positions
/// after the same prefix, so one can stand in for the other in the prefix cache.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// Lower-case hex of all 32 bytes, for logs and golden tests.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }
}

impl fmt::Debug for BlockHash {
    /// Eight bytes are enough to tell hashes apart in a log line; `to_hex` gives all 32.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({}…)", &self.to_hex()[..16])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_id_orders_by_index() {
        let mut ids = vec![BlockId(3), BlockId(0), BlockId(2)];
        ids.sort();
        assert_eq!(ids, vec![BlockId(0), BlockId(2), BlockId(3)]);
        assert_eq!(BlockId(7).index(), 7);
    }

    #[test]
    fn block_hash_hex_and_debug() {
        let mut bytes = [0u8; 32];
        bytes[0] = 0xab;
        bytes[31] = 0x01;
        let hash = BlockHash(bytes);
        assert_eq!(
            hash.to_hex(),
            "ab00000000000000000000000000000000000000000000000000000000000001"
        );
        assert_eq!(format!("{hash:?}"), "BlockHash(ab00000000000000…)");
    }
}
