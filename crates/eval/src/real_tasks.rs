//! Long-input tasks on real material nobody on this project wrote, in LongBench's style
//! (issue 38), beside the generated RULER-style tasks:
//!
//! - `code-completion` (LongBench's LCC): the code before a line of a real Rust source
//!   file as the context, the model's first line scored by edit similarity against the
//!   true line. The files are those of the crates this workspace depends on, as pinned in
//!   `Cargo.lock` and unpacked by cargo under `$CARGO_HOME/registry/src`, so every machine
//!   that builds the project has the same ones; only crates licensed MIT or Apache-2.0
//!   are used, read in place and never copied into the repository or the results.
//! - `passage-count` (LongBench's passage_count): paragraphs of the book, some repeated,
//!   in random order; the answer is how many distinct ones there are.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::rng::SplitMix64;
use crate::tasks::{Sample, Scoring, TEMPLATE_TOKENS_RESERVE};

/// The prompt is the code itself after one comment line naming the file, continued raw
/// (no chat template, no instruction), as a code model is used for completion. LongBench's
/// LCC wording ("Please complete the code given below. … Next line of code:") was measured
/// first: the Instruct 1.5B model answered it with a fence and `obj['next_line_of_code']`
/// or prose about as often as with code, and the full cache scored 0.53 edit similarity on
/// 8 samples at 2K; raw continuation scored 0.78 on 8 samples (docs/results/eval-issue38).
/// The path line is the only text that is not the file's.
const CODE_PROMPT_HEAD: &str = "// ";
/// A target line must carry at least this many non-blank characters: a lone `}` or `)`
/// would reward guessing punctuation.
const MIN_TARGET_LINE_CHARS: usize = 12;

/// The source files the code-completion task samples from: `(path, text)` of every `.rs`
/// file under `src/` of each MIT- or Apache-2.0-licensed crate in `Cargo.lock`, sorted by
/// path so that a seed picks the same file everywhere.
pub fn code_corpus() -> &'static Result<Vec<(PathBuf, String)>, String> {
    static CORPUS: OnceLock<Result<Vec<(PathBuf, String)>, String>> = OnceLock::new();
    CORPUS.get_or_init(load_code_corpus)
}

fn load_code_corpus() -> Result<Vec<(PathBuf, String)>, String> {
    let lock_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    let lock =
        std::fs::read_to_string(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .ok_or("neither CARGO_HOME nor HOME is set")?;
    let registry = cargo_home.join("registry/src");
    let indexes: Vec<PathBuf> = std::fs::read_dir(&registry)
        .map_err(|e| {
            format!(
                "{}: {e} (cargo unpacks dependencies there)",
                registry.display()
            )
        })?
        .filter_map(|d| d.ok().map(|d| d.path()))
        .collect();
    let mut files = Vec::new();
    for (name, version) in registry_packages(&lock) {
        let Some(dir) = indexes
            .iter()
            .map(|i| i.join(format!("{name}-{version}")))
            .find(|d| d.is_dir())
        else {
            continue;
        };
        if !permissive_licence(&dir) {
            continue;
        }
        collect_rs_files(&dir.join("src"), &mut files);
    }
    files.sort();
    let corpus: Vec<(PathBuf, String)> = files
        .into_iter()
        .filter_map(|p| std::fs::read_to_string(&p).ok().map(|t| (p, t)))
        .collect();
    match corpus.is_empty() {
        true => Err(format!(
            "no MIT/Apache-2.0 crate sources of Cargo.lock under {}",
            registry.display()
        )),
        false => Ok(corpus),
    }
}

/// `(name, version)` of every crates.io package in a `Cargo.lock`.
fn registry_packages(lock: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for block in lock.split("[[package]]").skip(1) {
        let field = |key: &str| {
            block.lines().find_map(|l| {
                let v = l.strip_prefix(key)?.trim_start().strip_prefix('=')?;
                Some(v.trim().trim_matches('"').to_string())
            })
        };
        let from_registry = field("source").is_some_and(|s| s.starts_with("registry+"));
        if let (true, Some(n), Some(v)) = (from_registry, field("name"), field("version")) {
            out.push((n, v));
        }
    }
    out
}

/// Whether the crate's `Cargo.toml` declares MIT or Apache-2.0 (alone or as a choice).
fn permissive_licence(crate_dir: &Path) -> bool {
    let Ok(toml) = std::fs::read_to_string(crate_dir.join("Cargo.toml")) else {
        return false;
    };
    toml.lines()
        .filter_map(|l| l.trim().strip_prefix("license"))
        .filter_map(|l| l.trim_start().strip_prefix('='))
        .any(|v| v.contains("MIT") || v.contains("Apache-2.0"))
}

fn collect_rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Whether a line may be the one to complete: real code, not a comment or a brace.
fn is_target_line(line: &str) -> bool {
    let t = line.trim();
    t.chars().filter(|c| !c.is_whitespace()).count() >= MIN_TARGET_LINE_CHARS
        && !t.starts_with("//")
        && !t.starts_with("/*")
        && !t.starts_with('*')
        && !t.starts_with('#')
}

/// One code-completion sample of about `context_tokens` tokens: a file chosen by the
/// seed among those long enough, a target line in it with at least that much code
/// before it, and the code before it (cut at a line boundary from the front) as context.
pub fn code_completion(
    context_tokens: usize,
    rng: &mut SplitMix64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Result<Sample, String> {
    let corpus = code_corpus().as_ref().map_err(Clone::clone)?;
    let budget = context_tokens.saturating_sub(count_tokens(CODE_PROMPT_HEAD) + 32);
    // Code runs at about 3 characters a token; a file needs that much before its target.
    let min_chars = budget * 3;
    let long: Vec<&(PathBuf, String)> =
        corpus.iter().filter(|(_, t)| t.len() > min_chars).collect();
    if long.is_empty() {
        return Err(format!("no crate source file has {min_chars} characters"));
    }
    for _ in 0..64 {
        let (path, text) = long[rng.below(long.len())];
        let lines: Vec<&str> = text.lines().collect();
        let mut starts = Vec::with_capacity(lines.len());
        let mut at = 0;
        for l in &lines {
            starts.push(at);
            at += l.len() + 1;
        }
        let eligible: Vec<usize> = (0..lines.len())
            .filter(|&i| starts[i] >= min_chars && is_target_line(lines[i]))
            .collect();
        if eligible.is_empty() {
            continue;
        }
        let target = eligible[rng.below(eligible.len())];
        let crate_file = path
            .components()
            .rev()
            .take(4)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<PathBuf>();
        let header = format!("{CODE_PROMPT_HEAD}{}\n", crate_file.display());
        let context = trailing_lines(&lines[..target], budget, count_tokens);
        return Ok(Sample {
            user_message: format!("{header}{context}"),
            answer_prefix: String::new(),
            expected: vec![lines[target].trim().to_string()],
            depth: 1.0,
            max_answer_tokens: 64,
            scoring: Scoring::EditSimilarity,
            chat: false,
            source: Some(crate_file.display().to_string()),
            question: String::new(),
        });
    }
    Err("no file with a completable line found in 64 draws".into())
}

/// The last lines of `lines` whose tokens add up to at most `budget`, joined with a
/// trailing newline.
fn trailing_lines(lines: &[&str], budget: usize, count_tokens: &dyn Fn(&str) -> usize) -> String {
    // Count in blocks of lines: one tokenizer call per line would be slow at 8K tokens.
    let mut kept: Vec<&str> = Vec::new();
    let mut used = 0;
    for chunk in lines.rchunks(16) {
        let text = chunk.join("\n") + "\n";
        let cost = count_tokens(&text);
        if used + cost > budget {
            for l in chunk.iter().rev() {
                let c = count_tokens(&format!("{l}\n"));
                if used + c > budget {
                    break;
                }
                used += c;
                kept.push(l);
            }
            break;
        }
        used += cost;
        kept.extend(chunk.iter().rev());
    }
    kept.reverse();
    kept.join("\n") + "\n"
}

/// The book's paragraphs (blank-line separated in the Gutenberg file), whitespace
/// collapsed, those of at least 200 characters (dialogue lines would be too easy to
/// tell apart by length alone).
pub fn paragraphs() -> &'static [String] {
    static PARAS: OnceLock<Vec<String>> = OnceLock::new();
    PARAS.get_or_init(|| {
        let text = crate::filler::VERNE_TEXT.replace("\r\n", "\n");
        let start = text.find("*** START OF").map_or(0, |i| i);
        let end = text.find("*** END OF").unwrap_or(text.len());
        text[start..end]
            .split("\n\n")
            .skip(1)
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| p.len() >= 200)
            .collect()
    })
}

/// One passage-count sample of about `context_tokens` tokens: paragraphs drawn one at a
/// time, each new with a per-sample probability in [0.25, 0.75] and otherwise a repeat of
/// one already listed, until the budget is used; the answer is the number of distinct ones.
pub fn passage_count(
    context_tokens: usize,
    rng: &mut SplitMix64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Sample {
    let intro = "There are some paragraphs below sourced from a novel. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?";
    let question = "Please enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.";
    let all = paragraphs();
    let budget = context_tokens.saturating_sub(
        count_tokens(intro) + count_tokens(question) + TEMPLATE_TOKENS_RESERVE + 16,
    );
    let p_new = 0.25 + 0.5 * (rng.below(1001) as f64 / 1000.0);
    let (mut listed, mut distinct): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
    let mut used = 0;
    loop {
        let fresh = distinct.is_empty() || rng.below(1000) < (p_new * 1000.0) as usize;
        let p = match fresh {
            true => rng.below(all.len()),
            false => distinct[rng.below(distinct.len())],
        };
        let cost = count_tokens(&all[p]) + 6;
        if used + cost > budget && !listed.is_empty() {
            break;
        }
        used += cost;
        listed.push(p);
        if !distinct.contains(&p) {
            distinct.push(p);
        }
    }
    let body: Vec<String> = listed
        .iter()
        .enumerate()
        .map(|(i, &p)| format!("Paragraph {}: {}", i + 1, all[p]))
        .collect();
    Sample {
        user_message: format!("{intro}\n\n{}\n\n{question}", body.join("\n\n")),
        answer_prefix: "The final answer is: ".into(),
        expected: vec![distinct.len().to_string()],
        depth: 0.5,
        max_answer_tokens: 16,
        scoring: Scoring::Count,
        chat: true,
        source: None,
        question: question.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approx_tokens(s: &str) -> usize {
        s.len().div_ceil(4)
    }

    /// The corpus is this workspace's own dependency sources (cargo unpacked them to build
    /// these tests), and a sample is the code before a real line of one of them.
    #[test]
    fn code_samples_are_real_lines_after_their_own_code() {
        let corpus = code_corpus().as_ref().expect("crate sources of Cargo.lock");
        assert!(corpus.len() > 100, "{} files", corpus.len());
        for seed in 0..4u64 {
            let mut rng = SplitMix64::new(seed);
            let s = code_completion(2048, &mut rng, &approx_tokens).unwrap();
            let source = s.source.as_ref().unwrap();
            let (_, text) = corpus.iter().find(|(p, _)| p.ends_with(source)).unwrap();
            let header = format!("{CODE_PROMPT_HEAD}{source}\n");
            let context = s.user_message.strip_prefix(&header).unwrap();
            let line = &s.expected[0];
            assert!(is_target_line(line), "{line:?}");
            assert!(
                text.contains(&format!("{context}{}", text_line_after(text, context))),
                "the context is a contiguous piece of {source}"
            );
            assert_eq!(text_line_after(text, context).trim(), line);
            let tokens = approx_tokens(&s.user_message);
            assert!((1500..=2048).contains(&tokens), "{tokens} tokens");
            let mut again = SplitMix64::new(seed);
            assert_eq!(
                code_completion(2048, &mut again, &approx_tokens).unwrap(),
                s
            );
        }
    }

    fn text_line_after<'a>(text: &'a str, context: &str) -> &'a str {
        let at = text.find(context).expect("context in file") + context.len();
        text[at..].lines().next().unwrap_or("")
    }

    /// The expected count is the number of distinct paragraphs actually listed, and some
    /// are listed more than once.
    #[test]
    fn passage_count_answer_is_the_number_of_distinct_paragraphs() {
        assert!(paragraphs().len() > 300, "{}", paragraphs().len());
        for seed in 0..4u64 {
            let s = passage_count(4096, &mut SplitMix64::new(seed), &approx_tokens);
            let listed: Vec<&str> = s
                .user_message
                .split("\n\n")
                .filter_map(|p| p.strip_prefix("Paragraph "))
                .map(|p| p.split_once(": ").unwrap().1)
                .collect();
            let mut distinct = listed.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(s.expected, vec![distinct.len().to_string()]);
            assert!(distinct.len() < listed.len(), "no repeats with seed {seed}");
            assert!(approx_tokens(&s.user_message) <= 4096);
        }
    }
}
