//! KVzip's reconstruction passes as a run that the engine advances one piece at a time,
//! so that a long context's passes (about twice its prefill) never stall the sequences
//! decoding beside it for longer than a prefill chunk would (issue 37).
//!
//! A piece is the next tokens of the current chunk's pass: they are appended to the pass's
//! fork of the sequence and run, and their queries score the chunk. The scores are exact
//! whatever the piece size: a pass query sees the sinks, the chunk and the pass tokens up
//! to its own, and the keys of the pass tokens run in earlier pieces are in the fork. The
//! scoring kernels take keys as (always visible, scored chunk, causal pass tokens), so the
//! earlier pieces' keys are handed over with the sinks: visible to every query, not scored.
//! Each token's score is the largest over the pieces, as over the queries of one pass.
//!
//! The fork lives from a chunk's first piece to its last; whoever drops a run early (the
//! sequence finished, aborted, preempted or failed) must [`KvzipRun::release`] it.

use pk_kv::{kvzip_pass_ids, KvCacheManager, KvzipPass, KvzipPlan, SeqId, KVZIP_PROMPT_MAX_TOKENS};
use pk_model::{Backend, SeqForward};

use super::kvzip::{KvzipPrompts, Pass, PassSeconds};
use super::kvzip_keys::PieceKeys;
use super::{table_of, CapturedQueries};

/// Why a piece did not run.
#[derive(Debug)]
pub(crate) enum PassError {
    /// No free block for the fork or the piece's tokens: room may come later.
    NoRoom(String),
    /// The forward pass failed.
    Failed(String),
}

impl std::fmt::Display for PassError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PassError::NoRoom(why) | PassError::Failed(why) => f.write_str(why),
        }
    }
}

/// One sequence's reconstruction passes in progress.
pub(crate) struct KvzipRun {
    /// The sequence whose stored context is scored.
    pub seq: SeqId,
    /// The passes' fork of `seq`, live while `forked`.
    child: SeqId,
    forked: bool,
    context: Vec<u32>,
    /// The chunks, the template prefix and the sinks (`pk_kv::KvzipPlan`).
    plan: KvzipPlan,
    prompts: KvzipPrompts,
    pub pass: KvzipPass,
    /// The chunk whose pass runs, and how many of its pass tokens have run.
    chunk: usize,
    pass_done_tokens: usize,
    /// The current chunk's pass tokens, built when its first piece runs.
    pass_ids: Vec<u32>,
    /// The current chunk's keys for its pieces, read when its pass starts.
    keys: Option<PieceKeys>,
    /// `[layer][kv_head][token]`, as `reconstruction_scores` returns them.
    scores: Vec<f32>,
    pub seconds: PassSeconds,
    /// The queries the prompt's last step captured, for the selection once scores are in.
    pub queries: Option<CapturedQueries>,
}

impl KvzipRun {
    /// A run over `context`, the first tokens stored for `seq`, in passes of chunks of
    /// `pass.chunk_tokens`, its template prefix treated as `pass.prefix` says; `child` is a
    /// fresh sequence id for the passes' forks.
    pub fn new(
        backend: &dyn Backend,
        (seq, child): (SeqId, SeqId),
        context: Vec<u32>,
        (prompts, pass): (KvzipPrompts, KvzipPass),
    ) -> KvzipRun {
        let c = backend.config();
        let dims = (c.n_layers, c.n_kv_heads);
        let mut plan = KvzipPlan::new(pass, &context, &prompts.template_prefix, dims);
        let scores = std::mem::take(&mut plan.initial_scores);
        let mut run = KvzipRun {
            seq,
            child,
            forked: false,
            plan,
            context,
            prompts,
            pass,
            chunk: 0,
            pass_done_tokens: 0,
            pass_ids: Vec::new(),
            keys: None,
            scores,
            seconds: PassSeconds::default(),
            queries: None,
        };
        run.build_pass_ids();
        run
    }

    /// The current chunk's pass tokens not yet run: the most the next piece can take.
    pub fn pass_tokens_left(&self) -> usize {
        self.pass_ids.len() - self.pass_done_tokens
    }

    /// The current chunk's pass tokens that the fork holds slots for.
    pub fn pass_tokens_held(&self) -> usize {
        self.pass_done_tokens
    }

    pub fn is_done(&self) -> bool {
        self.chunk == self.plan.chunks.len()
    }

    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// The scores once every pass has run.
    pub fn into_scores(mut self) -> Vec<f32> {
        assert!(
            self.is_done() && !self.forked,
            "kvzip: scores of an unfinished run"
        );
        std::mem::take(&mut self.scores)
    }

    /// Frees the pass's fork, if one is live (a run given up before it is done).
    pub fn release(&mut self, kv: &mut KvCacheManager) {
        if std::mem::take(&mut self.forked) {
            kv.free(self.child);
        }
    }

    /// Runs and scores the next at most `max_tokens` tokens of the current chunk's pass.
    /// Returns how many ran. On an error (no free block, a failed forward) the fork is
    /// freed and the run cannot go on.
    pub fn advance(
        &mut self,
        backend: &mut dyn Backend,
        kv: &mut KvCacheManager,
        max_tokens: usize,
    ) -> Result<usize, PassError> {
        if self.is_done() {
            return Ok(0);
        }
        let result = self.run_piece(backend, kv, max_tokens);
        if result.is_err() {
            self.release(kv);
        }
        result
    }

    fn run_piece(
        &mut self,
        backend: &mut dyn Backend,
        kv: &mut KvCacheManager,
        max_tokens: usize,
    ) -> Result<usize, PassError> {
        let n_context = self.context.len();
        let chunk = self.plan.chunks[self.chunk].clone();
        if self.pass_done_tokens == 0 {
            self.start_pass(backend, kv)?;
        }
        let from = self.pass_done_tokens;
        let to = from
            .saturating_add(max_tokens.max(1))
            .min(self.pass_ids.len());
        let started = std::time::Instant::now();
        let (queries, lse) = forward_piece(
            backend,
            kv,
            self.child,
            n_context,
            &self.pass_ids[..to],
            from,
        )?;
        self.seconds.forward += started.elapsed().as_secs_f64();
        let started = std::time::Instant::now();
        let table = table_of(kv, self.child);
        let store = backend.kv();
        let read = match self.keys.as_mut() {
            Some(keys) => keys.read_pass(store, &table, n_context + from..n_context + to),
            None => Err("kvzip: a piece before its chunk's keys".to_string()),
        };
        read.map_err(PassError::Failed)?;
        let (keys, n_sink) = self.keys.as_mut().expect("read").piece(from, to);
        // The forward's log-sum-exps normalise KVzip's softmax only where the pass attended
        // exactly the span: one chunk from the first token (no separate sinks).
        let whole = chunk == (0..n_context);
        let c = backend.config();
        let pass = Pass {
            queries: &queries,
            lse: lse.as_deref().filter(|_| whole),
            keys,
            geometry: (c.n_kv_heads, c.n_heads, c.head_dim),
            n_queries: to - from,
            n_sink,
        };
        // The first piece sets the chunk's scores (the sinks' too when the chunk holds
        // them, as kvpress does); later pieces raise them.
        pass.score(chunk, n_context, &mut self.scores, from > 0);
        self.seconds.scoring += started.elapsed().as_secs_f64();
        self.pass_done_tokens = to;
        if to == self.pass_ids.len() {
            self.keys = None;
            self.release(kv);
            self.chunk += 1;
            self.pass_done_tokens = 0;
            self.build_pass_ids();
        }
        Ok(to - from)
    }

    /// The current chunk's pass tokens (none once every chunk is done).
    fn build_pass_ids(&mut self) {
        if self.is_done() {
            self.pass_ids.clear();
            return;
        }
        let ids = kvzip_pass_ids(
            &self.context,
            &self.plan.chunks,
            self.chunk,
            &self.prompts.first,
            &self.prompts.later,
            &self.prompts.turn_change,
        );
        let chunk_len = self.plan.chunks[self.chunk].len();
        assert!(
            ids.len() - chunk_len <= KVZIP_PROMPT_MAX_TOKENS,
            "kvzip: a pass prompt of {} tokens exceeds the {KVZIP_PROMPT_MAX_TOKENS} reserved",
            ids.len() - chunk_len
        );
        self.pass_ids = ids;
    }

    /// Forks the sequence for the current chunk's pass.
    fn start_pass(
        &mut self,
        backend: &mut dyn Backend,
        kv: &mut KvCacheManager,
    ) -> Result<(), PassError> {
        let started = std::time::Instant::now();
        let copies = kv.fork(self.seq, self.child).ok_or_else(|| {
            PassError::NoRoom("no free KV block for KVzip's reconstruction pass (the fork)".into())
        })?;
        self.forked = true;
        for copy in copies {
            for slot in 0..copy.num_tokens as usize {
                backend
                    .kv_mut()
                    .copy_slot((copy.src.0, slot), (copy.dst.0, slot));
            }
        }
        self.seconds.forward += started.elapsed().as_secs_f64();
        // The sinks are the span's tokens before the chunk (`KvzipPlan::sink_tokens`: the
        // first few, or a kept template prefix). Reading their keys is the scoring's work,
        // and is timed with it.
        let started = std::time::Instant::now();
        let chunk = self.plan.chunks[self.chunk].clone();
        let n_sink = self.plan.sink_tokens(&chunk);
        let table = table_of(kv, self.child);
        let keys = PieceKeys::for_chunk(backend.kv(), &table, 0..n_sink, chunk);
        self.keys = Some(keys.map_err(PassError::Failed)?);
        self.seconds.scoring += started.elapsed().as_secs_f64();
        Ok(())
    }
}

impl Drop for KvzipRun {
    fn drop(&mut self) {
        if self.forked {
            tracing::error!("kvzip: a run was dropped with its fork live; its blocks leak");
        }
    }
}

/// Appends pass tokens `ids[from..]` to the fork `child` (after the context's `n_context`
/// tokens and the pass's first `from`) and runs them, returning their queries
/// (`[layer][token][n_heads * head_dim]`) and, where the backend gives them, their
/// attention's log-sum-exps (`[layer][token][n_heads]`).
fn forward_piece(
    backend: &mut dyn Backend,
    kv: &mut KvCacheManager,
    child: SeqId,
    n_context: usize,
    ids: &[u32],
    from: usize,
) -> Result<(Vec<f32>, Option<Vec<f32>>), PassError> {
    let tokens = &ids[from..];
    if kv.allocate_slots(child, tokens.len() as u32).is_none() {
        return Err(PassError::NoRoom(format!(
            "no free KV block for KVzip's reconstruction pass ({} pass tokens)",
            tokens.len()
        )));
    }
    let table = table_of(kv, child);
    // Sliding-window layers (Gemma 3) read their own tables; the pass scores every layer,
    // and only the full-attention layers' units use the scores.
    let window_tables = kv
        .window_tables(child)
        .map(<[_]>::to_vec)
        .unwrap_or_default();
    let forward = SeqForward {
        tokens,
        start_position: n_context + from,
        stored_start: n_context + from,
        block_table: &table,
        logits_from: tokens.len(),
        stored_positions: &[],
        window_tables: &window_tables,
        head_first_keys: &[],
    };
    match backend.forward_with_queries_lse(&[forward], &[tokens.len()]) {
        Ok((_, mut queries, lse)) => Ok((
            queries.pop().unwrap_or_default(),
            lse.and_then(|mut l| l.pop()),
        )),
        Err(e) => Err(PassError::Failed(format!(
            "KVzip's reconstruction pass failed: {e}"
        ))),
    }
}
