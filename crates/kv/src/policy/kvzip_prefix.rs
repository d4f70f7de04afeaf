//! How KVzip treats a chat template's prefix (issue 37): the system turn and the user
//! header that every chat prompt starts with, before the context a user sent. The two
//! reference implementations differ here, and both differ from scoring the whole prompt:
//!
//! - `context`: the whole prompt is the context. It is repeated by the reconstruction
//!   passes (template markers included) and scored like any other token; its first
//!   [`KVZIP_SINK_TOKENS`] tokens are the sinks (score 1). pagekeeper's first KVzip.
//! - `kept`: the prefix is not repeated; it is kept whole (score 1) and all of it is the
//!   passes' sinks, in every chunk's softmax. The authors' code (snu-mllab/KVzip,
//!   `attention/score.py`: `key_states[:, :, :self.sink]`, the sink being the system
//!   prompt; only the context after it is scored and pruned).
//! - `kvpress`: the prefix is not repeated; its first [`KVZIP_SINK_TOKENS`] tokens are the
//!   sinks (score 1) and the rest of it scores 0, so a global threshold drops those first
//!   (kvpress 0.5.5's `KVzipPress`: `score_val` starts at 0, the sinks at 1, and the passes
//!   set the scores from `prefix_length` on).
//!
//! A prompt that does not start with the template's prefix (plain text) has none: the three
//! are then the same.

use std::ops::Range;

use super::kvzip::KVZIP_SINK_TOKENS;
use super::kvzip::{kvzip_chunks, kvzip_initial_scores};

/// See the module comment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvzipPrefix {
    #[default]
    Context,
    Kept,
    Kvpress,
}

impl KvzipPrefix {
    pub fn name(self) -> &'static str {
        match self {
            KvzipPrefix::Context => "context",
            KvzipPrefix::Kept => "kept",
            KvzipPrefix::Kvpress => "kvpress",
        }
    }

    pub fn parse(name: &str) -> Option<KvzipPrefix> {
        match name {
            "context" => Some(KvzipPrefix::Context),
            "kept" => Some(KvzipPrefix::Kept),
            "kvpress" => Some(KvzipPrefix::Kvpress),
            _ => None,
        }
    }
}

/// What a KVzip run needs to know besides the context: the chunk size and the treatment
/// of the template prefix. Its scores depend on both, so a score cache keys on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvzipPass {
    pub chunk_tokens: usize,
    pub prefix: KvzipPrefix,
}

impl Default for KvzipPass {
    fn default() -> Self {
        KvzipPass {
            chunk_tokens: super::kvzip::KVZIP_CHUNK_TOKENS,
            prefix: KvzipPrefix::default(),
        }
    }
}

/// A context's plan under `pass`: how many of its first tokens are the template prefix
/// (`template_prefix`, as the model's template and tokenizer write it, matched exactly;
/// 0 under `context` or where the context does not start with it), the chunks the passes
/// repeat, and the scores before any pass (`[layer][kv_head][token]`).
#[derive(Clone, Debug)]
pub struct KvzipPlan {
    pub prefix_tokens: usize,
    pub chunks: Vec<Range<usize>>,
    pub initial_scores: Vec<f32>,
    pass: KvzipPass,
}

impl KvzipPlan {
    pub fn new(
        pass: KvzipPass,
        context: &[u32],
        template_prefix: &[u32],
        (n_layers, n_kv_heads): (usize, usize),
    ) -> KvzipPlan {
        let matched = !template_prefix.is_empty()
            && template_prefix.len() < context.len()
            && context.starts_with(template_prefix);
        let prefix_tokens = match (pass.prefix, matched) {
            (KvzipPrefix::Context, _) | (_, false) => 0,
            _ => template_prefix.len(),
        };
        let mut initial_scores = kvzip_initial_scores(n_layers, n_kv_heads, context.len());
        if pass.prefix == KvzipPrefix::Kept {
            for row in initial_scores.chunks_exact_mut(context.len().max(1)) {
                row[..prefix_tokens].fill(1.0);
            }
        }
        KvzipPlan {
            prefix_tokens,
            chunks: kvzip_chunks(prefix_tokens, context.len(), pass.chunk_tokens),
            initial_scores,
            pass,
        }
    }

    /// The tokens before `chunk` that every query of its pass sees as sinks (the start of
    /// the pass's softmax span; the chunk and the pass's own tokens follow).
    pub fn sink_tokens(&self, chunk: &Range<usize>) -> usize {
        match self.pass.prefix {
            KvzipPrefix::Kept if self.prefix_tokens > 0 => self.prefix_tokens,
            _ => KVZIP_SINK_TOKENS.min(chunk.start),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(prefix: KvzipPrefix, context: &[u32]) -> KvzipPlan {
        let pass = KvzipPass {
            chunk_tokens: 8,
            prefix,
        };
        KvzipPlan::new(pass, context, &[9, 9, 7, 9, 9, 5], (2, 1))
    }

    /// Each treatment's prefix, chunks, first scores and sinks on a chat prompt, and the
    /// three the same on a prompt without the template's prefix.
    #[test]
    fn each_treatment_plans_as_its_reference() {
        let chat: Vec<u32> = [9, 9, 7, 9, 9, 5].into_iter().chain(0..12).collect();
        let context = plan(KvzipPrefix::Context, &chat);
        assert_eq!(context.prefix_tokens, 0);
        assert_eq!(context.chunks, vec![0..8, 8..16, 16..18]);
        assert_eq!(context.initial_scores[..6], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        assert_eq!(context.sink_tokens(&(8..16)), 4);
        assert_eq!(context.sink_tokens(&(0..8)), 0);

        let kept = plan(KvzipPrefix::Kept, &chat);
        assert_eq!(kept.prefix_tokens, 6);
        assert_eq!(kept.chunks, vec![6..14, 14..18]);
        assert_eq!(
            kept.initial_scores[..7],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
        );
        // The second layer's row (18 tokens a row) starts the same.
        assert_eq!(
            kept.initial_scores[18..25],
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
        );
        assert_eq!(kept.sink_tokens(&(6..14)), 6);
        assert_eq!(kept.sink_tokens(&(14..18)), 6);

        let kvpress = plan(KvzipPrefix::Kvpress, &chat);
        assert_eq!(kvpress.prefix_tokens, 6);
        assert_eq!(kvpress.chunks, vec![6..14, 14..18]);
        assert_eq!(
            kvpress.initial_scores[..7],
            [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(kvpress.sink_tokens(&(6..14)), 4);

        let plain: Vec<u32> = (0..12).collect();
        for prefix in [
            KvzipPrefix::Context,
            KvzipPrefix::Kept,
            KvzipPrefix::Kvpress,
        ] {
            let p = plan(prefix, &plain);
            assert_eq!((p.prefix_tokens, p.chunks.clone()), (0, vec![0..8, 8..12]));
            assert_eq!(p.sink_tokens(&(8..12)), 4, "{prefix:?}");
        }
    }

    #[test]
    fn names_round_trip() {
        for prefix in [
            KvzipPrefix::Context,
            KvzipPrefix::Kept,
            KvzipPrefix::Kvpress,
        ] {
            assert_eq!(KvzipPrefix::parse(prefix.name()), Some(prefix));
        }
        assert_eq!(KvzipPrefix::parse("system"), None);
    }
}
