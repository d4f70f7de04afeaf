//! Structured output: a grammar (JSON schema, regex, a choice of strings, Lark) turned into
//! a mask of the tokens that may come next, by llguidance, the engine vLLM and llama.cpp
//! use. The mask is applied to the logits before sampling, so whatever the model prefers,
//! the output matches the grammar; once the grammar is complete only end-of-generation
//! may follow.
//!
//! The token trie is built once per `GrammarCompiler` from the tokenizer's byte strings
//! (special tokens carry toktrie's 0xFF marker, so no grammar text can produce them); each
//! request gets its own `Matcher`, advanced by every token the sequence generates.
//!
//! Building the trie (0.2–0.3 s for a 49K vocabulary) and compiling a schema hold a core, so
//! callers that serve other requests meanwhile compile before submitting
//! ([`GrammarCompiler::compile`], on a thread of their own) and hand the engine a
//! [`CompiledGrammar`]; the engine compiles only a grammar that arrives without one.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use pk_tokenizer::Tokenizer;

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value matching this schema (`json_schema`, vLLM's `guided_json`).
    JsonSchema(serde_json::Value),
    /// Text matching this regex (vLLM's `guided_regex`).
    Regex(String),
    /// Exactly one of these strings (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// A Lark grammar (vLLM's `guided_grammar`).
    Lark(String),
}

/// A grammar and the request field it came from (errors name it).
#[derive(Debug, Clone)]
pub struct Grammar {
    pub spec: GrammarSpec,
    pub param: &'static str,
    /// `spec` compiled by the caller ([`GrammarCompiler::compile`]). Without it the engine
    /// compiles `spec` at submission, on its own thread, and every running sequence waits
    /// for that long.
    pub compiled: Option<CompiledGrammar>,
}

impl Grammar {
    /// A grammar not compiled yet.
    pub fn new(spec: GrammarSpec, param: &'static str) -> Grammar {
        Grammar {
            spec,
            param,
            compiled: None,
        }
    }
}

/// A grammar's matcher, compiled and ready to constrain one sequence, and the vocabulary
/// it was compiled for (the engine refuses one made for another tokenizer, whose token ids
/// would mean other text).
pub struct CompiledGrammar {
    matcher: Matcher,
    vocab_size: usize,
}

impl CompiledGrammar {
    /// The vocabulary size of the tokenizer the matcher was compiled for.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The matcher, for the sequence it will constrain.
    pub fn into_matcher(self) -> Matcher {
        self.matcher
    }
}

/// A clone is an independent matcher: `Matcher::clone` would share its parser's state.
impl Clone for CompiledGrammar {
    fn clone(&self) -> CompiledGrammar {
        CompiledGrammar {
            matcher: self.matcher.deep_clone(),
            vocab_size: self.vocab_size,
        }
    }
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl GrammarSpec {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Choice(choices) => {
                // A regex alternation of the escaped strings.
                let alts: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alts.join("|")))
            }
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// JSON in Python's `json.dumps` layout (", " and ": ", no other whitespace) unless the
/// schema sets llguidance's own options: with flexible whitespace a small model can emit
/// newlines until `max_tokens` runs out (measured: SmolLM2 on `json_object`).
pub fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

fn regex_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~ \t\n".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The tokenizer as llguidance sees it.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer.encode(&String::from_utf8_lossy(s), false)
    }
}

/// Builds matchers for one tokenizer (the expensive part, the trie and the lexer slices,
/// is done once). It is `Send + Sync`: one compiler, behind an `Arc`, serves every thread
/// that compiles.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
}

impl GrammarCompiler {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<GrammarCompiler> {
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                if tokenizer.is_control(id) || tokenizer.is_eog(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).unwrap_or("").as_bytes());
                    w
                } else {
                    tokenizer.token_bytes(id).to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n as u32, tokenizer.eos_id());
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            vocab_size: n,
        })
    }

    /// A fresh matcher for `spec`, or an error saying what is wrong with it.
    pub fn matcher(&self, spec: &GrammarSpec) -> Result<Matcher> {
        let parser = self.factory.create_parser(spec.top_level())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(anyhow!(e));
        }
        Ok(matcher)
    }

    /// `grammar`'s spec compiled, ready for the engine to use as it is; an error says what
    /// is wrong with the spec, in the words the engine would use.
    pub fn compile(&self, grammar: &Grammar) -> Result<CompiledGrammar> {
        let matcher = self
            .matcher(&grammar.spec)
            .map_err(|e| anyhow!("{} cannot be compiled: {e}", grammar.param))?;
        Ok(CompiledGrammar {
            matcher,
            vocab_size: self.vocab_size,
        })
    }
}

/// Sets the logits of every token `matcher` does not allow next to -inf. Returns an error
/// when the grammar can no longer continue (the sequence must stop).
pub fn mask_logits(matcher: &mut Matcher, logits: &mut [f32]) -> Result<()> {
    let mask = matcher.compute_mask_or_eos()?;
    for (id, l) in logits.iter_mut().enumerate() {
        if !mask.is_allowed(id as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
    Ok(())
}
