//! `CudaBackend` behind the engine's seam (`pk_model::Backend`): block operations against
//! the CPU store, the forward pass with captured queries against `CpuBackend`, and the
//! engine itself on the GPU against the CPU engine with the real default model. Every test
//! needs a GPU, so each is `#[ignore]`d (cargo's summary counts them as ignored on machines
//! without one) and fails when run without one; scripts/gpu/check.sh runs them with
//! `--include-ignored`. The `real_model` ones also need the model file (check.sh runs them in
//! its second call, where the model is assembled).

mod common;

use common::*;
use pk_cuda::{ActDtype, CudaBackend, GpuLlama, GpuWeights};
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_gguf::GgmlType;
use pk_model::weights::Weights;
use pk_model::{
    Backend, CpuBackend, KvBlocks, KvDtype, KvGeometry, KvStore, Llama, ModelConfig, SeqForward,
};

fn small_config() -> ModelConfig {
    let mut cfg = ModelConfig::dummy("smollm2-135m").unwrap();
    cfg.n_layers = 2;
    cfg.vocab_size = 4096;
    cfg
}

fn geometry(cfg: &ModelConfig, num_blocks: usize) -> KvGeometry {
    KvGeometry {
        n_layers: cfg.n_layers,
        n_kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        block_size_tokens: 16,
        num_blocks,
    }
}

/// The same random f16 weights on the CPU and on the GPU.
fn backends(act: ActDtype, num_blocks: usize) -> (CpuBackend, CudaBackend) {
    let gpu = gpu(act);
    let cfg = small_config();
    let g = geometry(&cfg, num_blocks);
    let cpu = Llama::new(cfg.clone(), Weights::random(&cfg, GgmlType::F16, 7));
    let weights = GpuWeights::from_cpu(&gpu, &cpu.weights, &cfg).unwrap();
    let model = GpuLlama::new(&gpu, cfg, weights).unwrap();
    (
        CpuBackend::new(cpu, g, KvDtype::F16),
        CudaBackend::new(gpu, model, g).unwrap(),
    )
}

/// Every K and V row of `block` in both pools.
fn assert_same_block(what: &str, a: &dyn KvBlocks, b: &dyn KvBlocks, block: u32) {
    let g = a.geometry();
    let (mut x, mut y) = (
        vec![0f32; g.block_size_tokens * g.head_dim],
        vec![0f32; g.block_size_tokens * g.head_dim],
    );
    for layer in 0..g.n_layers {
        for h in 0..g.n_kv_heads {
            a.read_k(layer, block, h, &mut x);
            b.read_k(layer, block, h, &mut y);
            assert_eq!(x, y, "{what}: K of layer {layer}, block {block}, head {h}");
            a.read_v(layer, block, h, &mut x);
            b.read_v(layer, block, h, &mut y);
            assert_eq!(x, y, "{what}: V of layer {layer}, block {block}, head {h}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn kv_blocks_round_trip_like_the_cpu_store() {
    let (_, mut gpu) = backends(ActDtype::F16, 4);
    let g = gpu.geometry();
    let mut cpu = KvStore::new(g, KvDtype::F16);
    let mut r = rng(11);
    let kvd = g.n_kv_heads * g.head_dim;
    let (k, v) = (uniform(&mut r, kvd, 3.0), uniform(&mut r, kvd, 3.0));
    for store in [&mut cpu as &mut dyn KvBlocks, &mut gpu] {
        store.write_token(1, 2, 3, &k, &v);
    }
    // The row comes back as its f16 rounding, exactly (both round to nearest even).
    let mut row = vec![0f32; 16 * g.head_dim];
    for h in 0..g.n_kv_heads {
        gpu.read_k(1, 2, h, &mut row);
        let want: Vec<f32> = k[h * g.head_dim..(h + 1) * g.head_dim]
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        assert_eq!(
            &row[3 * g.head_dim..4 * g.head_dim],
            &want[..],
            "K head {h}"
        );
        gpu.read_v(1, 2, h, &mut row);
        let want: Vec<f32> = v[h * g.head_dim..(h + 1) * g.head_dim]
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        assert_eq!(
            &row[3 * g.head_dim..4 * g.head_dim],
            &want[..],
            "V head {h}"
        );
    }
    // A partial read covers the first slots only.
    let mut first = vec![0f32; 4 * g.head_dim];
    gpu.read_k(1, 2, 0, &mut first);
    assert_eq!(&first[3 * g.head_dim..], &half_round(&k[..g.head_dim])[..]);
    // Bulk rows, then a compaction copy, then the whole pool against the CPU store's.
    let n = 9;
    let (kr, vr) = (
        uniform(&mut r, n * g.head_dim, 2.0),
        uniform(&mut r, n * g.head_dim, 2.0),
    );
    let mut scratch = Vec::new();
    for store in [&mut cpu as &mut dyn KvBlocks, &mut gpu] {
        store.write_head_rows(0, 1, 2, 5, &kr, &vr, &mut scratch);
        store.copy_slot((2, 3), (0, 15));
        store.copy_slot((1, 7), (3, 0));
    }
    for block in 0..4 {
        assert_same_block("after writes and copies", &cpu, &gpu, block);
    }
}

/// Bulk token ranges (pinned staging, the copy stream, `kv_scatter`/`kv_gather`) write and
/// read exactly what the CPU store's per-block forms do, with staging slots that hold the
/// whole range, whole layers, or only a few tokens of one layer; and the copy stream is
/// ordered against the compute stream both ways (a row written just before a bulk read is
/// in it, a bulk write is visible to the very next block read and forward pass).
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn bulk_token_ranges_match_the_cpu_store_and_order_the_streams() {
    let (_, mut gpu) = backends(ActDtype::F16, 12);
    let g = gpu.geometry();
    let table = [7u32, 2, 11, 0, 5, 9];
    let per_token = g.n_layers * g.n_kv_heads * g.head_dim;
    let mut r = rng(23);
    // One CPU store for all cases, as the GPU pool keeps every earlier case's rows too.
    let mut cpu = KvStore::new(g, KvDtype::F16);
    for staging in [
        8usize << 20,
        2 * 2 * g.n_kv_heads * g.head_dim * 40,
        2 * 2 * g.n_kv_heads * g.head_dim * 3,
    ] {
        gpu.set_staging_bytes(staging).unwrap();
        for (first, n) in [(0usize, 96usize), (5, 40), (17, 1), (33, 0)] {
            let (k, v) = (
                uniform(&mut r, n * per_token, 3.0),
                uniform(&mut r, n * per_token, 3.0),
            );
            KvBlocks::write_tokens(&mut cpu, &table, first, &k, &v);
            gpu.write_tokens(&table, first, &k, &v);
            for &block in &table {
                assert_same_block(
                    &format!("staging {staging}, tokens {first}+{n}"),
                    &cpu,
                    &gpu,
                    block,
                );
            }
            let (mut kb, mut vb) = (vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
            gpu.read_tokens(&table, first, &mut kb, &mut vb).unwrap();
            assert_eq!(
                (half_round(&k), half_round(&v)),
                (kb, vb),
                "staging {staging}, tokens {first}+{n} read back"
            );
        }
    }
    let stats = gpu.transfer_stats();
    assert!(
        stats.writes >= 9 && stats.reads >= 9 && stats.pieces > stats.writes + stats.reads,
        "{stats:?}"
    );
    // A row written on the compute stream, then read at once by the copy stream.
    let rows = uniform(&mut r, 2 * g.head_dim, 1.0);
    let mut scratch = Vec::new();
    gpu.write_head_rows(1, table[0], 2, 4, &rows, &rows, &mut scratch);
    let n = 6;
    let (mut kb, mut vb) = (vec![0f32; n * per_token], vec![0f32; n * per_token]);
    gpu.read_tokens(&table, 0, &mut kb, &mut vb).unwrap();
    let at = ((g.n_kv_heads + 2) * n + 4) * g.head_dim; // layer 1, head 2, token 4
    assert_eq!(&kb[at..at + 2 * g.head_dim], &half_round(&rows)[..]);
}

fn half_round(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn forward_with_queries_matches_the_cpu_backend() {
    let (mut cpu, mut gpu) = backends(ActDtype::F16, 8);
    let cfg = small_config();
    let a: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 4096).collect();
    let b: Vec<u32> = (0..20).map(|i| (i * 101 + 3) % 4096).collect();
    let (ta, tb) = ([0u32, 1, 2, 3], [4u32, 5, 6, 7]);
    let seqs = [
        SeqForward {
            tokens: &a,
            start_position: 0,
            stored_start: 0,
            block_table: &ta,
            logits_from: 39,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        },
        SeqForward {
            tokens: &b,
            start_position: 0,
            stored_start: 0,
            block_table: &tb,
            logits_from: 20,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        },
    ];
    // Sequence 0 captures its last 3 queries, sequence 1 its last one (a missing entry: none
    // for a third sequence, as on the CPU).
    for capture in [&[3usize, 1][..], &[0, 5][..], &[][..]] {
        let (want_logits, want_q) = cpu.forward_with_queries(&seqs, capture).unwrap();
        let (got_logits, got_q) = gpu.forward_with_queries(&seqs, capture).unwrap();
        assert_close(
            &format!("logits, capture {capture:?}"),
            &got_logits,
            &want_logits,
            0.02,
            0.0,
        );
        assert_eq!(got_q.len(), 2);
        for (i, (g, w)) in got_q.iter().zip(&want_q).enumerate() {
            assert_eq!(
                g.len(),
                cfg.n_layers * capture.get(i).copied().unwrap_or(0) * cfg.q_dim(),
                "sequence {i}: [layer][token][q_dim]"
            );
            // Q comes from an f16-operand GEMM on the GPU and from f32 on the CPU.
            assert_close(
                &format!("queries of sequence {i}, capture {capture:?}"),
                g,
                w,
                0.02,
                0.01,
            );
        }
    }
    // The K/V both wrote agree within f16 rounding of slightly different arithmetic.
    let g = gpu.geometry();
    let (mut x, mut y) = (vec![0f32; 16 * g.head_dim], vec![0f32; 16 * g.head_dim]);
    for (layer, block, h) in [(0, 0, 0), (1, 2, 1), (1, 5, 2)] {
        cpu.kv().read_k(layer, block, h, &mut x);
        gpu.read_k(layer, block, h, &mut y);
        assert_close(
            &format!("K layer {layer} block {block} head {h}"),
            &y,
            &x,
            0.02,
            0.01,
        );
        cpu.kv().read_v(layer, block, h, &mut x);
        gpu.read_v(layer, block, h, &mut y);
        assert_close(
            &format!("V layer {layer} block {block} head {h}"),
            &y,
            &x,
            0.02,
            0.01,
        );
    }
}

/// The real default model (the engine tests' path: `$PAGEKEEPER_HOME`), which must exist.
fn model_path() -> std::path::PathBuf {
    let p = pk_engine::model_store::default_model_path();
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model` first",
        p.display()
    );
    p
}

fn cuda_engine(gpu: pk_cuda::Gpu, config: EngineConfig) -> Engine {
    Engine::load_with(&model_path(), config, |f, geometry, dtype| {
        Ok(Box::new(CudaBackend::from_gguf(gpu, f, geometry, dtype)?))
    })
    .expect("CUDA engine loads")
}

fn config() -> EngineConfig {
    EngineConfig {
        kv_capacity_tokens: Some(1024),
        ..Default::default()
    }
}

/// Greedy tokens of the engine on the GPU against the engine on the CPU. The two compute
/// differently (f16 GEMM operands against 8-bit quantised activations), so they may rank a
/// near tie differently, after which the texts differ legitimately. The tolerance: the
/// tokens agree up to the first divergence, which must be at least 4 tokens in (this
/// prompt's first five CPU margins are 0.79 logits or more) and at a position where the
/// CPU's top two logits are within 0.5 of each other.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn real_model_engine_greedy_matches_cpu() {
    let gpu = gpu(ActDtype::F16);
    let mut on_gpu = cuda_engine(gpu, config());
    assert_eq!(on_gpu.backend().name(), "cuda");
    let mut on_cpu = Engine::load(&model_path(), config()).unwrap();
    let ids = on_cpu.tokenizer.encode("The capital of France is", true);
    let params = GenerateParams {
        max_tokens: 16,
        ignore_eos: true,
        ..Default::default()
    };
    let want = on_cpu.generate(&ids, &params, &mut |_| {}).unwrap();
    let got = on_gpu.generate(&ids, &params, &mut |_| {}).unwrap();
    let rows = on_cpu
        .teacher_force(&ids, &want.token_ids, &params)
        .unwrap();
    let margin = |r: &Vec<f32>| {
        let mut s = r.clone();
        s.sort_by(|a, b| b.total_cmp(a));
        s[0] - s[1]
    };
    eprintln!("cpu: {:?}\ncuda: {:?}", want.text, got.text);
    assert_eq!(got.token_ids.len(), 16);
    if let Some(d) = (0..16).find(|&i| got.token_ids[i] != want.token_ids[i]) {
        assert!(
            d >= 4,
            "diverged at token {d}: {:?} vs {:?}",
            got.token_ids,
            want.token_ids
        );
        assert!(
            margin(&rows[d]) < 0.5,
            "diverged at token {d}, where the CPU's margin is {:.3} logits",
            margin(&rows[d])
        );
    }
    // A repeat hits the pool's prefix cache: the same tokens from the cached blocks.
    let again = on_gpu.generate(&ids, &params, &mut |_| {}).unwrap();
    assert!(
        again.cached_prompt_tokens > 0 || ids.len() <= 16,
        "no prefix-cache hit"
    );
    assert_eq!(again.token_ids, got.token_ids);
    on_gpu.check_invariants();
}

/// An attention-scored policy on the GPU: prefill and decode queries captured on the
/// device, K read back a block at a time for scoring, kept tokens compacted by device
/// copies, blocks evicted while decoding. The first token comes from exact prefill attention
/// and must be the CPU's; the rest depend on scores computed from slightly different K/V.
#[test]
#[ignore = "needs an NVIDIA GPU: scripts/gpu/check.sh runs it on one with --include-ignored"]
fn real_model_snapkv_eviction_runs_on_the_gpu() {
    let gpu = gpu(ActDtype::F16);
    let mut on_gpu = cuda_engine(gpu, config());
    let mut on_cpu = Engine::load(&model_path(), config()).unwrap();
    let text =
        "Phileas Fogg lived, in 1872, at No. 7, Saville Row, Burlington Gardens. ".repeat(12);
    let ids = on_cpu.tokenizer.encode(&text, true);
    assert!(ids.len() > 150, "the prompt must exceed the budget");
    let params = GenerateParams {
        max_tokens: 40,
        ignore_eos: true,
        kv_policy: Some("snapkv".parse().unwrap()),
        kv_budget: Some(64),
        ..Default::default()
    };
    let want = on_cpu.generate(&ids, &params, &mut |_| {}).unwrap();
    let got = on_gpu.generate(&ids, &params, &mut |_| {}).unwrap();
    eprintln!("cpu: {:?}\ncuda: {:?}", want.text, got.text);
    assert_eq!(got.token_ids.len(), 40);
    assert_eq!(got.token_ids[0], want.token_ids[0]);
    assert!(
        got.kv_stored_tokens <= 64 + 16,
        "stored {} tokens over a budget of 64",
        got.kv_stored_tokens
    );
    assert!(on_gpu.eviction_stats["snapkv"].pruned_prompt_tokens > 0);
    on_gpu.check_invariants();
}
