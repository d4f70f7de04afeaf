//! Qwen2.5-Coder's tokenizer (byte-level BPE, pre-tokenizer `qwen2`, 151,936 tokens)
//! against llama.cpp's token ids for the same GGUFs (tests/fixtures/qwen-reference.md): the
//! whole Verne text and a code corpus (this repository's `crates/kv` sources), both models,
//! plus the chat template with tools and tool messages as Qwen2.5's template renders them.

mod common;

use std::path::PathBuf;

use pk_gguf::GgufFile;
use pk_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures");

fn model(file: &str) -> GgufFile {
    let home = match std::env::var_os("PAGEKEEPER_HOME") {
        Some(dir) => PathBuf::from(dir),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/pagekeeper")
        }
    };
    let path = home.join(file);
    assert!(
        path.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all` first",
        path.display()
    );
    GgufFile::open(&path).unwrap()
}

const MODELS: &[(&str, &str)] = &[
    ("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct.gguf"),
    (
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    ),
];

fn reference_ids(short: &str, what: &str) -> Vec<u32> {
    let v = common::json(&format!("{FIXTURES}/{short}-{what}-token-ids.json"));
    v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check_corpus(what: &str, text_file: &str) {
    let text = common::read(&format!("{FIXTURES}/{text_file}"));
    for (short, file) in MODELS {
        let tok = Tokenizer::from_gguf(&model(file)).unwrap();
        let want = reference_ids(short, what);
        let got = tok.encode(&text, false);
        common::assert_same_ids(&format!("{short} {what}"), &tok, &got, &want);
        assert_eq!(
            tok.decode(&got),
            text,
            "{short}: decode(encode(text)) == text"
        );
    }
}

#[test]
fn verne_ids_match_llama_cpp_both_models() {
    check_corpus("verne", "around-the-world-in-80-days.txt");
}

#[test]
fn code_ids_match_llama_cpp_both_models() {
    check_corpus("code", "code-corpus.txt");
}

#[test]
fn qwen_metadata_and_end_of_generation() {
    let tok = Tokenizer::from_gguf(&model(MODELS[0].1)).unwrap();
    assert_eq!(tok.vocab_size(), 151_936);
    assert!(!tok.add_bos(), "Qwen2.5 prompts start without BOS");
    let im_end = tok.token_id("<|im_end|>").unwrap();
    let eot = tok.token_id("<|endoftext|>").unwrap();
    assert_eq!((im_end, eot), (151_645, 151_643));
    assert!(tok.is_eog(im_end) && tok.is_eog(eot));
    assert_eq!(tok.encode("<|im_start|>user", true)[0], 151_644);
    // Code-completion (FIM) markers are single tokens.
    for t in ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"] {
        assert_eq!(tok.encode(t, true).len(), 1, "{t}");
    }
}

/// The template's own rendering of a conversation with tools, an assistant tool call and a
/// tool answer, written out from Qwen2.5's template text by hand.
#[test]
fn chat_template_renders_tools_and_tool_messages() {
    let f = model(MODELS[1].1);
    let t = ChatTemplate::from_gguf(&f).unwrap();
    let plain = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
    assert_eq!(plain, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    let tool: serde_json::Value = serde_json::from_str(r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#).unwrap();
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = Some(
        serde_json::json!([{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]),
    );
    let mut answer = ChatMessage::new("tool", "18 C, sunny");
    answer.tool_call_id = Some("call_1".into());
    let msgs = [ChatMessage::new("user", "Weather in Paris?"), call, answer];
    let out = t.render_with_tools(&msgs, Some(&[tool]), true).unwrap();
    let want = concat!(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n",
        "You may call one or more functions to assist with the user query.\n\n",
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
        r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#,
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n",
        // This GGUF's template writes the braces doubled inside a string literal, where
        // Jinja keeps them as they are (Python Jinja2 3.1, HF's settings and json.dumps as
        // tojson, renders this whole expected string byte for byte).
        "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n",
    );
    assert_eq!(out, want);
}
