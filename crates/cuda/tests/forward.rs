//! The GPU forward pass against the CPU's (`pk_model::Llama`) on the same random weights:
//! a prefill, decode steps, a batch of two sequences, and a decode after a block was evicted
//! (compacted block table, stored index behind the position). Every test needs a GPU: each is
//! `#[ignore]`d, and fails when run without one (scripts/gpu/check.sh runs them with
//! `--include-ignored`).

mod common;

use common::*;
use pk_cuda::{ActDtype, GpuKvPool, GpuLlama, GpuWeights};
use pk_gguf::GgmlType;
use pk_model::weights::Weights;
use pk_model::{KvDtype, KvGeometry, KvStore, Llama, ModelConfig, SeqForward};

/// Logits agree within `abs`, and the top token agrees wherever the CPU's top two are
/// further apart than that.
fn assert_logits(what: &str, got: &[f32], want: &[f32], vocab: usize, abs: f32) {
    assert_close(what, got, want, abs, 0.0);
    for (r, (g, w)) in got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .enumerate()
    {
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let argmax = |x: &[f32]| {
            x.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        };
        if sorted[0] - sorted[1] > 2.0 * abs {
            assert_eq!(argmax(g), argmax(w), "{what}: row {r}: top token differs");
        }
    }
}

fn small_config() -> ModelConfig {
    let mut cfg = ModelConfig::dummy("smollm2-135m").unwrap();
    cfg.n_layers = 2;
    cfg.vocab_size = 4096;
    cfg
}

fn run(act: ActDtype, abs: f32, graphs: bool) {
    let gpu = gpu(act);
    let cfg = small_config();
    let cpu = Llama::new(cfg.clone(), Weights::random(&cfg, GgmlType::F16, 7));
    let weights = GpuWeights::from_cpu(&gpu, &cpu.weights, &cfg).unwrap();
    let mut model = GpuLlama::new(&gpu, cfg.clone(), weights).unwrap();
    model.set_graphs(graphs);
    let g = KvGeometry {
        n_layers: cfg.n_layers,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        block_size_tokens: 16,
        num_blocks: 16,
    };
    let mut store = KvStore::new(g, KvDtype::F16);
    let mut pool = GpuKvPool::new(&gpu, g).unwrap();
    let v = cfg.vocab_size;
    let prompt: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % 4096).collect();
    let other: Vec<u32> = (0..20).map(|i| (i * 101 + 3) % 4096).collect();
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (8..16).collect());

    let mut both = |seqs: &[SeqForward], what: &str| {
        let want = cpu.forward(&mut store, seqs);
        let got = model.forward(&gpu, &mut pool, seqs).unwrap();
        assert_logits(
            &format!("{what} ({act:?}, graphs {graphs})"),
            &got,
            &want,
            v,
            abs,
        );
        let greedy = model.forward_argmax(&gpu, &mut pool, seqs);
        greedy.unwrap()
    };
    // Prefill with logits for every row (the perplexity shape), twice: the argmax call
    // rewrites the same K/V, which must not change anything.
    both(
        &[SeqForward {
            tokens: &prompt,
            start_position: 0,
            stored_start: 0,
            block_table: &ta,
            logits_from: 0,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        }],
        "prefill",
    );
    // A decode step of sequence A batched with sequence B's prompt.
    both(
        &[
            SeqForward {
                tokens: &[11],
                start_position: 48,
                stored_start: 48,
                block_table: &ta,
                logits_from: 0,
                stored_positions: &[],
                window_tables: &[],
                head_first_keys: &[],
            },
            SeqForward {
                tokens: &other,
                start_position: 0,
                stored_start: 0,
                block_table: &tb,
                logits_from: 19,
                stored_positions: &[],
                window_tables: &[],
                head_first_keys: &[],
            },
        ],
        "decode + prompt",
    );
    // Evict A's block 1 (stored tokens 16..32): the table is compacted, 33 tokens remain
    // stored, positions go on from 49.
    let compacted = [0u32, 2, 3, 4];
    both(
        &[SeqForward {
            tokens: &[12],
            start_position: 49,
            stored_start: 33,
            block_table: &compacted,
            logits_from: 0,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        }],
        "decode after eviction",
    );
    // Enough same-shaped steps that a captured graph is replayed several times.
    for step in 0..5u32 {
        let pos = 50 + step as usize;
        both(
            &[SeqForward {
                tokens: &[100 + step],
                start_position: pos,
                stored_start: pos - 16,
                block_table: &compacted,
                logits_from: 0,
                stored_positions: &[],
                window_tables: &[],
                head_first_keys: &[],
            }],
            "decode",
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn forward_matches_cpu_f16() {
    // Weights are exact in f16; activations are rounded to f16 before each GEMM.
    run(ActDtype::F16, 0.02, false);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn forward_matches_cpu_f16_with_cuda_graphs() {
    // Decode steps captured once per shape and replayed: the same results as eager launches.
    run(ActDtype::F16, 0.02, true);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn forward_matches_cpu_bf16() {
    // bf16 activations carry 8 significant bits: a looser bound.
    run(ActDtype::Bf16, 0.15, false);
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn random_weights_are_made_on_the_device_and_run() {
    let gpu = gpu(ActDtype::Bf16);
    let cfg = small_config();
    let weights = GpuWeights::random(&gpu, &cfg, 1).unwrap();
    assert_eq!(
        weights.bytes_per_token(),
        2 * cfg.n_layers
            * (cfg.d_model * (cfg.q_dim() + 2 * cfg.kv_dim())
                + cfg.q_dim() * cfg.d_model
                + 3 * cfg.d_model * cfg.d_ff)
            + 2 * cfg.vocab_size * cfg.d_model
    );
    let mut model = GpuLlama::new(&gpu, cfg.clone(), weights).unwrap();
    let g = KvGeometry {
        n_layers: cfg.n_layers,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        block_size_tokens: 16,
        num_blocks: 4,
    };
    let mut pool = GpuKvPool::new(&gpu, g).unwrap();
    let table = [0u32, 1, 2, 3];
    // A batch without tokens before any other call (no scratch buffers yet): no rows.
    let empty = SeqForward {
        tokens: &[],
        start_position: 0,
        stored_start: 0,
        block_table: &table,
        logits_from: 0,
        stored_positions: &[],
        window_tables: &[],
        head_first_keys: &[],
    };
    assert!(model.forward(&gpu, &mut pool, &[empty]).unwrap().is_empty());
    assert!(model
        .forward_argmax(&gpu, &mut pool, &[empty])
        .unwrap()
        .is_empty());
    let prompt: Vec<u32> = (0..30).collect();
    let logits = model
        .forward(
            &gpu,
            &mut pool,
            &[SeqForward {
                tokens: &prompt,
                start_position: 0,
                stored_start: 0,
                block_table: &table,
                logits_from: 0,
                stored_positions: &[],
                window_tables: &[],
                head_first_keys: &[],
            }],
        )
        .unwrap();
    assert_eq!(logits.len(), 30 * cfg.vocab_size);
    assert!(logits.iter().all(|x| x.is_finite()));
    let spread = logits.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        spread > 0.0,
        "all logits are zero: the random fill wrote nothing"
    );
}
