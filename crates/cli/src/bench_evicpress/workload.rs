//! The EVICPRESS benchmark's workload (issue 9): contexts of different sensitivity to
//! compression, templated questions per context (a profiling set and a disjoint test set),
//! and a request trace with Zipf popularity, Poisson arrivals and optional drift.
//!
//! Kinds of context:
//! - `dense`: a list of facts ("The code for Vaselo is 48213."), every token matters;
//! - `narrative`: the Verne text with a few facts planted in it, mostly redundant prose;
//! - `mixed`: prose and a fact list, half and half.
//!
//! Questions ask for a fact's code; every context's length is a multiple of the chunk size
//! so that the whole context is one stored entry.

use pk_eval::filler::verne_sentences;
use pk_eval::rng::SplitMix64;
use pk_tokenizer::Tokenizer;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Dense,
    Narrative,
    Mixed,
}

pub struct Context {
    pub kind: Kind,
    pub tokens: Vec<u32>,
    pub profile_queries: Vec<Vec<u32>>,
    pub test_queries: Vec<Vec<u32>>,
    /// The code each test question asks for: the task's ground truth.
    pub test_answers: Vec<String>,
}

/// The task's score of one answer: 1 when the first number in it is the asked code.
pub fn task_score(answer: &str, gold: &str) -> f64 {
    let digits: String = answer
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    f64::from(u8::from(digits == gold))
}

pub struct WorkloadSpec {
    pub n_contexts: usize,
    pub min_tokens: usize,
    pub max_tokens: usize,
    pub chunk_tokens: usize,
    pub profile_queries: usize,
    pub test_queries: usize,
    pub seed: u64,
}

fn name(rng: &mut SplitMix64) -> String {
    const SYL: [&str; 16] = [
        "va", "lo", "mi", "ter", "sa", "no", "ri", "ku", "del", "pa", "zo", "ne", "tor", "bi",
        "fa", "ul",
    ];
    let mut s = String::new();
    for _ in 0..3 {
        s.push_str(SYL[rng.below(SYL.len())]);
    }
    let mut c = s.chars();
    c.next()
        .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
        .unwrap_or_default()
}

fn question(name: &str) -> String {
    format!("\n\nQuestion: What is the code for {name}?\nAnswer: The code for {name} is")
}

/// Builds the contexts. Deterministic for a seed.
pub fn contexts(tok: &Tokenizer, spec: &WorkloadSpec) -> Vec<Context> {
    let sentences = verne_sentences();
    let mut out = Vec::new();
    for i in 0..spec.n_contexts {
        let mut rng = SplitMix64::for_parts(&[spec.seed, i as u64]);
        let kind = [Kind::Dense, Kind::Narrative, Kind::Mixed][i % 3];
        let span = (spec.max_tokens - spec.min_tokens) / spec.chunk_tokens;
        let n_tokens = spec.min_tokens + spec.chunk_tokens * rng.below(span + 1);
        // Facts: enough names for both query sets, planted through the text.
        let n_facts = match kind {
            Kind::Dense => n_tokens / 12,
            Kind::Narrative => spec.profile_queries + spec.test_queries + 2,
            Kind::Mixed => n_tokens / 24,
        }
        .max(spec.profile_queries + spec.test_queries);
        let facts: Vec<(String, String)> = (0..n_facts)
            .map(|_| (name(&mut rng), rng.digits(5)))
            .collect();
        let fact = |f: &(String, String)| format!("The code for {} is {}. ", f.0, f.1);
        let mut text = String::new();
        let mut start = rng.below(sentences.len().saturating_sub(2000).max(1));
        match kind {
            Kind::Dense => facts.iter().for_each(|f| text.push_str(&fact(f))),
            Kind::Narrative | Kind::Mixed => {
                // Spread the facts over the first 80 % of the context (a Verne sentence is
                // about 30 tokens), so that every planted fact survives the cut.
                let prose_per_fact = if kind == Kind::Narrative {
                    (n_tokens * 4 / 5 / (n_facts * 30)).max(1)
                } else {
                    2
                };
                for f in &facts {
                    for _ in 0..prose_per_fact {
                        text.push_str(&sentences[start % sentences.len()]);
                        text.push(' ');
                        start += 1;
                    }
                    text.push_str(&fact(f));
                }
            }
        }
        // Pad with prose, then cut to the exact length.
        let mut tokens = tok.encode(&text, false);
        while tokens.len() < n_tokens {
            let more = sentences[start % sentences.len()].clone() + " ";
            start += 1;
            tokens.extend(tok.encode(&more, false));
        }
        tokens.truncate(n_tokens);
        // Only facts that survived the cut are asked about: their names appear in the text.
        let kept_text = tok.decode(&tokens);
        let askable: Vec<&(String, String)> = facts
            .iter()
            .filter(|f| kept_text.contains(&format!("The code for {} is {}", f.0, f.1)))
            .collect();
        let mut order: Vec<usize> = (0..askable.len()).collect();
        for j in (1..order.len()).rev() {
            order.swap(j, rng.below(j + 1));
        }
        if askable.len() < spec.profile_queries + spec.test_queries {
            tracing::warn!(
                "context {i}: only {} facts survived the cut; profiling and test questions overlap",
                askable.len()
            );
        }
        let fact_of = |j: usize| askable[order[j % order.len().max(1)]];
        let q = |j: usize| tok.encode(&question(&fact_of(j).0), false);
        let n_p = spec.profile_queries;
        out.push(Context {
            kind,
            tokens,
            profile_queries: (0..n_p).map(q).collect(),
            test_queries: (n_p..n_p + spec.test_queries).map(q).collect(),
            test_answers: (n_p..n_p + spec.test_queries)
                .map(|j| fact_of(j).1.clone())
                .collect(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn task_score_reads_the_first_number() {
        assert_eq!(super::task_score(" 48213. The code", "48213"), 1.0);
        assert_eq!(super::task_score(" 4821", "48213"), 0.0);
        assert_eq!(super::task_score(" 482135", "48213"), 0.0);
        assert_eq!(super::task_score(" unknown, 48213", "48213"), 1.0);
        assert_eq!(super::task_score(" none", "48213"), 0.0);
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub context: usize,
    pub query: usize,
    pub arrival_s: f64,
}

/// `n` requests over `n_contexts` contexts: Zipf(s) popularity over a seeded random ranking,
/// Poisson arrivals at `rate_per_s`, and with `drift` a new ranking for the second half.
pub fn trace(
    n_contexts: usize,
    n_tests: usize,
    n: usize,
    zipf_s: f64,
    rate_per_s: f64,
    drift: bool,
    seed: u64,
) -> Vec<Request> {
    let mut rng = SplitMix64::for_parts(&[seed, 0x7ace]);
    let ranking = |rng: &mut SplitMix64| {
        let mut r: Vec<usize> = (0..n_contexts).collect();
        for j in (1..r.len()).rev() {
            r.swap(j, rng.below(j + 1));
        }
        r
    };
    let weights: Vec<f64> = (1..=n_contexts)
        .map(|k| 1.0 / (k as f64).powf(zipf_s))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut rank = ranking(&mut rng);
    let mut t = 0.0;
    let uniform = |rng: &mut SplitMix64| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    (0..n)
        .map(|i| {
            if drift && i == n / 2 {
                rank = ranking(&mut rng);
            }
            let mut u = uniform(&mut rng) * total;
            let mut k = 0;
            while k + 1 < n_contexts && u >= weights[k] {
                u -= weights[k];
                k += 1;
            }
            t += -(1.0 - uniform(&mut rng)).ln() / rate_per_s;
            Request {
                context: rank[k],
                query: rng.below(n_tests.max(1)),
                arrival_s: t,
            }
        })
        .collect()
}
