//! What a context-reuse hit costs the model, past the load: the forward pass of a short
//! query (default 24 tokens) after a long stored context (default 1,536 tokens), as
//! EVICPRESS's TTFT pays it on every hit, and the share of it spent in attention over the
//! stored tokens (`paged_attention` alone for the same rows, all layers).
//!
//! Run: `cargo run --release -p pk-model --example hit_bench [-- --threads N --context C
//! --query Q --reps R --model PATH]`.

use std::time::Instant;

use clap::Parser;
use pk_gguf::GgufFile;
use pk_model::attention::{paged_attention, AttnSeq, AttnShape};
use pk_model::{KvDtype, KvGeometry, KvStore, Llama, SeqForward};

/// What a context-reuse hit costs the model past the load, and attention's share of it.
#[derive(Parser)]
#[command(name = "hit_bench")]
struct Args {
    /// Threads of rayon's pool, which the forward pass runs on.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Stored context tokens the query attends to.
    #[arg(long, default_value_t = 1536)]
    context: usize,
    /// Query tokens run after the stored context.
    #[arg(long, default_value_t = 24)]
    query: usize,
    /// Timed runs of each measurement; the median is printed.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// The GGUF model; SmolLM2-135M-Instruct Q4_1 in `~/.cache/pagekeeper` without it.
    #[arg(long, value_name = "PATH")]
    model: Option<String>,
    /// Store the KV in f32 instead of f16.
    #[arg(long)]
    f32: bool,
}

fn main() {
    let args = Args::parse();
    let (threads, context, query, reps) = (args.threads, args.context, args.query, args.reps);
    let path = args.model.unwrap_or_else(|| {
        format!(
            "{}/.cache/pagekeeper/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap()
        )
    });
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .unwrap();
    let model = Llama::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let c = &model.config;
    let bs = 16;
    let g = KvGeometry {
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        block_size_tokens: bs,
        num_blocks: (context + query).div_ceil(bs),
    };
    let dtype = if args.f32 { KvDtype::F32 } else { KvDtype::F16 };
    let mut store = KvStore::new(g, dtype);
    let table: Vec<u32> = (0..g.num_blocks as u32).collect();
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| 1 + (i * 7919) % 40000)
        .collect();
    model.forward(
        &mut store,
        &[SeqForward {
            tokens: &prompt,
            start_position: 0,
            stored_start: 0,
            block_table: &table,
            logits_from: context,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        }],
    );
    let q_ids: Vec<u32> = (0..query as u32).map(|i| 100 + i * 13).collect();
    let fwd = SeqForward {
        tokens: &q_ids,
        start_position: context,
        stored_start: context,
        block_table: &table,
        logits_from: query - 1,
        stored_positions: &[],
        window_tables: &[],
        head_first_keys: &[],
    };
    let mut hit = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        std::hint::black_box(model.forward(&mut store, &[fwd]));
        hit.push(t.elapsed().as_secs_f64());
    }
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
    };
    let q: Vec<f32> = (0..query * c.n_heads * c.head_dim)
        .map(|i| ((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut out = vec![0f32; q.len()];
    let seq = AttnSeq {
        block_table: &table,
        stored_start: context,
        n_queries: query,
        row_offset: 0,
        head_first_keys: &[],
    };
    let mut attn = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        for layer in 0..c.n_layers {
            paged_attention(&store, layer, shape, &[seq], &q, &mut out);
        }
        attn.push(t.elapsed().as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (h, a) = (med(&mut hit), med(&mut attn));
    let flops = 4.0
        * (query * c.n_heads * c.head_dim) as f64
        * (context as f64 + query as f64 / 2.0)
        * c.n_layers as f64;
    println!(
        "threads {threads} context {context} query {query}: forward {:.2} ms (median of {reps}) | attention {:.2} ms ({:.0} GFLOP/s, {:.0} % of the forward) | rest {:.2} ms",
        h * 1e3,
        a * 1e3,
        flops / a / 1e9,
        100.0 * a / h,
        (h - a) * 1e3
    );
}
