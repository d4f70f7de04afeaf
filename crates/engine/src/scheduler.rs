//! The scheduler: which waiting requests are admitted, which running sequences are preempted,
//! and which tokens of which sequences the next forward pass computes. It sees the KV
//! manager and the sequences' progress only: no model, tokenizer or sampler. Loading stored
//! KV into an admitted sequence's blocks is asked of a [`KvLoads`] the engine hands in, so
//! that the scheduler decides where a sequence starts and the engine's backend writes it.
//!
//! A step's schedule ([`Schedule`]) is plain data: the chunks to compute, each with its
//! slots already allocated, and the requests that failed while it was built. The engine
//! runs the chunks (`executor`), applies the model's output (`engine::update`) and then
//! fails the failed requests.

use std::collections::VecDeque;

use pk_kv::{CachedPrefix, KvCacheManager, QueryNeed, SeqId};

use crate::connector::{Lookup, RequestKey};
use crate::params::{EngineConfig, MAX_PROMPT_LOGITS_BYTES, PREFILL_TOKENS_PER_DECODE};
use crate::request::RequestError;
use crate::sequence::{SeqReuse, SeqState};

/// One planned piece of a step: `all_ids[from..to]` of sequence `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub seq: SeqId,
    pub from: usize,
    pub to: usize,
}

impl Chunk {
    pub fn n_tokens(&self) -> usize {
        self.to - self.from
    }
}

/// What the scheduler decided for one step.
#[derive(Default)]
pub(crate) struct Schedule {
    /// The chunks to compute, decodes first, each with its slots allocated.
    pub chunks: Vec<Chunk>,
    /// Requests taken out of the queue or the running set because they cannot run: too
    /// large for the pool, or no block even with every other sequence preempted. They hold
    /// no blocks any more.
    pub failed: Vec<(SeqState, RequestError)>,
    /// Tokens of KVzip's reconstruction passes the engine runs beside the chunks (one
    /// piece of `kvzip_pass_seq`'s, `Engine::advance_kvzip_run`), out of the step's prompt
    /// allowance; 0 when no pass is pending.
    pub kvzip_pass_tokens: usize,
    /// The sequence whose pass gets `kvzip_pass_tokens`.
    pub kvzip_pass_seq: Option<SeqId>,
}

/// Where an admitted sequence's first prompt tokens come from.
pub(crate) enum Start {
    /// The pool's prefix cache (possibly nothing of it).
    Pool(CachedPrefix),
    /// The reuse connector's stored KV.
    Reuse,
    /// The request's given prefix KV (`GenerateParams::prefix_kv`).
    Given,
}

/// What the scheduler asks of stored KV while it admits: the engine's side of the reuse
/// connector and the backend's pool, which the scheduler does not hold.
pub(crate) trait KvLoads {
    /// The connector's answer for a waiting sequence's tokens (`None`: no connector).
    fn lookup(&mut self, s: &SeqState) -> Option<Lookup>;

    /// Writes the given prefix KV into `seq` (added with an empty table). Returns the prompt
    /// tokens covered, or `None` after freeing `seq` when it could not be placed.
    fn load_given(
        &mut self,
        s: &mut SeqState,
        kv: &mut KvCacheManager,
        seq: SeqId,
    ) -> Option<usize>;

    /// Loads the first `tokens` of the prompt from the connector into `seq`, as
    /// `load_given`.
    fn load_stored(
        &mut self,
        s: &mut SeqState,
        tokens: usize,
        kv: &mut KvCacheManager,
        seq: SeqId,
    ) -> Option<usize>;
}

/// The limits the scheduler works within, taken from the engine's configuration and the
/// model's vocabulary.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub block_size_tokens: usize,
    pub max_batch_tokens: usize,
    pub max_prefill_tokens_while_decoding: usize,
    pub max_running_seqs: usize,
    pub enable_prefix_caching: bool,
    /// Bytes of one row of logits (the vocabulary in f32), for `prompt_logprobs` chunks.
    pub logits_row_bytes: usize,
}

impl Limits {
    pub fn new(config: &EngineConfig, vocab_size: usize) -> Limits {
        Limits {
            block_size_tokens: config.block_size_tokens as usize,
            max_batch_tokens: config.max_batch_tokens,
            max_prefill_tokens_while_decoding: config.max_prefill_tokens_while_decoding,
            max_running_seqs: config.max_running_seqs,
            enable_prefix_caching: config.enable_prefix_caching,
            logits_row_bytes: vocab_size * std::mem::size_of::<f32>(),
        }
    }
}

/// Counters the scheduler keeps (the engine reports them in `EngineStats`).
#[derive(Debug, Default, Clone)]
pub(crate) struct SchedulerStats {
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    pub preemptions: u64,
}

pub(crate) struct Scheduler {
    pub kv: KvCacheManager,
    pub waiting: VecDeque<SeqState>,
    /// In admission order; preemption takes from the back.
    pub running: Vec<SeqState>,
    pub limits: Limits,
    pub stats: SchedulerStats,
    next_seq: u64,
    next_request_key: RequestKey,
}

impl Scheduler {
    pub fn new(kv: KvCacheManager, limits: Limits) -> Scheduler {
        Scheduler {
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            limits,
            stats: SchedulerStats::default(),
            next_seq: 0,
            next_request_key: 0,
        }
    }

    pub fn new_seq_id(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    fn new_request_key(&mut self) -> RequestKey {
        self.next_request_key += 1;
        self.next_request_key
    }

    /// Queues a new request's `s`: background work behind every user request, the rest in
    /// arrival order.
    pub fn enqueue(&mut self, mut s: SeqState) {
        s.request_key = self.new_request_key();
        let at = match s.req.params.background {
            true => self.waiting.len(),
            false => self
                .waiting
                .iter()
                .position(|w| w.req.params.background)
                .unwrap_or(self.waiting.len()),
        };
        self.waiting.insert(at, s);
    }

    /// One step's decisions: aborted sequences dropped, waiting ones admitted while blocks
    /// and slots allow, and the batch planned.
    pub fn schedule(&mut self, loads: &mut dyn KvLoads) -> Schedule {
        let mut out = Schedule::default();
        self.drop_aborted();
        self.admit(loads, &mut out.failed);
        let (chunks, pass) = self.plan(&mut out.failed);
        out.chunks = chunks;
        if let Some((seq, tokens)) = pass {
            (out.kvzip_pass_seq, out.kvzip_pass_tokens) = (Some(seq), tokens);
        }
        out
    }

    /// The index in `running` of a running sequence.
    pub fn index_of(&self, seq: SeqId) -> Option<usize> {
        self.running.iter().position(|s| s.kv.seq == Some(seq))
    }

    /// Frees the blocks of sequences whose clients went away.
    fn drop_aborted(&mut self) {
        let mut aborted = Vec::new();
        let kv = &mut self.kv;
        self.running.retain_mut(|s| {
            if s.aborted {
                s.release_extra_kv(kv);
                aborted.push(s.kv.seq.take());
            }
            !s.aborted
        });
        for seq in aborted.into_iter().flatten() {
            self.kv.free(seq);
        }
    }

    /// Blocks needed to compute `n_tokens` more tokens, plus one block of headroom for decode.
    /// With window groups, their blocks while the sequence computes are added.
    fn blocks_for(&self, n_tokens: usize) -> usize {
        let window = self
            .kv
            .window_blocks_bound(n_tokens as u64, self.limits.max_batch_tokens as u64);
        n_tokens.div_ceil(self.limits.block_size_tokens) + 1 + window as usize
    }

    /// Blocks that running sequences still in their prompt will allocate before the prompt
    /// is in (no credit for a partly filled last block). Admission keeps them free: a long
    /// prompt admitted beside another one still prefilling would otherwise run the pool out
    /// halfway through both and preempt one. This matters most under eviction, where a
    /// prompt of T tokens holds T tokens of blocks only until its last chunk is pruned to
    /// the budget: exact prefill (every prompt token attends to the whole prompt, as
    /// PagedEviction's spec requires) needs all T at once, so such peaks are taken one
    /// after another while the pruned sequences decode beside them.
    /// A prompt pruned as its chunks arrive needs at most its peak (budget + interval)
    /// less what it holds.
    /// A sequence whose KVzip passes run keeps its pass's peak reserved until they end.
    fn reserved_prefill_blocks(&self) -> usize {
        let prompts: usize = self
            .running
            .iter()
            .filter(|s| s.kv.num_computed < s.n_prompt)
            .map(|s| self.prefill_blocks_left(s))
            .sum();
        let passes: usize = self
            .running
            .iter()
            .filter_map(|s| {
                let run = s.eviction.as_ref()?.kvzip_run.as_ref()?;
                let left = self
                    .pass_peak_tokens(s)
                    .saturating_sub(run.pass_tokens_held());
                Some(left.div_ceil(self.limits.block_size_tokens))
            })
            .sum();
        prompts + passes
    }

    /// `reserved_prefill_blocks` of one sequence still in its prompt.
    fn prefill_blocks_left(&self, s: &SeqState) -> usize {
        let left = s.n_prompt - s.kv.num_computed;
        let chunk_peak = s
            .eviction
            .as_ref()
            .filter(|ev| ev.prune_interval_tokens.is_some())
            .map(|ev| ev.prefill_peak_tokens(s.n_prompt));
        let need = match (chunk_peak, s.kv.seq) {
            (Some(peak), Some(seq)) => {
                let stored = self
                    .kv
                    .block_table(seq)
                    .map_or(0, |t| t.num_stored_tokens() as usize);
                left.min(peak.saturating_sub(stored))
            }
            _ => left,
        };
        (need + self.pass_peak_tokens(s)).div_ceil(self.limits.block_size_tokens)
    }

    /// The KV slots `s` needs after its prompt is in (KVzip's reconstruction pass).
    fn pass_peak_tokens(&self, s: &SeqState) -> usize {
        s.eviction.as_ref().map_or(0, |ev| {
            ev.spec
                .pass_peak_tokens(s.n_prompt, self.limits.block_size_tokens)
        })
    }

    /// Moves waiting requests into the running set while blocks and slots allow; a request
    /// that can never fit fails alone (into `failed`) when nothing else runs.
    fn admit(&mut self, loads: &mut dyn KvLoads, failed: &mut Vec<(SeqState, RequestError)>) {
        while self.running.len() < self.limits.max_running_seqs {
            self.probe_front(loads);
            let Some(front) = self.waiting.front() else {
                break;
            };
            let (start, needed) = self.start_for(front);
            let total = self.kv.pool().num_blocks() as usize;
            if needed > total && self.running.is_empty() {
                let s = self.waiting.pop_front().expect("front exists");
                let msg = format!(
                    "the request needs {needed} KV blocks of {} tokens but the cache has only {total}",
                    self.limits.block_size_tokens
                );
                failed.push((s, RequestError::TooLarge(msg)));
                continue;
            }
            let free = (self.kv.pool().num_free_blocks() as usize)
                .saturating_sub(self.reserved_prefill_blocks());
            if needed > free {
                break;
            }
            let s = self.waiting.pop_front().expect("front exists");
            self.admit_from(s, start, loads);
        }
    }

    /// Asks the reuse connector about the head of the queue, once per waiting request (and
    /// again only after a preemption has changed its tokens): while the head waits for
    /// blocks, each step would otherwise re-hash its prompt and make a Redis round trip.
    fn probe_front(&mut self, loads: &mut dyn KvLoads) {
        let Some(front) = self.waiting.front_mut() else {
            return;
        };
        let reusable = front.eviction.is_none()
            && front.req.params.prefix_kv.is_none()
            && !front.wants_prompt_rows();
        let asked = front.reuse.probe.as_ref().map(|p| p.0);
        if reusable && asked != Some(front.all_ids.len()) {
            if let Some(m) = loads.lookup(front) {
                front.reuse.probe = Some((front.all_ids.len(), m));
            }
        }
    }

    /// Whether `s` may adopt blocks of the pool's prefix cache. A prompt pruned as its
    /// chunks arrive may not: the cache holds K/V computed with attention over every
    /// earlier token, which its later chunks would not have seen, so its tokens would
    /// depend on what happened to be cached. Nor may one that asks for its prompt's
    /// logprobs: cached tokens have no logits.
    fn adopts_cached_prefix(&self, s: &SeqState) -> bool {
        let chunk_pruned = s
            .eviction
            .as_ref()
            .is_some_and(|ev| ev.prune_interval_tokens.is_some());
        self.limits.enable_prefix_caching && !chunk_pruned && !s.wants_prompt_rows()
    }

    /// The tokens of `s` a prefix-cache hit may cover. A policy that selects with the
    /// queries of the prompt's last `n` tokens (SnapKV, TOVA, expected attention) must
    /// compute at least those itself, so its hit stops `n` tokens before the prompt's end;
    /// one that reads every prompt query (H2O) computes the whole prompt.
    fn cacheable_ids<'a>(&self, s: &'a SeqState) -> &'a [u32] {
        if !self.adopts_cached_prefix(s) {
            return &[];
        }
        let own_queries = match &s.eviction {
            Some(ev) if !ev.initialised => match ev.policy().prefill_queries() {
                QueryNeed::None => 0,
                QueryNeed::Last(n) => n,
                QueryNeed::All => s.n_prompt,
            },
            _ => 0,
        };
        match own_queries {
            0 => &s.all_ids,
            n => &s.all_ids[..s.n_prompt - n.min(s.n_prompt)],
        }
    }

    /// Where a waiting sequence's first tokens would come from, and the blocks it needs to
    /// be admitted: a given prefix KV, else the connector when it holds more of the prompt
    /// than the pool's prefix cache, else the pool.
    fn start_for(&self, s: &SeqState) -> (Start, usize) {
        if s.req.params.prefix_kv.is_some() {
            return (Start::Given, self.blocks_for(s.all_ids.len()));
        }
        let prefix = self
            .kv
            .get_computed_prefix(self.cacheable_ids(s), &s.namespace);
        let cached = prefix.num_cached_tokens() as usize;
        let loadable = s.reuse.probe.as_ref().map_or(0, |p| p.1.loadable_tokens);
        if loadable > cached {
            return (Start::Reuse, self.blocks_for(s.all_ids.len()));
        }
        let to_compute = match &s.eviction {
            Some(ev) if ev.prune_interval_tokens.is_some() => {
                ev.prefill_peak_tokens(s.all_ids.len())
            }
            _ => s.all_ids.len() - cached,
        } + self.pass_peak_tokens(s);
        let needed = self.blocks_for(to_compute) + prefix.block_ids().len();
        (Start::Pool(prefix), needed)
    }

    /// Admits `s` starting from `start`; a given or stored KV that cannot be placed falls
    /// back to computing the prompt from the pool's prefix cache.
    fn admit_from(&mut self, mut s: SeqState, start: Start, loads: &mut dyn KvLoads) {
        let seq = self.new_seq_id();
        let probe = s.reuse.probe.take().map(|p| p.1).unwrap_or_default();
        s.reuse = SeqReuse {
            wants_save: probe.wants_save,
            ..Default::default()
        };
        let preloaded = match start {
            Start::Pool(prefix) => {
                let adopted = self.kv.add_sequence(seq, &prefix) as usize;
                return self.start_running(s, seq, adopted);
            }
            Start::Given => {
                self.add_empty(&s, seq);
                loads.load_given(&mut s, &mut self.kv, seq)
            }
            Start::Reuse => {
                self.add_empty(&s, seq);
                loads.load_stored(&mut s, probe.loadable_tokens, &mut self.kv, seq)
            }
        };
        let adopted = match preloaded {
            Some(tokens) => tokens,
            None => {
                // Nothing placed: the sequence was freed; the prefix is looked up again,
                // since a failed placement may have taken cached blocks off the free list.
                s.reuse.inexact = false;
                let prefix = self
                    .kv
                    .get_computed_prefix(self.cacheable_ids(&s), &s.namespace);
                self.kv.add_sequence(seq, &prefix) as usize
            }
        };
        self.start_running(s, seq, adopted);
    }

    /// Adds `seq` with an empty block table, for a load to fill.
    fn add_empty(&mut self, s: &SeqState, seq: SeqId) {
        let empty = self.kv.get_computed_prefix(&[], &s.namespace);
        self.kv.add_sequence(seq, &empty);
    }

    /// An admitted sequence whose first `adopted` tokens are already in its cache.
    pub fn start_running(&mut self, mut s: SeqState, seq: SeqId, adopted: usize) {
        if s.kv.preemptions == 0 {
            self.stats.prefix_queries_tokens += s.n_prompt as u64;
            self.stats.prefix_hits_tokens += adopted as u64;
            s.kv.cached_prompt_tokens = adopted;
        }
        s.kv.seq = Some(seq);
        s.scheduled_at.get_or_insert_with(std::time::Instant::now);
        s.kv.num_computed = adopted;
        self.running.push(s);
    }

    /// Gives `child`, a choice of `parent`'s request whose first `to` tokens `parent` has
    /// computed, a block table forked from its parent's (copy-on-write: the shared blocks
    /// are referenced, the partial last one is copied). Returns the child and the slot copies
    /// the backend must make, or `None` after queueing the child at the head of the queue to
    /// recompute its prompt (from the prefix cache where it can) when no block is free.
    pub fn fork(
        &mut self,
        parent: SeqId,
        mut child: SeqState,
        to: usize,
    ) -> Option<(SeqState, Vec<pk_kv::BlockCopy>)> {
        let child_seq = self.new_seq_id();
        child.request_key = self.new_request_key();
        let Some(copies) = self.kv.fork(parent, child_seq) else {
            child.kv.num_computed = 0;
            self.waiting.push_front(child);
            return None;
        };
        child.kv.seq = Some(child_seq);
        child.kv.num_computed = to;
        Some((child, copies))
    }

    /// Frees the most recently admitted running sequence other than `keep` and puts it
    /// back at the head of the queue. Returns its (former) sequence id.
    fn preempt_one(&mut self, keep: SeqId) -> Option<SeqId> {
        let victim = (0..self.running.len())
            .rev()
            .find(|&i| self.running[i].kv.seq != Some(keep))?;
        Some(self.preempt_at(victim))
    }

    /// Frees `running[victim]`'s blocks and puts it back at the head of the queue, to be
    /// recomputed from scratch. Returns its (former) sequence id.
    pub(crate) fn preempt_at(&mut self, victim: usize) -> SeqId {
        let mut s = self.running.remove(victim);
        s.release_extra_kv(&mut self.kv);
        let seq =
            s.kv.seq
                .take()
                .expect("running sequences hold a block table");
        self.kv.free(seq);
        s.kv.num_computed = 0;
        s.reuse = SeqReuse::default();
        if let Some(ev) = s.eviction.as_mut() {
            ev.reset();
        }
        s.kv.preemptions += 1;
        self.stats.preemptions += 1;
        tracing::debug!(
            "preempted a sequence ({} tokens) to free blocks",
            s.all_ids.len()
        );
        self.waiting.push_front(s);
        seq
    }

    /// The next batch: a decode token for every decoding sequence first, then prompt
    /// chunks, within the step's token budget, each with its slots allocated (preempting
    /// the newest other sequences when the pool is out of blocks).
    fn plan(
        &mut self,
        failed: &mut Vec<(SeqState, RequestError)>,
    ) -> (Vec<Chunk>, Option<(SeqId, usize)>) {
        // A sequence whose KVzip passes are in progress waits for them (the engine runs
        // them beside the plan, `Engine::advance_kvzip_run`).
        let mut order: Vec<(bool, SeqId)> = self
            .running
            .iter()
            .filter(|s| !s.kvzip_pending())
            .map(|s| (s.is_prefilling(), s.kv.seq.expect("running")))
            .collect();
        order.sort_by_key(|&(prefilling, _)| prefilling);
        let n_decoding = order.iter().filter(|o| !o.0).count();
        let mut budget = self.limits.max_batch_tokens;
        let mut prefill_left = self.prefill_cap(n_decoding);
        // A pending pass takes the step's prompt allowance ahead of prompts (its sequence
        // was admitted first), leaving one token per decode: a pass is prompt work to the
        // streams decoding beside it, and it runs in pieces of what a prompt chunk may be.
        // A background request's pass (a stored context scored in idle time) takes only
        // what the prompts leave, and a user's goes first. No piece crosses a chunk.
        let pass = self.next_pass();
        let mut pass_tokens = 0;
        if let Some((_, false, left)) = pass {
            pass_tokens = left
                .min(prefill_left)
                .min(budget.saturating_sub(n_decoding));
            budget -= pass_tokens;
            prefill_left -= pass_tokens;
        }
        let mut plan: Vec<Chunk> = Vec::new();
        for (prefilling, seq) in order {
            if budget == 0 {
                break;
            }
            // A sequence preempted for an earlier one of this plan is no longer running.
            let Some(i) = self.index_of(seq) else {
                continue;
            };
            let cap = if prefilling { prefill_left } else { usize::MAX };
            let take = self.chunk_tokens(&self.running[i], budget.min(cap));
            let from = self.running[i].kv.num_computed;
            if take == 0 || !self.allocate_or_preempt(seq, take, &mut plan, failed) {
                continue;
            }
            plan.push(Chunk {
                seq,
                from,
                to: from + take,
            });
            budget -= take;
            if prefilling {
                prefill_left -= take;
            }
        }
        if let Some((_, true, left)) = pass {
            pass_tokens = left.min(prefill_left).min(budget);
        }
        (plan, pass.map(|(seq, _, _)| (seq, pass_tokens)))
    }

    /// The pending KVzip pass that runs next: the first user request's in running order,
    /// else the first background one's. Its sequence, whether it is background, and the
    /// tokens left in its current chunk's pass.
    fn next_pass(&self) -> Option<(SeqId, bool, usize)> {
        let pending = |background: bool| {
            self.running.iter().find_map(|s| {
                let run = s.eviction.as_ref()?.kvzip_run.as_ref()?;
                (s.req.params.background == background).then(|| {
                    let seq = s.kv.seq.expect("running");
                    (seq, background, run.pass_tokens_left())
                })
            })
        };
        pending(false).or_else(|| pending(true))
    }

    /// Tokens of `s` the next chunk computes, at most `limit`: what is pending, within the
    /// sequence's own chunk bound and the rows of logits it returns.
    fn chunk_tokens(&self, s: &SeqState, limit: usize) -> usize {
        let pending = s.all_ids.len() - s.kv.num_computed;
        pending
            .min(limit)
            .min(s.max_chunk())
            .min(self.max_logit_rows(s))
    }

    /// The most tokens of `s` one step may compute: unbounded, except where each row
    /// returns logits (`prompt_logprobs`), whose bytes `MAX_PROMPT_LOGITS_BYTES` bounds.
    fn max_logit_rows(&self, s: &SeqState) -> usize {
        match s.wants_prompt_rows() {
            true => (MAX_PROMPT_LOGITS_BYTES / self.limits.logits_row_bytes.max(1)).max(1),
            false => usize::MAX,
        }
    }

    /// Prompt tokens a step may carry beside `n_decoding` decodes. The cap grows with the
    /// decodes (`PREFILL_TOKENS_PER_DECODE` each): a step of many decodes is long already,
    /// and prompt rows beside them cost it proportionally less.
    pub(crate) fn prefill_cap(&self, n_decoding: usize) -> usize {
        match n_decoding {
            0 => usize::MAX,
            n => self
                .limits
                .max_prefill_tokens_while_decoding
                .max(PREFILL_TOKENS_PER_DECODE * n)
                .max(1),
        }
    }

    /// Allocates `take` slots for `seq`, preempting the newest other sequences (and taking
    /// them out of `plan`) while the pool is out of blocks. When nothing is left to preempt,
    /// `seq` leaves the running set into `failed` and false is returned.
    fn allocate_or_preempt(
        &mut self,
        seq: SeqId,
        take: usize,
        plan: &mut Vec<Chunk>,
        failed: &mut Vec<(SeqState, RequestError)>,
    ) -> bool {
        loop {
            if self.kv.allocate_slots(seq, take as u32).is_some() {
                return true;
            }
            match self.preempt_one(seq) {
                Some(victim) => plan.retain(|c| c.seq != victim),
                None => break,
            }
        }
        let i = self.index_of(seq).expect("still running");
        let mut s = self.running.remove(i);
        // Its blocks go back now, so that the rest of this plan can use them.
        s.release_extra_kv(&mut self.kv);
        if let Some(seq) = s.kv.seq.take() {
            self.kv.free(seq);
        }
        let msg =
            "the KV cache is full even with every other sequence preempted; raise the KV capacity";
        failed.push((s, RequestError::CacheFull(msg.into())));
        false
    }
}

#[cfg(test)]
mod tests;
