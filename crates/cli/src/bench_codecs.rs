//! `pagekeeper bench codecs`: the quality-vs-bytes frontier of every KV codec and ratio of
//! `pk-codec` on the loaded model (issue 8) — the input EVICPRESS profiles.
//!
//! For each sample, a prefix of the Verne text (default 1536 tokens) is run once through
//! the model into an f16 KV store, read back as a `KvContext`, compressed with a method
//! (quantisation, token dropping by an eviction policy's choice, or both), encoded and
//! decoded with the PKKV format (the bytes a tier would hold), and handed to the engine as
//! `GenerateParams::prefix_kv`; the next tokens of the text (default 64) are then teacher-
//! forced and compared with the uncompressed run: mean KL(full ‖ method), top-1 agreement
//! and perplexity. Bytes per token are the encoded size over the prefix's tokens.
//!
//! Dropping uses the eviction policies of `pk-kv` (`select_prefill` over the prefix's KV at
//! the budget the codec will keep), so "drop 0.5 by knorm" keeps exactly the tokens
//! `--kv-policy knorm` would keep at that budget; the codec then receives 1/0 scores.
//! KVzip ("drop 0.5 kvzip", EVICPRESS's `kvzip-0.5`) ranks by its reconstruction scores,
//! averaged over layers and KV heads, from the engine's own passes over the prefix.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use pk_codec::{decode, encode, DropSpec, KvContext, Method, Precision, QuantSpec};
use pk_connectors::PrefixKv;
use pk_engine::{Engine, GenerateParams};
use pk_kv::{DenseKv, PolicySpec};
use pk_model::{KvDtype, KvGeometry, KvStore, SeqForward};

#[derive(Args)]
pub struct CodecsArgs {
    #[command(flatten)]
    pub model: crate::args::ModelArgs,
    /// Tokens of the compressed prefix.
    #[arg(long, default_value_t = 1536)]
    pub prefix_tokens: usize,
    /// Teacher-forced tokens after the prefix, compared with the uncompressed run.
    #[arg(long, default_value_t = 64)]
    pub continuation_tokens: usize,
    /// Prefixes from evenly spaced places in the book; results are averaged.
    #[arg(long, default_value_t = 3)]
    pub samples: usize,
    /// Drop ratios (fraction of the prefix's tokens dropped), comma-separated.
    #[arg(
        long,
        default_value = "0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9",
        value_delimiter = ','
    )]
    pub ratios: Vec<f32>,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Policies whose choice drives dropping (they score keys and values, not queries).
const DROP_POLICIES: [&str; 4] = ["paged-eviction", "knorm", "keydiff", "streaming-llm"];

/// One compression configuration: a codec method plus, for dropping, whose scores.
#[derive(Clone)]
struct Config {
    name: String,
    method: Method,
    policy: Option<PolicySpec>,
}

/// KVzip drops by the scores of its reconstruction passes (issue 37), which need the model:
/// they come from one engine run per sample, not from the KV alone.
const KVZIP: &str = "kvzip";

fn configs(ratios: &[f32]) -> Result<Vec<Config>> {
    let q = |p| QuantSpec::uniform(p);
    let mut out = vec![Config {
        name: "none (f16)".into(),
        method: Method::None,
        policy: None,
    }];
    for (name, spec) in [
        ("q8", q(Precision::Q8)),
        ("q4", q(Precision::Q4)),
        ("q2", q(Precision::Q2)),
        ("K8V4", QuantSpec::kv(Precision::Q8, Precision::Q4)),
    ] {
        out.push(Config {
            name: name.into(),
            method: Method::Quant(spec),
            policy: None,
        });
    }
    for policy in DROP_POLICIES.into_iter().chain([KVZIP]) {
        let spec = drop_spec(policy)?;
        for &r in ratios {
            out.push(Config {
                name: format!("drop {r} {policy}"),
                method: Method::Drop(DropSpec::new(r)),
                policy: Some(spec),
            });
        }
    }
    // Dropping then quantising, with PagedEviction's scores.
    let spec = drop_spec("paged-eviction")?;
    for (qname, qs) in [("q8", q(Precision::Q8)), ("q4", q(Precision::Q4))] {
        for &r in ratios {
            out.push(Config {
                name: format!("drop {r} paged-eviction + {qname}"),
                method: Method::DropQuant(DropSpec::new(r), qs),
                policy: Some(spec),
            });
        }
    }
    Ok(out)
}

/// The policy whose choice a drop row uses. PagedEviction's is its ‖v‖/‖k‖ ratio over
/// every token (`paged-eviction:ratio:global`), the score EVICPRESS's `paged-eviction-R`
/// codec drops by, so that these rows are the codec EVICPRESS places; the engine's own
/// default (‖v‖, per KV head) selects per head, which one position list cannot hold.
fn drop_spec(policy: &str) -> Result<PolicySpec> {
    let name = match policy {
        "paged-eviction" => "paged-eviction:ratio:global",
        other => other,
    };
    name.parse().map_err(|e| anyhow::anyhow!("{e}"))
}

/// Runs `tokens` through the model into a fresh f16 store and returns their KV as the
/// engine would have cached it (same kernels, same f16 rounding).
fn prefix_kv(engine: &Engine, tokens: &[u32]) -> Result<KvContext> {
    let c = engine.model_config();
    let bs = 16;
    let g = KvGeometry {
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        block_size_tokens: bs,
        num_blocks: tokens.len().div_ceil(bs),
    };
    let mut store = KvStore::new(g, KvDtype::F16);
    let table: Vec<u32> = (0..g.num_blocks as u32).collect();
    let model = engine
        .cpu_model()
        .context("bench codecs runs the CPU model")?;
    model.forward(
        &mut store,
        &[SeqForward {
            tokens,
            start_position: 0,
            stored_start: 0,
            block_table: &table,
            logits_from: tokens.len(),
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        }],
    );
    let (n, hd) = (tokens.len(), g.head_dim);
    let mut k = vec![0f32; g.n_layers * g.n_kv_heads * n * hd];
    let mut v = k.clone();
    let mut buf = vec![0f32; bs * hd];
    for layer in 0..g.n_layers {
        for h in 0..g.n_kv_heads {
            for (b, &block) in table.iter().enumerate() {
                let m = bs.min(n - b * bs);
                let at = ((layer * g.n_kv_heads + h) * n + b * bs) * hd;
                store.read_k(layer, block, h, &mut buf[..m * hd]);
                k[at..at + m * hd].copy_from_slice(&buf[..m * hd]);
                store.read_v(layer, block, h, &mut buf[..m * hd]);
                v[at..at + m * hd].copy_from_slice(&buf[..m * hd]);
            }
        }
    }
    KvContext::new(
        g.n_layers,
        g.n_kv_heads,
        g.head_dim,
        (0..n as u32).collect(),
        k,
        v,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))
}

/// Per-token scores for the codec: 1 for the tokens `policy` keeps at the budget the codec
/// will keep, 0 for the others.
fn policy_scores(ctx: &KvContext, policy: PolicySpec, spec: &DropSpec) -> Vec<f32> {
    let n = ctx.n_tokens();
    let keep = pk_codec::drop::n_kept_tokens(n, spec);
    let hd = ctx.head_dim;
    let view = DenseKv::from_fn(
        ctx.n_layers,
        ctx.n_kv_heads,
        hd,
        n,
        |layer, h, t, key, value| {
            let at = ((layer * ctx.n_kv_heads + h) * n + t) * hd;
            key.copy_from_slice(&ctx.k[at..at + hd]);
            value.copy_from_slice(&ctx.v[at..at + hd]);
        },
    );
    let mut scores = vec![0f32; n];
    // Policies need at least 3 blocks; below that the codec's protected ends decide.
    if keep >= 3 * 16 && keep < n {
        for t in policy.build().select_prefill(&view, None, keep as u32, 16) {
            scores[t as usize] = 1.0;
        }
    } else {
        scores.iter_mut().for_each(|s| *s = 1.0);
    }
    scores
}

/// KVzip's score of each of `context`'s tokens, one for all layers and KV heads (their
/// mean, sinks 1), from the engine's own reconstruction passes: a `kvzip` run at `shared`
/// granularity records the scores its selection ranked by. The codec then keeps its
/// protected ends and the highest-scored middle, as for every other score.
fn kvzip_scores(engine: &mut Engine, context: &[u32]) -> Result<Vec<f32>> {
    let params = GenerateParams {
        // The passes run once the prompt is in and a second token is due.
        max_tokens: 2,
        ignore_eos: true,
        kv_policy: Some(KVZIP.parse().map_err(|e| anyhow::anyhow!("{e}"))?),
        // Any budget below the context makes the passes run; the kept set is not used.
        kv_budget: Some(48),
        kv_granularity: Some(pk_kv::KvGranularity::Shared),
        record_prefill_keeps: true,
        ..Default::default()
    };
    let out = engine.generate(context, &params, &mut |_| {})?;
    let keeps = out.prefill_keeps.context("kvzip recorded no selection")?;
    let scores = keeps
        .into_iter()
        .next()
        .map(|k| k.prior_scores)
        .unwrap_or_default();
    if scores.len() != context.len() {
        bail!(
            "kvzip scored {} of {} context tokens",
            scores.len(),
            context.len()
        );
    }
    Ok(scores)
}

#[derive(Default, Clone, serde::Serialize)]
struct Row {
    method: String,
    bytes_per_token: f64,
    /// Encoded bytes over the f16 encoding of the same prefix.
    bytes_ratio_vs_f16: f64,
    kept_tokens: f64,
    kl_mean: f64,
    top1_agreement: f64,
    ppl_full: f64,
    ppl_method: f64,
}

/// `--ratios`: at least one, each in [0, 1], none twice (each names its own rows).
fn check_ratios(ratios: &[f32]) -> Result<()> {
    if ratios.is_empty() {
        bail!("--ratios needs at least one ratio");
    }
    if let Some(r) = ratios.iter().find(|r| !(0.0..=1.0).contains(*r)) {
        bail!("--ratios: {r} is outside [0, 1]");
    }
    for (i, r) in ratios.iter().enumerate() {
        if ratios[..i].contains(r) {
            bail!("--ratios: {r} is given twice");
        }
    }
    Ok(())
}

pub fn run(a: CodecsArgs) -> Result<()> {
    if a.prefix_tokens < 64 || a.continuation_tokens == 0 || a.samples == 0 {
        bail!("need --prefix-tokens ≥ 64, --continuation-tokens ≥ 1 and --samples ≥ 1");
    }
    check_ratios(&a.ratios)?;
    let t_start = Instant::now();
    let total = a.prefix_tokens + a.continuation_tokens;
    // Stored contexts are loaded through `prefix_kv`, which writes every layer of every
    // token: one block table for all layers.
    // Room for KVzip's reconstruction pass beside the prefix (one chunk and its prompts).
    let kvzip: PolicySpec = KVZIP.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
    let pass_tokens = kvzip.pass_peak_tokens(total, a.model.block_size as usize);
    let mut engine = a.model.engine_one_table(Some(total + 64 + pass_tokens))?;
    let book = engine
        .tokenizer
        .encode(pk_eval::filler::verne_body(), false);
    if book.len() < total * a.samples {
        bail!(
            "the book has {} tokens, fewer than {} samples of {total}",
            book.len(),
            a.samples
        );
    }
    let configs = configs(&a.ratios)?;
    let mut sums: Vec<Row> = configs
        .iter()
        .map(|c| Row {
            method: c.name.clone(),
            ..Default::default()
        })
        .collect();
    for s in 0..a.samples {
        let start = s * (book.len() - total) / a.samples.max(2).saturating_sub(1).max(1);
        let start = start.min(book.len() - total);
        let prompt = &book[start..start + a.prefix_tokens];
        let cont = &book[start + a.prefix_tokens..start + total];
        add_sample(&mut engine, &configs, &mut sums, prompt, cont)?;
        eprintln!(
            "bench codecs: sample {}/{} done ({:.0} s)",
            s + 1,
            a.samples,
            t_start.elapsed().as_secs_f64()
        );
    }
    let rows = means(sums, a.samples);
    if a.json {
        let out = serde_json::json!({
            "model": engine.model_name,
            "prefix_tokens": a.prefix_tokens,
            "continuation_tokens": a.continuation_tokens,
            "samples": a.samples,
            "rows": rows,
        });
        println!("{out}");
        return Ok(());
    }
    print_table(
        &a,
        &engine.model_name,
        t_start.elapsed().as_secs_f64(),
        &rows,
    );
    Ok(())
}

/// Adds one sample's figures for every configuration to `sums`: the prefix `prompt`
/// compressed by each, then `cont` teacher-forced after it and compared with the
/// uncompressed run.
fn add_sample(
    engine: &mut Engine,
    configs: &[Config],
    sums: &mut [Row],
    prompt: &[u32],
    cont: &[u32],
) -> Result<()> {
    let fingerprint = [0u8; 32];
    // The prefix KV covers all prompt tokens but the last, which the engine recomputes
    // to produce the first continuation logits.
    let full_ctx = prefix_kv(engine, &prompt[..prompt.len() - 1])?;
    let params = GenerateParams::default();
    let reference = engine.teacher_force(prompt, cont, &params)?;
    let f16_bytes = encode(&full_ctx, &Method::None, None, &fingerprint)?.len();
    let kvzip = kvzip_scores(engine, &prompt[..prompt.len() - 1])?;
    for (c, sum) in configs.iter().zip(sums.iter_mut()) {
        let scores = match (c.policy, c.method.drop_spec()) {
            (Some(p), Some(_)) if p.reconstruction_chunk_tokens().is_some() => Some(kvzip.clone()),
            (Some(p), Some(spec)) => Some(policy_scores(&full_ctx, p, &spec)),
            _ => None,
        };
        let bytes = encode(&full_ctx, &c.method, scores.as_deref(), &fingerprint)?;
        let kv = decode(&bytes, &fingerprint).context("decoding what was just encoded")?;
        let kept = kv.n_tokens();
        let p = GenerateParams {
            prefix_kv: Some(Arc::new(PrefixKv { kv })),
            ..params.clone()
        };
        let got = engine.teacher_force(prompt, cont, &p)?;
        let d = pk_eval::metrics::divergence(&reference, &got, cont, 0);
        sum.bytes_per_token += bytes.len() as f64 / full_ctx.n_tokens() as f64;
        sum.bytes_ratio_vs_f16 += bytes.len() as f64 / f16_bytes as f64;
        sum.kept_tokens += kept as f64;
        sum.kl_mean += d.kl_mean;
        sum.top1_agreement += d.top1_agreement;
        sum.ppl_full += d.ppl_full;
        sum.ppl_method += d.ppl_policy;
    }
    Ok(())
}

/// Each row's sums over `samples` samples, as means.
fn means(sums: Vec<Row>, samples: usize) -> Vec<Row> {
    let n = samples as f64;
    sums.into_iter()
        .map(|r| Row {
            bytes_per_token: r.bytes_per_token / n,
            bytes_ratio_vs_f16: r.bytes_ratio_vs_f16 / n,
            kept_tokens: r.kept_tokens / n,
            kl_mean: r.kl_mean / n,
            top1_agreement: r.top1_agreement / n,
            ppl_full: r.ppl_full / n,
            ppl_method: r.ppl_method / n,
            method: r.method,
        })
        .collect()
}

/// The rows as a Markdown table under a line saying what was measured.
fn print_table(a: &CodecsArgs, model_name: &str, wall_s: f64, rows: &[Row]) {
    println!(
        "model {}; prefix {} tokens, {} teacher-forced continuation tokens, {} samples of the Verne text; {:.0} s",
        model_name,
        a.prefix_tokens,
        a.continuation_tokens,
        a.samples,
        wall_s
    );
    println!("| method | bytes/token | vs f16 | kept tokens | KL vs full (nats) | top-1 agreement | ppl full → method |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {:.0} | {:.3} | {:.0} | {:.4} | {:.3} | {:.2} → {:.2} |",
            r.method,
            r.bytes_per_token,
            r.bytes_ratio_vs_f16,
            r.kept_tokens,
            r.kl_mean,
            r.top1_agreement,
            r.ppl_full,
            r.ppl_method
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows are named by the ratio as given (0.25 and 0.21 apart, not both "0.2").
    #[test]
    fn rows_name_the_ratio_as_given() {
        let names: Vec<String> = configs(&[0.25, 0.21])
            .unwrap()
            .into_iter()
            .map(|c| c.name)
            .collect();
        assert!(names.iter().any(|n| n == "drop 0.25 knorm"), "{names:?}");
        assert!(names.iter().any(|n| n == "drop 0.21 knorm"), "{names:?}");
        assert!(
            names.iter().any(|n| n == "drop 0.21 paged-eviction + q8"),
            "{names:?}"
        );
        // The default ratios keep their names ("drop 0.2 …", not "drop 0.20000001 …").
        assert!(configs(&[0.2])
            .unwrap()
            .iter()
            .any(|c| c.name == "drop 0.2 paged-eviction + q8"));
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
    }

    /// Duplicate, out-of-range or no ratios are refused naming `--ratios`.
    #[test]
    fn refuses_bad_ratios_naming_the_flag() {
        for bad in [&[0.25, 0.25][..], &[0.3, 0.5, 0.3], &[1.5], &[]] {
            let e = check_ratios(bad).unwrap_err().to_string();
            assert!(e.contains("--ratios"), "{bad:?}: {e}");
        }
        check_ratios(&[0.2, 0.25, 0.21]).unwrap();
    }
}
