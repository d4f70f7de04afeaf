//! Perplexity by llama.cpp's method (`llama-perplexity`), so our numbers compare with its.
//!
//! The token ids are split into consecutive non-overlapping chunks of `n_ctx` tokens; each
//! chunk runs in a fresh sequence, its first token replaced by BOS when the model wants
//! one (`tokenizer.ggml.add_bos_token`: Gemma; not SmolLM2); with `first = n_ctx / 2`, the logits at
//! positions `first ..= n_ctx - 2` are scored against tokens `first + 1 ..= n_ctx - 1`
//! (each predicted from all tokens before it in its chunk). PPL = exp(mean NLL).

use anyhow::{bail, Result};

use crate::engine::Engine;
use crate::sampler::log_prob;

#[derive(Debug, Clone, serde::Serialize)]
pub struct PerplexityResult {
    pub ppl: f64,
    /// Standard error of the estimate, as llama.cpp prints it (± after the value).
    pub ppl_stderr: f64,
    pub n_chunks: usize,
    pub n_ctx: usize,
    pub scored_tokens: usize,
    /// Running PPL after each chunk, like llama.cpp's `[1]…,[2]…` line.
    pub running_ppl: Vec<f64>,
}

pub fn perplexity(
    engine: &mut Engine,
    ids: &[u32],
    n_ctx: usize,
    max_chunks: Option<usize>,
    on_chunk: &mut dyn FnMut(usize, f64),
) -> Result<PerplexityResult> {
    let vocab = engine.model_config().vocab_size;
    let bos = engine
        .tokenizer
        .add_bos()
        .then(|| engine.tokenizer.bos_id())
        .flatten();
    perplexity_with(
        &mut |chunk, first| engine.score(chunk, first),
        vocab,
        bos,
        ids,
        n_ctx,
        max_chunks,
        on_chunk,
    )
}

/// Refuses `--chunks 0`: no chunk scores no token, and the mean NLL would be 0/0, printed
/// as "PPL = NaN". The CLI calls this before loading the model, and so does every run.
pub fn check_max_chunks(max_chunks: Option<usize>) -> Result<()> {
    if max_chunks == Some(0) {
        bail!("--chunks must be at least 1, got 0");
    }
    Ok(())
}

/// Scores a chunk of token ids from a first index: the logits rows of `chunk[first..]`.
pub type ChunkScorer<'a> = dyn FnMut(&[u32], usize) -> Result<Vec<f32>> + 'a;

/// [`perplexity`] over any scorer: `score(chunk, first)` returns the logits rows of
/// `chunk[first..]` computed in a fresh sequence (`vocab` floats each). The CUDA backend
/// scores through this, so both backends are measured by the same code. With `bos`, each
/// chunk's first token is replaced by it, as llama-perplexity does for such models (the
/// scored tokens, all in the chunk's second half, are unchanged).
#[allow(clippy::too_many_arguments)]
pub fn perplexity_with(
    score: &mut ChunkScorer<'_>,
    vocab: usize,
    bos: Option<u32>,
    ids: &[u32],
    n_ctx: usize,
    max_chunks: Option<usize>,
    on_chunk: &mut dyn FnMut(usize, f64),
) -> Result<PerplexityResult> {
    if n_ctx < 4 {
        bail!("--ctx must be at least 4, got {n_ctx}");
    }
    check_max_chunks(max_chunks)?;
    let available = ids.len() / n_ctx;
    if available == 0 {
        bail!(
            "the text has {} tokens, fewer than one chunk of {n_ctx}",
            ids.len()
        );
    }
    let n_chunks = max_chunks.map_or(available, |m| m.min(available));
    let first = n_ctx / 2;
    let (mut nll_sum, mut nll2_sum, mut count) = (0f64, 0f64, 0usize);
    let mut running = Vec::with_capacity(n_chunks);
    for c in 0..n_chunks {
        let mut chunk = ids[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let logits = score(&chunk, first)?;
        for i in 0..n_ctx - 1 - first {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let nll = -log_prob(row, chunk[first + 1 + i]);
            nll_sum += nll;
            nll2_sum += nll * nll;
            count += 1;
        }
        let ppl = (nll_sum / count as f64).exp();
        running.push(ppl);
        on_chunk(c + 1, ppl);
    }
    let mean = nll_sum / count as f64;
    let var = (nll2_sum / count as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    Ok(PerplexityResult {
        ppl,
        ppl_stderr: ppl * (var / (count as f64 - 1.0).max(1.0)).sqrt(),
        n_chunks,
        n_ctx,
        scored_tokens: count,
        running_ppl: running,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores `chunks` of a 4-token context over 3 vocabulary entries with uniform logits.
    fn run(max_chunks: Option<usize>) -> Result<PerplexityResult> {
        let vocab = 3;
        let ids = [0u32, 1, 2, 0, 1, 2, 0, 1];
        let mut uniform =
            |chunk: &[u32], first: usize| Ok(vec![0.0; (chunk.len() - first) * vocab]);
        perplexity_with(
            &mut uniform,
            vocab,
            None,
            &ids,
            4,
            max_chunks,
            &mut |_, _| {},
        )
    }

    #[test]
    fn zero_chunks_is_refused_naming_the_flag() {
        let err = run(Some(0)).unwrap_err().to_string();
        assert_eq!(err, "--chunks must be at least 1, got 0");
    }

    #[test]
    fn uniform_logits_give_the_vocabulary_size() {
        for (max_chunks, n_chunks) in [(Some(1), 1), (None, 2), (Some(5), 2)] {
            let r = run(max_chunks).unwrap();
            assert_eq!(r.n_chunks, n_chunks);
            assert!((r.ppl - 3.0).abs() < 1e-9, "{}", r.ppl);
        }
    }
}
