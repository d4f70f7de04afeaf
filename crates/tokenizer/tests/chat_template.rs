//! SmolLM2's chat template, rendered from the GGUF, must reproduce the golden prompts.

mod common;

use pk_tokenizer::{ChatMessage, ChatTemplate};

fn golden_prompt(name: &str) -> String {
    common::golden_prompts()
        .into_iter()
        .find(|(n, _, _)| n == name)
        .unwrap_or_else(|| panic!("fixture has no prompt {name}"))
        .1
}

#[test]
fn default_system_prompt_is_inserted() {
    let template = ChatTemplate::from_gguf(common::gguf()).expect("template compiles");
    let messages = [ChatMessage::new("user", "What is the capital of France?")];
    let rendered = template.render(&messages, true).expect("template renders");
    assert_eq!(rendered, golden_prompt("chat_capital"));
}

#[test]
fn explicit_system_prompt_replaces_the_default() {
    let template = ChatTemplate::from_gguf(common::gguf()).expect("template compiles");
    let messages = [
        ChatMessage::new("system", "Answer in French."),
        ChatMessage::new("user", "Hi"),
    ];
    let rendered = template.render(&messages, true).expect("template renders");
    assert_eq!(
        rendered,
        "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let rendered = template.render(&messages, false).expect("template renders");
    assert!(rendered.ends_with("Hi<|im_end|>\n"), "{rendered:?}");
}

#[test]
fn rendered_prompt_tokenizes_to_golden_ids() {
    let template = ChatTemplate::from_gguf(common::gguf()).expect("template compiles");
    let messages = [ChatMessage::new("user", "What is the capital of France?")];
    let rendered = template.render(&messages, true).expect("template renders");
    let want = common::golden_prompts()
        .into_iter()
        .find(|(n, _, _)| n == "chat_capital")
        .unwrap()
        .2;
    let tok = common::tokenizer();
    common::assert_same_ids("chat_capital", tok, &tok.encode(&rendered, true), &want);
}
