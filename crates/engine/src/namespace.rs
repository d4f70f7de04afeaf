//! The one name of "whose KV is this": every block hash of the prefix cache, every chunk key
//! of the tiers and every stored context's codec fingerprint is derived from it.

use pk_model::{KvDtype, KvGroupLayout};

/// The cache namespace of an engine: the model's identity (the file's content hash, see
/// `model_content_id` (engine.rs), so two different GGUFs of the same file name never
/// read each other's KV), the KV dtype, and the backend when it is not the CPU (backends
/// compute K/V with different arithmetic, and a sequence's bits must not depend on where
/// its prefix was computed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheNamespace {
    bytes: Vec<u8>,
}

impl CacheNamespace {
    pub fn new(model_identity: &str, kv_dtype: KvDtype, backend: &str) -> CacheNamespace {
        let mut s = format!("{model_identity}|{kv_dtype:?}");
        if backend != "cpu" {
            s.push('|');
            s.push_str(backend);
        }
        CacheNamespace {
            bytes: s.into_bytes(),
        }
    }

    /// This namespace for an engine that keeps the KV cache groups of `layout`: what a
    /// connector stores then is laid out by group (the full-attention layers of every
    /// chunk, the window layers only where a hit needs them), so it must never be read by
    /// an engine with one table for all layers, nor the reverse, nor under another
    /// grouping. The layout's every field is part of the name.
    pub fn with_kv_groups(&self, layout: &KvGroupLayout) -> CacheNamespace {
        let mut s = format!(
            "|kv-groups|per-block {}|window {}|groups {}|layers",
            layout.layers_per_block, layout.window_tokens, layout.num_window_groups
        );
        for (group, slot) in layout.layer_group.iter().zip(&layout.layer_slot) {
            s.push_str(&format!(" {group}:{slot}"));
        }
        let mut bytes = self.bytes.clone();
        bytes.extend_from_slice(s.as_bytes());
        CacheNamespace { bytes }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The bytes a request's prefix-cache hashes mix in: the namespace and the request's
    /// cache salt, so requests with different salts never share blocks.
    pub fn salted(&self, salt: Option<&str>) -> Vec<u8> {
        let mut bytes = self.bytes.clone();
        if let Some(salt) = salt {
            bytes.extend_from_slice(b"|salt|");
            bytes.extend_from_slice(salt.as_bytes());
        }
        bytes
    }

    /// The codec fingerprint of this namespace's KV: stored payloads carry it, and a payload
    /// with another fingerprint is never decoded into this engine's pool.
    pub fn kv_fingerprint(&self) -> [u8; 32] {
        kv_fingerprint(&self.bytes)
    }
}

/// The codec fingerprint of a namespace given as bytes (see
/// [`CacheNamespace::kv_fingerprint`]).
pub fn kv_fingerprint(namespace: &[u8]) -> [u8; 32] {
    *blake3::hash(namespace).as_bytes()
}
