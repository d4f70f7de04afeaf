//! Structured output with grammars compiled by the caller: the engine thread compiles only
//! what arrives uncompiled, so a server that compiles every grammar before submitting never
//! stalls the running streams with a compilation.

mod common;

use std::sync::Arc;

use pk_engine::{EngineConfig, GenerateParams, Grammar, GrammarCompiler, GrammarSpec};

fn choice() -> Grammar {
    Grammar::new(
        GrammarSpec::Choice(vec!["yes".into(), "no".into()]),
        "guided_choice",
    )
}

fn params(grammar: Grammar) -> GenerateParams {
    GenerateParams {
        max_tokens: 8,
        grammar: Some(grammar),
        ..Default::default()
    }
}

/// A grammar compiled on another thread (as the server compiles on its blocking pool) is
/// used as given, and `submit` compiles nothing; the same grammar as a spec alone is
/// compiled by `submit` and counted. Both constrain the output identically.
#[test]
fn a_compiled_grammar_is_not_compiled_on_the_engine_thread() {
    let mut engine = common::engine(EngineConfig::default());
    let tokenizer = Arc::new(engine.tokenizer.clone());
    let spec = choice();
    let compiled = std::thread::spawn(move || {
        let compiler = GrammarCompiler::new(tokenizer).expect("compiler builds");
        let mut g = spec.clone();
        g.compiled = Some(compiler.compile(&spec).expect("grammar compiles"));
        g
    })
    .join()
    .expect("the compiling thread finishes");
    let prompt = engine
        .tokenizer
        .encode("Question: is the sky blue? Answer (yes or no):", false);
    let given = engine
        .generate(&prompt, &params(compiled), &mut |_| {})
        .expect("generates");
    assert!(
        matches!(given.text.as_str(), "yes" | "no"),
        "{:?}",
        given.text
    );
    assert_eq!(engine.stats.grammar_compilations, 0);
    let on_engine = engine
        .generate(&prompt, &params(choice()), &mut |_| {})
        .expect("generates");
    assert_eq!(on_engine.text, given.text);
    assert_eq!(engine.stats.grammar_compilations, 1);
}

/// A caller's compilation error names the request field, as the engine's own does.
#[test]
fn a_compilation_error_names_the_field() {
    let engine = common::engine(EngineConfig::default());
    let compiler = GrammarCompiler::new(Arc::new(engine.tokenizer.clone())).expect("builds");
    let bad = Grammar::new(GrammarSpec::Regex("(unclosed".into()), "guided_regex");
    let e = compiler
        .compile(&bad)
        .expect_err("an unclosed group is refused");
    assert!(
        e.to_string().starts_with("guided_regex cannot be compiled"),
        "{e}"
    );
}
