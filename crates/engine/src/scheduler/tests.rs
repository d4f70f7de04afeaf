//! The scheduler alone, over a KV manager and nothing else: no model file, no tokenizer, no
//! backend. A step's update is played by `advance` (progress, and one made-up token for a
//! chunk that ends at its sequence's last token), so every figure below is the scheduler's
//! own decision.

use std::sync::{Arc, Mutex};

use pk_kv::{KvCacheManager, KvGranularity, PolicySpec, SeqId};

use super::*;
use crate::eviction::SeqEviction;
use crate::params::GenerateParams;
use crate::request::{Request, SeqEvent};

const BLOCK_TOKENS: usize = 16;

/// No connector and no given KV: every admission starts from the pool.
struct NoLoads;

impl KvLoads for NoLoads {
    fn lookup(&mut self, _s: &SeqState) -> Option<Lookup> {
        None
    }
    fn load_given(&mut self, _: &mut SeqState, _: &mut KvCacheManager, _: SeqId) -> Option<usize> {
        unreachable!("no request here gives a prefix KV")
    }
    fn load_stored(
        &mut self,
        _: &mut SeqState,
        _: usize,
        _: &mut KvCacheManager,
        _: SeqId,
    ) -> Option<usize> {
        unreachable!("no connector answered")
    }
}

fn limits() -> Limits {
    Limits {
        block_size_tokens: BLOCK_TOKENS,
        max_batch_tokens: 256,
        max_prefill_tokens_while_decoding: 64,
        max_running_seqs: 8,
        enable_prefix_caching: true,
        logits_row_bytes: 4 * 1000,
    }
}

fn scheduler(num_blocks: u32, limits: Limits) -> Scheduler {
    Scheduler::new(KvCacheManager::new(num_blocks, BLOCK_TOKENS as u32), limits)
}

/// A request of `prompt_tokens` distinct tokens (no two requests share a prefix: `tag`).
fn request(tag: u32, prompt_tokens: usize, max_tokens: usize) -> SeqState {
    let req = Request {
        prompt_ids: (0..prompt_tokens as u32)
            .map(|t| tag * 10_000 + t)
            .collect(),
        params: GenerateParams {
            max_tokens,
            ..Default::default()
        },
        cache_salt: None,
        sink: Box::new(|_| true),
    };
    SeqState::new(req, Vec::new())
}

/// The update's effect on progress: each chunk computed, and a token appended where the
/// chunk reached the sequence's last token (the model's sample). Sequences that reached
/// `max_tokens` leave and free their blocks. Returns the ids of those that left.
fn advance(s: &mut Scheduler, schedule: &Schedule) -> Vec<SeqId> {
    let mut done = Vec::new();
    for c in &schedule.chunks {
        let i = s.index_of(c.seq).expect("scheduled sequences run");
        let seq = &mut s.running[i];
        seq.kv.num_computed = c.to;
        if c.to == seq.all_ids.len() {
            seq.all_ids.push(1);
            if seq.all_ids.len() - seq.n_prompt >= seq.req.params.max_tokens {
                done.push(c.seq);
            }
        }
    }
    for seq in &done {
        let i = s.index_of(*seq).expect("running");
        s.running.remove(i);
        s.kv.free(*seq);
    }
    s.kv.check_invariants();
    done
}

fn chunk_sizes(schedule: &Schedule) -> Vec<usize> {
    schedule.chunks.iter().map(Chunk::n_tokens).collect()
}

#[test]
fn admission_keeps_blocks_for_prompts_still_prefilling() {
    // 13 blocks. A 150-token prompt needs 10 blocks and one of headroom; a 40-token one
    // needs 3 and one. Both fit the empty pool's free blocks, but not A's whole prompt
    // beside B: B waits while A's prompt is in flight, so that nobody is preempted.
    let mut s = scheduler(
        13,
        Limits {
            max_batch_tokens: 64,
            ..limits()
        },
    );
    s.enqueue(request(1, 150, 4));
    s.enqueue(request(2, 40, 4));
    let mut b_admitted_at = None;
    for step in 0..20 {
        let sch = s.schedule(&mut NoLoads);
        assert!(sch.failed.is_empty());
        if step == 0 {
            assert_eq!(chunk_sizes(&sch), vec![64]);
            assert!(
                s.kv.pool().num_free_blocks() >= 4,
                "B's blocks are free right now"
            );
        }
        let a_prefilling = s
            .running
            .iter()
            .any(|q| q.all_ids[0] == 10_000 && q.kv.num_computed < 150);
        let b_running = s.running.iter().any(|q| q.all_ids[0] == 20_000);
        assert!(
            !(a_prefilling && b_running),
            "B ran beside A's prompt (step {step})"
        );
        if b_running {
            b_admitted_at.get_or_insert(step);
        }
        advance(&mut s, &sch);
        if s.running.is_empty() && s.waiting.is_empty() {
            break;
        }
    }
    assert!(b_admitted_at.is_some(), "B was never admitted");
    assert!(
        s.running.is_empty() && s.waiting.is_empty(),
        "both finished"
    );
    assert_eq!(s.stats.preemptions, 0);
}

#[test]
fn preemption_recomputes_the_newest_sequence_with_its_generated_tokens() {
    // 6 blocks: two 20-token prompts (2 blocks each, and one of headroom) are admitted
    // together, but not their growth to 50 tokens (4 blocks each).
    let mut s = scheduler(6, limits());
    s.enqueue(request(1, 20, 30));
    s.enqueue(request(2, 20, 30));
    let mut preempted_at = None;
    let mut recompute = None;
    for step in 0..40 {
        let sch = s.schedule(&mut NoLoads);
        assert!(sch.failed.is_empty());
        if let (Some(len), None) = (preempted_at.map(|(_, len)| len), recompute) {
            // Once readmitted, its prompt and generated tokens are one prefill chunk.
            let b = s.running.iter().find(|q| q.all_ids[0] == 20_000);
            if let Some(seq) = b.and_then(|q| q.kv.seq) {
                let c = sch.chunks.iter().find(|c| c.seq == seq).expect("scheduled");
                recompute = Some((c.from, c.to));
                assert_eq!((c.from, c.to), (0, len));
            }
        }
        if preempted_at.is_none() && s.stats.preemptions == 1 {
            let back = s
                .waiting
                .front()
                .expect("the newest went back to the queue");
            assert_eq!(
                back.all_ids[0], 20_000,
                "the newest (second) request is the victim"
            );
            assert_eq!(
                (back.kv.num_computed, back.kv.seq, back.kv.preemptions),
                (0, None, 1)
            );
            assert!(back.all_ids.len() > 20, "it keeps the tokens it generated");
            preempted_at = Some((step, back.all_ids.len()));
        }
        advance(&mut s, &sch);
        if s.running.is_empty() && s.waiting.is_empty() {
            break;
        }
    }
    assert!(preempted_at.is_some(), "the pool never ran out");
    assert!(
        recompute.is_some(),
        "the preempted sequence never ran again"
    );
    assert!(
        s.running.is_empty() && s.waiting.is_empty(),
        "both finished"
    );
    assert_eq!(s.kv.pool().num_free_blocks(), 6);
}

#[test]
fn prompt_chunks_beside_decodes_are_capped() {
    let mut s = scheduler(100, limits());
    s.enqueue(request(1, 20, 50));
    let sch = s.schedule(&mut NoLoads);
    advance(&mut s, &sch);
    // One sequence decodes; a 600-token prompt arrives beside it.
    s.enqueue(request(2, 600, 2));
    let sch = s.schedule(&mut NoLoads);
    // Decodes first, then at most max(64, 4 per decode) prompt tokens.
    assert_eq!(chunk_sizes(&sch), vec![1, 64]);
    advance(&mut s, &sch);
    // Alone, a prompt runs in chunks of the step's whole token budget.
    let mut alone = scheduler(100, limits());
    alone.enqueue(request(3, 600, 2));
    assert_eq!(chunk_sizes(&alone.schedule(&mut NoLoads)), vec![256]);
}

#[test]
fn a_request_larger_than_the_pool_fails_alone() {
    let mut s = scheduler(8, limits());
    s.enqueue(request(1, 200, 4));
    s.enqueue(request(2, 30, 4));
    let sch = s.schedule(&mut NoLoads);
    assert_eq!(sch.failed.len(), 1);
    let (failed, err) = &sch.failed[0];
    assert_eq!(failed.all_ids[0], 10_000);
    assert!(
        matches!(err, RequestError::TooLarge(m) if m.contains("14 KV blocks")),
        "{err:?}"
    );
    assert_eq!(failed.kv.seq, None, "a failed request holds no blocks");
    // The next request is admitted and scheduled in the same step.
    assert_eq!(chunk_sizes(&sch), vec![30]);
}

#[test]
fn a_budgeted_prompt_is_one_chunk_up_to_its_prompt_end() {
    // An evicting sequence's prompt ends its chunk (selection runs there); its replayed
    // tokens after a preemption go one at a time.
    let mut s = scheduler(100, limits());
    let mut seq = request(1, 100, 4);
    let units = pk_kv::selection_units(KvGranularity::Shared, 2, 2, |_| false);
    seq.eviction = Some(SeqEviction::new(
        PolicySpec::default(),
        64,
        KvGranularity::Shared,
        units,
    ));
    seq.all_ids.extend([1, 1]);
    s.enqueue(seq);
    assert_eq!(chunk_sizes(&s.schedule(&mut NoLoads)), vec![100]);
}

#[test]
fn n_choices_fork_the_computed_prompt_or_wait_to_recompute_it() {
    let events = Arc::new(Mutex::new(Vec::<SeqEvent>::new()));
    let mut s = scheduler(6, limits());
    let mut parent = request(1, 40, 8);
    let sink_events = events.clone();
    parent.req.sink = Box::new(move |e| {
        sink_events.lock().unwrap().push(e);
        true
    });
    s.enqueue(parent);
    let sch = s.schedule(&mut NoLoads);
    assert_eq!(chunk_sizes(&sch), vec![40]);
    let parent_seq = sch.chunks[0].seq;
    // Room for the partial last block's copy: the child shares the two full blocks.
    let child = s.running[0].new_choice(1);
    let (child, copies) = s.fork(parent_seq, child, 40).expect("a free block");
    assert_eq!((child.kv.num_computed, copies.len()), (40, 1));
    s.running.push(child);
    assert_eq!(s.kv.pool().num_free_blocks(), 6 - 3 - 1);
    // No room: the next child waits at the head of the queue to recompute its prompt.
    let hog = s.new_seq_id();
    let none = s.kv.get_computed_prefix(&[], &[]);
    s.kv.add_sequence(hog, &none);
    s.kv.allocate_slots(hog, 2 * BLOCK_TOKENS as u32)
        .expect("two blocks");
    let child = s.running[0].new_choice(2);
    assert!(s.fork(parent_seq, child, 40).is_none());
    let queued = s.waiting.front().expect("queued");
    assert_eq!(
        (queued.kv.num_computed, queued.kv.seq, queued.choice),
        (0, None, 2)
    );
    s.kv.check_invariants();
}
