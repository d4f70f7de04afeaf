//! `bench perf --device cuda` and `perplexity --device cuda`: the model on an NVIDIA GPU
//! through pk-cuda (cargo feature `cuda`), without the engine. Each sequence gets its own
//! contiguous run of blocks of a device pool and `GpuLlama` runs directly (see
//! ARCHITECTURE.md). `serve` and `generate` run the engine over a `CudaBackend` instead
//! (device.rs). Without the feature, every `--device cuda` says how to build it.

use pk_engine::perplexity::PerplexityResult;

use crate::args::{PerfArgs, PerplexityArgs};

#[cfg(not(feature = "cuda"))]
use crate::device::NO_FEATURE;

#[cfg(not(feature = "cuda"))]
pub fn perf(_a: &PerfArgs) -> anyhow::Result<()> {
    anyhow::bail!(NO_FEATURE)
}

/// The perplexity of `a.file` on the GPU (printed by the command, as the CPU's is).
#[cfg(not(feature = "cuda"))]
pub fn perplexity(_a: &PerplexityArgs) -> anyhow::Result<PerplexityResult> {
    anyhow::bail!(NO_FEATURE)
}

#[cfg(feature = "cuda")]
pub use imp::{perf, perplexity};

#[cfg(feature = "cuda")]
mod imp {
    use std::time::Instant;

    use anyhow::{bail, Context, Result};
    use pk_cuda::{ActDtype, Gpu, GpuKvPool, GpuLlama, GpuWeights};
    use pk_model::{KvGeometry, ModelConfig, SeqForward};
    use rand::{Rng, SeedableRng};

    use super::{PerfArgs, PerplexityArgs, PerplexityResult};
    use crate::device::open_gpu;

    /// A model file's weights on the GPU (f16 operands by default: closer to the CPU's f32).
    fn load_file(path: &std::path::Path) -> Result<(Gpu, GpuLlama, pk_gguf::GgufFile)> {
        let f =
            pk_gguf::GgufFile::open(path).with_context(|| format!("loading {}", path.display()))?;
        let cfg = ModelConfig::from_gguf(&f)?;
        let gpu = open_gpu(ActDtype::F16)?;
        let weights = GpuWeights::from_gguf(&gpu, &f, &cfg)?;
        let model = GpuLlama::new(&gpu, cfg, weights)?;
        Ok((gpu, model, f))
    }

    /// Sequences' block tables: sequence s owns blocks `s * per_seq .. (s + 1) * per_seq`.
    fn tables(n_seqs: usize, per_seq: usize) -> Vec<Vec<u32>> {
        (0..n_seqs)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect()
    }

    pub fn perplexity(a: &PerplexityArgs) -> Result<PerplexityResult> {
        let bytes =
            std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
        let text = String::from_utf8_lossy(&bytes);
        let path =
            pk_engine::model_store::resolve_model(a.model.resolved()?.model.as_deref(), true)?;
        let (gpu, mut model, f) = load_file(&path)?;
        let tokenizer = pk_tokenizer::Tokenizer::from_gguf(&f)?;
        let ids = tokenizer.encode(&text, false);
        let bos = tokenizer.add_bos().then(|| tokenizer.bos_id()).flatten();
        let bs = a.model.block_size as usize;
        let c = model.config.clone();
        let geometry = KvGeometry {
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_size_tokens: bs,
            num_blocks: a.ctx.div_ceil(bs),
        };
        let mut pool = GpuKvPool::new(&gpu, geometry)?;
        let table = &tables(1, geometry.num_blocks)[0];
        let n_chunks = a
            .chunks
            .map_or(ids.len() / a.ctx, |c| c.min(ids.len() / a.ctx));
        eprintln!(
            "perplexity (cuda): {} tokens, calculating over {n_chunks} chunks, n_ctx={}",
            ids.len(),
            a.ctx
        );
        let t0 = Instant::now();
        // Each chunk is a fresh sequence over the same blocks, in one forward call.
        let mut score = |chunk: &[u32], first: usize| -> Result<Vec<f32>> {
            let seq = SeqForward {
                tokens: chunk,
                start_position: 0,
                stored_start: 0,
                block_table: table,
                logits_from: first,
                stored_positions: &[],
                window_tables: &[],
                head_first_keys: &[],
            };
            Ok(model.forward(&gpu, &mut pool, &[seq])?)
        };
        let r = pk_engine::perplexity::perplexity_with(
            &mut score,
            c.vocab_size,
            bos,
            &ids,
            a.ctx,
            a.chunks,
            &mut |i, ppl| {
                eprint!("[{i}]{ppl:.4},");
                if i == 1 {
                    eprint!(
                        " ({:.3} s for the first chunk) ",
                        t0.elapsed().as_secs_f64()
                    );
                }
            },
        )?;
        eprintln!();
        Ok(r)
    }

    /// Device-to-device copy bandwidth (bytes read + written per second, best of 5), the
    /// roof that decode's weight streaming is measured against in the same run.
    fn copy_bandwidth_bytes_s(gpu: &Gpu) -> Result<f64> {
        let n = 1usize << 30; // 2 GiB of u16 each way
        let src = gpu.alloc::<u16>(n)?;
        let mut dst = gpu.alloc::<u16>(n)?;
        let mut best = f64::MAX;
        for _ in 0..5 {
            gpu.synchronize()?;
            let t = Instant::now();
            gpu.stream.memcpy_dtod(&src, &mut dst)?;
            gpu.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(2.0 * 2.0 * n as f64 / best)
    }

    pub fn perf(a: &PerfArgs) -> Result<()> {
        let (gpu, mut model, name) = perf_model(a)?;
        let c = model.config.clone();
        let max_ctx = *a.contexts.iter().max().expect("checked non-empty");
        let max_batch = *a.batch.iter().max().expect("checked non-empty");
        if max_ctx + a.decode_tokens > c.context_length {
            bail!(
                "context {max_ctx} + {} decode tokens exceeds the model's context {}",
                a.decode_tokens,
                c.context_length
            );
        }
        let bs = a.model.block_size as usize;
        // Decode steps per run: the first is an untimed warm-up, so at least two.
        let steps = a.decode_tokens.max(2);
        let per_seq = (max_ctx + steps + 1).div_ceil(bs);
        let geometry = KvGeometry {
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            block_size_tokens: bs,
            num_blocks: per_seq * max_batch,
        };
        let mut run = PerfRun {
            pool: GpuKvPool::new(&gpu, geometry)?,
            tables: tables(max_batch, per_seq),
            weight_bytes: model.weights.bytes_per_token(),
            kv_bytes_per_token: 2 * 2 * c.n_layers * c.kv_dim(),
            copy_bw: copy_bandwidth_bytes_s(&gpu)?,
            steps,
            gpu,
        };
        eprintln!(
            "model {name} | block {bs} | CUDA graphs {} (PK_CUDA_GRAPHS=0 turns them off) | KV pool {:.1} GiB | weights read per step {:.2} GB | device copy bandwidth {:.0} GB/s (read + write)",
            if model.graphs_enabled() { "on" } else { "off" },
            run.pool.capacity_bytes() as f64 / (1u64 << 30) as f64,
            run.weight_bytes as f64 / 1e9,
            run.copy_bw / 1e9
        );
        if !a.json {
            println!(
                "{:>8} {:>6} {:>12} {:>8} {:>12} {:>10} {:>10} {:>8}",
                "context",
                "batch",
                "prefill t/s",
                "steps",
                "decode t/s",
                "ms/step",
                "GB/s",
                "of copy"
            );
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let mut runs = Vec::new();
        for &ctx in &a.contexts {
            for &batch in &a.batch {
                let prompts: Vec<Vec<u32>> = (0..batch)
                    .map(|_| {
                        (0..ctx)
                            .map(|_| rng.gen_range(1000..c.vocab_size as u32))
                            .collect()
                    })
                    .collect();
                runs.push(run.measure(&mut model, &prompts, a.json)?);
            }
        }
        if a.json {
            let v = serde_json::json!({
                "model": name,
                "device": run.gpu.name,
                "act_dtype": format!("{:?}", run.gpu.act),
                "cuda_graphs": model.graphs_enabled(),
                "weight_bytes_per_step": run.weight_bytes,
                "copy_bandwidth_bytes_s": run.copy_bw,
                "runs": runs,
            });
            println!("{v}");
        }
        Ok(())
    }

    /// `bench perf`'s model on the GPU and its name: random weights of a `--dummy` shape
    /// made on the device, or a model file's.
    fn perf_model(a: &PerfArgs) -> Result<(Gpu, GpuLlama, String)> {
        let Some(name) = &a.dummy else {
            let path =
                pk_engine::model_store::resolve_model(a.model.resolved()?.model.as_deref(), true)?;
            let (gpu, model, _) = load_file(&path)?;
            let name = path
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            return Ok((gpu, model, name));
        };
        let cfg = ModelConfig::dummy(name).with_context(|| {
            format!(
                "unknown --dummy {name:?} ({})",
                pk_model::config::DUMMY_SHAPES.join(", ")
            )
        })?;
        // Random weights are made on the device in bf16 (the setting), or in
        // f16 with --dummy-type F16 (or PK_CUDA_ACT); quantised types do not apply.
        let act = if a.dummy_type.eq_ignore_ascii_case("F16") {
            ActDtype::F16
        } else {
            ActDtype::Bf16
        };
        let gpu = open_gpu(act)?;
        let t = Instant::now();
        let weights = GpuWeights::random(&gpu, &cfg, 1)?;
        eprintln!(
            "random weights made on the device in {:.2} s",
            t.elapsed().as_secs_f64()
        );
        let model = GpuLlama::new(&gpu, cfg, weights)?;
        Ok((gpu, model, format!("dummy-{name}")))
    }

    /// What every (context, batch) run of `bench perf` shares: the device, its KV pool
    /// (each sequence its own contiguous blocks), and the byte counts the bandwidth
    /// figures are made of.
    struct PerfRun {
        gpu: Gpu,
        pool: GpuKvPool,
        tables: Vec<Vec<u32>>,
        weight_bytes: usize,
        kv_bytes_per_token: usize,
        /// Device-to-device copy bandwidth, bytes read + written per second.
        copy_bw: f64,
        /// Decode steps per run, the first an untimed warm-up.
        steps: usize,
    }

    impl PerfRun {
        /// Prefills `prompts` (one sequence each, all of one length) and decodes them
        /// together; returns the run's JSON object and prints its row unless `json`.
        fn measure(
            &mut self,
            model: &mut GpuLlama,
            prompts: &[Vec<u32>],
            json: bool,
        ) -> Result<serde_json::Value> {
            let (batch, ctx) = (prompts.len(), prompts[0].len());
            let (next, prefill_s) = self.prefill(model, prompts)?;
            let (timed_s, kv_bytes_read) = self.decode(model, next, ctx)?;
            let timed_steps = self.steps - 1;
            let bytes_s = (self.weight_bytes * timed_steps + kv_bytes_read) as f64 / timed_s;
            let run = serde_json::json!({
                "context_tokens": ctx,
                "batch": batch,
                "prefill_tok_s": (batch * ctx) as f64 / prefill_s,
                "decode_steps_timed": timed_steps,
                "decode_tok_s": (batch * timed_steps) as f64 / timed_s,
                "ms_per_step": 1e3 * timed_s / timed_steps as f64,
                "bytes_per_s": bytes_s,
                "fraction_of_copy_bandwidth": bytes_s / self.copy_bw,
            });
            if !json {
                println!(
                    "{:>8} {:>6} {:>12.1} {:>8} {:>12.1} {:>10.3} {:>10.0} {:>7.1}%",
                    ctx,
                    batch,
                    run["prefill_tok_s"].as_f64().unwrap(),
                    timed_steps,
                    run["decode_tok_s"].as_f64().unwrap(),
                    run["ms_per_step"].as_f64().unwrap(),
                    bytes_s / 1e9,
                    100.0 * bytes_s / self.copy_bw
                );
            }
            Ok(run)
        }

        /// Prefill: one sequence per call, as the CPU bench does; the greedy token of each
        /// prompt's last row starts its decode. Returns those tokens and the seconds taken.
        fn prefill(
            &mut self,
            model: &mut GpuLlama,
            prompts: &[Vec<u32>],
        ) -> Result<(Vec<u32>, f64)> {
            let ctx = prompts[0].len();
            self.gpu.synchronize()?;
            let t = Instant::now();
            let mut next = Vec::with_capacity(prompts.len());
            for (s, p) in prompts.iter().enumerate() {
                let seq = SeqForward {
                    tokens: p,
                    start_position: 0,
                    stored_start: 0,
                    block_table: &self.tables[s],
                    logits_from: ctx - 1,
                    stored_positions: &[],
                    window_tables: &[],
                    head_first_keys: &[],
                };
                next.push(model.forward_argmax(&self.gpu, &mut self.pool, &[seq])?[0]);
            }
            Ok((next, t.elapsed().as_secs_f64()))
        }

        /// Decode: every sequence one token per step after its `ctx` prompt tokens; the
        /// first step is a warm-up (cuBLAS picks its kernels for the new shapes) and is not
        /// timed. Returns the timed steps' seconds and the KV bytes they read.
        fn decode(
            &mut self,
            model: &mut GpuLlama,
            mut next: Vec<u32>,
            ctx: usize,
        ) -> Result<(f64, usize)> {
            let batch = next.len();
            let mut kv_bytes_read = 0usize;
            let mut timed_s = 0.0;
            for step in 0..self.steps {
                let pos = ctx + step;
                let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let seqs: Vec<SeqForward> = (0..batch)
                    .map(|s| SeqForward {
                        tokens: &toks[s],
                        start_position: pos,
                        stored_start: pos,
                        block_table: &self.tables[s],
                        logits_from: 0,
                        stored_positions: &[],
                        window_tables: &[],
                        head_first_keys: &[],
                    })
                    .collect();
                let t = Instant::now();
                next = model.forward_argmax(&self.gpu, &mut self.pool, &seqs)?;
                if step > 0 {
                    timed_s += t.elapsed().as_secs_f64();
                    kv_bytes_read += batch * (pos + 1) * self.kv_bytes_per_token;
                }
            }
            Ok((timed_s, kv_bytes_read))
        }
    }
}
