//! The executor: runs a schedule's chunks through the backend in one forward pass and returns
//! the model's output as plain data. It reads the block tables and the sequences' tokens;
//! it changes nothing but the K/V the forward pass writes into the slots the scheduler
//! allocated.

use pk_kv::{KvCacheManager, QueryNeed};
use pk_model::{Backend, BackendError, SeqForward};

use crate::eviction::table_of;
use crate::scheduler::Chunk;
use crate::sequence::SeqState;

/// What a schedule's forward pass returned: rows of logits (per chunk, from its
/// `first_logits_row` to its end), and per chunk the queries captured (`capture[k]` of
/// them) for the attention-based eviction policies.
pub(crate) struct ModelOutput {
    pub logits: Vec<f32>,
    pub captured: Vec<Vec<f32>>,
    pub capture: Vec<usize>,
}

/// Runs `chunks` (chunk `k` of sequence `seqs[k]`) through `backend`.
pub(crate) fn execute(
    backend: &mut dyn Backend,
    kv: &KvCacheManager,
    seqs: &[&SeqState],
    chunks: &[Chunk],
) -> Result<ModelOutput, BackendError> {
    let tables: Vec<Vec<u32>> = chunks.iter().map(|c| table_of(kv, c.seq)).collect();
    let window_tables: Vec<Vec<Vec<u32>>> = chunks
        .iter()
        .map(|c| {
            kv.window_tables(c.seq)
                .map(<[_]>::to_vec)
                .unwrap_or_default()
        })
        .collect();
    let mut fwd = Vec::with_capacity(chunks.len());
    let mut capture = Vec::with_capacity(chunks.len());
    for (k, (c, s)) in chunks.iter().zip(seqs).enumerate() {
        let table = kv.block_table(c.seq).expect("a scheduled sequence is live");
        let stored_after = table.num_stored_tokens() as usize;
        fwd.push(SeqForward {
            tokens: &s.all_ids[c.from..c.to],
            start_position: s.position_of(c.from),
            stored_start: stored_after - c.n_tokens(),
            block_table: &tables[k],
            logits_from: first_logits_row(s, c),
            stored_positions: table.positions().unwrap_or(&[]),
            window_tables: &window_tables[k],
            head_first_keys: s.eviction.as_ref().map_or(&[], |e| &e.head_first_keys),
        });
        capture.push(capture_count(s, c));
    }
    let (logits, captured) = backend.forward_with_queries(&fwd, &capture)?;
    Ok(ModelOutput {
        logits,
        captured,
        capture,
    })
}

/// Queries of chunk `c` that `s`'s eviction policy scores with: the last prompt chunk's
/// (capped to the chunk) at prefill, each decode token's afterwards, else none.
fn capture_count(s: &SeqState, c: &Chunk) -> usize {
    match &s.eviction {
        // An evicting sequence's prompt ends at `n_prompt` (a recompute replays its
        // generated tokens afterwards, see `SeqState::max_chunk`).
        Some(ev) if !ev.initialised && c.to == s.n_prompt => {
            ev.policy().prefill_queries().count(c.n_tokens())
        }
        Some(ev) if ev.initialised && ev.policy().decode_queries() != QueryNeed::None => 1,
        _ => 0,
    }
}

/// The first row of chunk `c` whose logits the step returns: the prompt positions still
/// missing a `prompt_logprobs` entry, else only the sequence's last token (the one it
/// samples from), else none (`c.to - c.from`).
pub(crate) fn first_logits_row(s: &SeqState, c: &Chunk) -> usize {
    let n = c.n_tokens();
    let last = match c.to == s.all_ids.len() {
        true => n - 1,
        false => n,
    };
    match s.first_prompt_logprob_position(c.from, c.to) {
        Some(pos) => (pos - c.from).min(last),
        None => last,
    }
}
