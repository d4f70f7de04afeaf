//! Chained block hashing for the prefix cache.
//!
//! Design: vLLM v1's `hash_block_tokens` names a full block by
//! `hash(parent_block_hash, block_token_ids, extra_keys)`. Chaining makes the hash of block k
//! cover every token in `[0, (k + 1) * block_size_tokens)`, so equal hashes mean equal
//! prefixes, not merely equal blocks. We use BLAKE3 (keyed by a fixed derive-key context
//! string) instead of Python's `hash` or a seeded hasher, so hashes are identical across
//! processes and machines: no random seed, no `RandomState`.
//!
//! The byte encoding is length-prefixed so that no two different inputs share a byte
//! stream (for example, a token list ending where the extra bytes begin). Changing the
//! encoding changes every hash; the golden test below pins it.

use crate::block::BlockHash;

/// BLAKE3 derive-key context. It separates our hashes from any other BLAKE3 use and
/// carries a version, to be bumped if the encoding below ever changes.
const HASH_CONTEXT: &str = "pagekeeper pk-kv block hash v1";

/// Hashes one block of token ids after its parent block.
///
/// `parent` is the hash of the previous block of the same sequence, or `None` for the first
/// block. `extra` carries anything else the K/V depends on (model id, LoRA id, cache salt);
/// it is hashed into every block so that the chain never crosses between models or tenants.
///
/// The block is usually full, but the function does not require it: the token count is
/// part of the hashed bytes.
pub fn hash_block(parent: Option<&BlockHash>, token_ids: &[u32], extra: &[u8]) -> BlockHash {
    let mut hasher = blake3::Hasher::new_derive_key(HASH_CONTEXT);
    match parent {
        None => {
            hasher.update(&[0u8]);
        }
        Some(parent) => {
            hasher.update(&[1u8]);
            hasher.update(&parent.0);
        }
    }
    hasher.update(&(token_ids.len() as u64).to_le_bytes());
    for token_id in token_ids {
        hasher.update(&token_id.to_le_bytes());
    }
    hasher.update(&(extra.len() as u64).to_le_bytes());
    hasher.update(extra);
    BlockHash(*hasher.finalize().as_bytes())
}

/// Hashes every FULL block of `token_ids`, each chained on the one before.
///
/// A trailing partial block is ignored: its K/V will change as tokens are appended, so it
/// cannot be shared through the prefix cache.
///
/// Panics if `block_size_tokens` is 0.
pub fn hash_prefix_blocks(
    token_ids: &[u32],
    block_size_tokens: u32,
    extra: &[u8],
) -> Vec<BlockHash> {
    assert!(
        block_size_tokens > 0,
        "hash_prefix_blocks: block_size_tokens must be positive"
    );
    let mut block_hashes: Vec<BlockHash> =
        Vec::with_capacity(token_ids.len() / block_size_tokens as usize);
    for block_token_ids in token_ids.chunks_exact(block_size_tokens as usize) {
        let block_hash = hash_block(block_hashes.last(), block_token_ids, extra);
        block_hashes.push(block_hash);
    }
    block_hashes
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pins the byte encoding: if this changes, every cached hash in every deployment
    /// changes with it, which must be a deliberate, versioned decision.
    #[test]
    fn golden_hash_is_stable() {
        let first = hash_block(None, &[1, 2, 3, 4], b"");
        let second = hash_block(Some(&first), &[5, 6, 7, 8], b"model-a");
        assert_eq!(first.to_hex(), GOLDEN_FIRST);
        assert_eq!(second.to_hex(), GOLDEN_SECOND);
    }

    const GOLDEN_FIRST: &str = "c18af664d217b204f367cbe5128db85d624d8e8e1231cbc4e98b01d67ad6f55b";
    const GOLDEN_SECOND: &str = "fd9be2924fa77ff66fc780113d14fb1c6188c9d0f30abb0a51ee32d37061b7de";

    /// Spells out the encoding byte by byte, so the golden values above are explained by
    /// something other than the function under test.
    #[test]
    fn encoding_matches_documented_layout() {
        let parent = BlockHash([7u8; 32]);
        let mut bytes: Vec<u8> = vec![1];
        bytes.extend_from_slice(&[7u8; 32]);
        bytes.extend_from_slice(&2u64.to_le_bytes());
        bytes.extend_from_slice(&[0x10, 0, 0, 0, 0x20, 0x01, 0, 0]); // tokens 16 and 288
        bytes.extend_from_slice(&3u64.to_le_bytes());
        bytes.extend_from_slice(b"abc");
        let expected = blake3::derive_key(HASH_CONTEXT, &bytes);
        assert_eq!(hash_block(Some(&parent), &[16, 288], b"abc").0, expected);

        let mut first_block_bytes: Vec<u8> = vec![0];
        first_block_bytes.extend_from_slice(&1u64.to_le_bytes());
        first_block_bytes.extend_from_slice(&[5, 0, 0, 0]);
        first_block_bytes.extend_from_slice(&0u64.to_le_bytes());
        assert_eq!(
            hash_block(None, &[5], b"").0,
            blake3::derive_key(HASH_CONTEXT, &first_block_bytes)
        );
    }

    #[test]
    fn hash_is_deterministic() {
        assert_eq!(
            hash_block(None, &[10, 20], b"x"),
            hash_block(None, &[10, 20], b"x")
        );
    }

    #[test]
    fn every_input_changes_the_hash() {
        let parent = hash_block(None, &[9], b"");
        let base = hash_block(Some(&parent), &[1, 2], b"m");
        assert_ne!(base, hash_block(None, &[1, 2], b"m"), "parent matters");
        assert_ne!(
            base,
            hash_block(Some(&parent), &[1, 3], b"m"),
            "tokens matter"
        );
        assert_ne!(
            base,
            hash_block(Some(&parent), &[2, 1], b"m"),
            "token order matters"
        );
        assert_ne!(
            base,
            hash_block(Some(&parent), &[1, 2], b"n"),
            "extra matters"
        );
        assert_ne!(
            base,
            hash_block(Some(&parent), &[1, 2], b""),
            "empty extra differs"
        );
    }

    #[test]
    fn encoding_is_unambiguous_between_tokens_and_extra() {
        // Token 1 as little-endian bytes is [1, 0, 0, 0]; moving those bytes from the
        // token list into `extra` must not produce the same hash.
        let tokens_only = hash_block(None, &[7, 1], b"");
        let moved_to_extra = hash_block(None, &[7], &[1, 0, 0, 0]);
        assert_ne!(tokens_only, moved_to_extra);
    }

    #[test]
    fn prefix_blocks_chain_and_skip_partial_tail() {
        let token_ids: Vec<u32> = (0..10).collect();
        let hashes = hash_prefix_blocks(&token_ids, 4, b"e");
        assert_eq!(
            hashes.len(),
            2,
            "10 tokens with block size 4 make 2 full blocks"
        );
        let first = hash_block(None, &[0, 1, 2, 3], b"e");
        let second = hash_block(Some(&first), &[4, 5, 6, 7], b"e");
        assert_eq!(hashes, vec![first, second]);
    }

    #[test]
    fn prefix_hash_depends_on_everything_before() {
        // Same second block, different first block: the second hashes must differ.
        let a = hash_prefix_blocks(&[1, 1, 5, 5], 2, b"");
        let b = hash_prefix_blocks(&[2, 2, 5, 5], 2, b"");
        assert_ne!(a[1], b[1]);
        // A shared first block gives a shared first hash.
        let c = hash_prefix_blocks(&[1, 1, 6, 6], 2, b"");
        assert_eq!(a[0], c[0]);
        assert_ne!(a[1], c[1]);
    }

    #[test]
    fn prefix_of_short_prompt_is_empty() {
        assert!(hash_prefix_blocks(&[1, 2, 3], 4, b"").is_empty());
        assert!(hash_prefix_blocks(&[], 4, b"").is_empty());
    }

    #[test]
    #[should_panic(expected = "block_size_tokens must be positive")]
    fn zero_block_size_panics() {
        hash_prefix_blocks(&[1], 0, b"");
    }
}
