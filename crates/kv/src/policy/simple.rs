//! The two policies that need no scores: the full cache, and StreamingLLM's sinks plus a
//! recent window. They count full blocks only, to keep the block-state invariant.

use super::{validate_budget, EvictionPolicy, KvView, PolicySpec, QueryView};

/// Counts a table's full blocks, with the checks every policy makes.
#[derive(Debug, Default)]
struct FullBlocks {
    count: usize,
}

impl FullBlocks {
    fn filled(
        &mut self,
        policy: &PolicySpec,
        kv: &dyn KvView,
        block_size: usize,
        block_index: usize,
    ) {
        assert!(
            block_size > 0,
            "{policy}: on_block_filled before select_prefill"
        );
        assert!(
            block_index >= self.count,
            "{policy}: block {block_index} is already scored ({} full blocks scored)",
            self.count
        );
        assert!(
            (block_index + 1) * block_size <= kv.n_tokens(),
            "{policy}: block {block_index} is not full ({} tokens stored)",
            kv.n_tokens()
        );
        self.count = block_index + 1;
    }

    fn removed(&mut self, policy: &PolicySpec, block_index: usize) {
        assert!(
            block_index < self.count,
            "{policy}: block {block_index} removed, but only {} full blocks are scored",
            self.count
        );
        self.count -= 1;
    }
}

/// No eviction: every token is kept and no block is ever a victim. The budget is ignored.
#[derive(Debug, Default)]
pub(crate) struct FullCache {
    blocks: FullBlocks,
    block_size_tokens: usize,
}

impl EvictionPolicy for FullCache {
    fn spec(&self) -> PolicySpec {
        PolicySpec::Full
    }

    fn select_prefill(
        &mut self,
        kv: &dyn KvView,
        _queries: Option<&dyn QueryView>,
        _budget_tokens: u32,
        block_size_tokens: u32,
    ) -> Vec<u32> {
        assert!(block_size_tokens > 0, "full: block size must be positive");
        self.block_size_tokens = block_size_tokens as usize;
        self.blocks.count = kv.n_tokens() / self.block_size_tokens;
        (0..kv.n_tokens() as u32).collect()
    }

    fn on_block_filled(&mut self, kv: &dyn KvView, _: Option<&dyn QueryView>, block_index: usize) {
        self.blocks
            .filled(&PolicySpec::Full, kv, self.block_size_tokens, block_index);
    }

    fn choose_victim(&self, _num_blocks: usize) -> Option<usize> {
        None
    }

    fn on_block_removed(&mut self, block_index: usize) {
        self.blocks.removed(&PolicySpec::Full, block_index);
    }

    fn num_scored_blocks(&self) -> usize {
        self.blocks.count
    }
}

/// StreamingLLM (arXiv 2309.17453), block-wise: attention sinks plus the most recent
/// tokens. Prefill keeps the first `n_sink_tokens` (default: the whole first block) and
/// the most recent `budget - n_sink_tokens`; decode evicts the oldest block after the sink
/// block (table index 1). With `n_sink_tokens < B`, block 0 also holds the oldest tokens
/// of the prefill's recent window; it is never evicted, so the sinks stay.
///
/// Positions stay as written (no re-rotation), which baselines.md notes is one of the two
/// faithful ways to run StreamingLLM.
#[derive(Debug)]
pub(crate) struct StreamingLlm {
    n_sink_tokens: Option<u32>,
    blocks: FullBlocks,
    block_size_tokens: usize,
}

impl StreamingLlm {
    pub(crate) fn new(n_sink_tokens: Option<u32>) -> Self {
        StreamingLlm {
            n_sink_tokens,
            blocks: FullBlocks::default(),
            block_size_tokens: 0,
        }
    }
}

impl EvictionPolicy for StreamingLlm {
    fn spec(&self) -> PolicySpec {
        PolicySpec::StreamingLlm {
            n_sink_tokens: self.n_sink_tokens,
        }
    }

    fn select_prefill(
        &mut self,
        kv: &dyn KvView,
        _queries: Option<&dyn QueryView>,
        budget_tokens: u32,
        block_size_tokens: u32,
    ) -> Vec<u32> {
        if let Err(error) = validate_budget(budget_tokens, block_size_tokens) {
            panic!("{}: {error}", self.spec());
        }
        self.block_size_tokens = block_size_tokens as usize;
        let (n_tokens, budget) = (kv.n_tokens(), budget_tokens as usize);
        let keep: Vec<u32> = if n_tokens <= budget {
            (0..n_tokens as u32).collect()
        } else {
            let n_sink = (self.n_sink_tokens.unwrap_or(block_size_tokens) as usize).min(budget);
            let recent_start = n_tokens - (budget - n_sink);
            (0..n_sink)
                .chain(recent_start..n_tokens)
                .map(|t| t as u32)
                .collect()
        };
        self.blocks.count = keep.len() / self.block_size_tokens;
        keep
    }

    fn on_block_filled(&mut self, kv: &dyn KvView, _: Option<&dyn QueryView>, block_index: usize) {
        let spec = self.spec();
        self.blocks
            .filled(&spec, kv, self.block_size_tokens, block_index);
    }

    fn choose_victim(&self, num_blocks: usize) -> Option<usize> {
        let num_full = self.blocks.count;
        assert!(
            num_blocks == num_full || num_blocks == num_full + 1,
            "{}: table has {num_blocks} blocks but {num_full} full blocks are scored",
            self.spec()
        );
        // Block 1 is the oldest non-sink block; it must not be the newest full block.
        (num_full >= 3).then_some(1)
    }

    fn on_block_removed(&mut self, block_index: usize) {
        let spec = self.spec();
        self.blocks.removed(&spec, block_index);
    }

    fn num_scored_blocks(&self) -> usize {
        self.blocks.count
    }
}
