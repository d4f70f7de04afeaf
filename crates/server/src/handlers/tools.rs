//! Tool calling on `/v1/chat/completions`: `tools`, `tool_choice` (`none`, `auto`,
//! `required`, a named function) and `parallel_tool_calls`, in the Hermes / Qwen2.5 format
//! the templates use: each call is `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`.
//!
//! `required` and a named function are constrained by a grammar (one call, or several
//! with `parallel_tool_calls`), so they always yield calls whose arguments match the
//! function's parameters; `auto` lets the model choose and parses what it wrote. A
//! template that cannot describe tools (it never reads `tools`) gets them in a system
//! turn of ours when a grammar forces the call, and `auto` is refused for it: the model
//! would not know the tools exist.

use super::*;
use pk_engine::{Grammar, GrammarSpec};

/// The most tools one request may define.
const MAX_TOOLS: usize = 64;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

pub(super) struct Tools {
    /// OpenAI's tool objects, as the template reads them.
    pub defs: Vec<Value>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

impl Tools {
    /// Whether outputs are parsed for calls (every choice but `none`).
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The grammar forcing calls for `required` and named choices.
    pub fn grammar(&self) -> Option<Grammar> {
        let allowed: Vec<&Value> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => self.defs.iter().collect(),
            ToolChoice::Named(name) => self
                .defs
                .iter()
                .filter(|d| fn_name(d) == Some(name.as_str()))
                .collect(),
        };
        let variants: Vec<Value> = allowed
            .iter()
            .map(|d| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": fn_name(d).unwrap_or_default()},
                        "arguments": parameters(d),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = pk_engine::grammar::compact(json!({ "anyOf": variants }));
        // A named function is one call of it, as OpenAI and vLLM answer it; `required` may
        // be several with `parallel_tool_calls`.
        let several = self.parallel && !matches!(self.choice, ToolChoice::Named(_));
        let calls = if several {
            "call (\"\\n\" call)*"
        } else {
            "call"
        };
        let lark = format!(
            "start: {calls}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n"
        );
        Some(Grammar::new(GrammarSpec::Lark(lark), "tool_choice"))
    }

    /// The function a named `tool_choice` forces.
    pub fn forced_name(&self) -> Option<&str> {
        match &self.choice {
            ToolChoice::Named(name) => Some(name),
            _ => None,
        }
    }

    /// A system turn describing the tools, for templates that do not read `tools`.
    pub fn system_text(&self) -> String {
        let defs: Vec<String> = self.defs.iter().map(|d| d.to_string()).collect();
        format!(
            "You can call functions. Their signatures:\n<tools>\n{}\n</tools>\nTo call one, reply with <tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n</tool_call>",
            defs.join("\n")
        )
    }
}

fn fn_name(def: &Value) -> Option<&str> {
    def.pointer("/function/name").and_then(Value::as_str)
}

fn parameters(def: &Value) -> Value {
    def.pointer("/function/parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}))
}

/// The request's tools, checked; `None` when it defines none.
pub(super) fn parse(
    tools: &Option<Vec<Value>>,
    tool_choice: &Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    let defs = tools.clone().unwrap_or_default();
    if defs.is_empty() {
        // OpenAI's own answer: the setting means nothing without tools.
        if parallel.is_some() {
            return Err(ApiError::param(
                "parallel_tool_calls",
                "parallel_tool_calls is only allowed when tools are specified",
            ));
        }
        return match tool_choice {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "none" => Ok(None),
            Some(v) => Err(ApiError::param(
                "tool_choice",
                format!("tool_choice {v} needs tools"),
            )),
        };
    }
    if defs.len() > MAX_TOOLS {
        return Err(ApiError::param(
            "tools",
            format!("at most {MAX_TOOLS} tools"),
        ));
    }
    let mut names = std::collections::HashSet::new();
    for d in &defs {
        let name = fn_name(d).unwrap_or("");
        let valid_name = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if d.get("type").and_then(Value::as_str) != Some("function") || !valid_name {
            return Err(ApiError::param(
                "tools",
                format!("each tool must be {{\"type\": \"function\", \"function\": {{\"name\": [A-Za-z0-9_-]{{1,64}}, …}}}}, got {d}"),
            ));
        }
        if !names.insert(name.to_string()) {
            return Err(ApiError::param(
                "tools",
                format!("tool {name:?} is defined twice"),
            ));
        }
        if !parameters(d).is_object() {
            return Err(ApiError::param(
                "tools",
                format!("the parameters of {name:?} must be a JSON schema object"),
            ));
        }
    }
    let choice = match tool_choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::param(
                    "tool_choice",
                    format!(
                    "tool_choice must be none, auto, required or a named function, got {other:?}"
                ),
                ))
            }
        },
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if names.contains(name) => ToolChoice::Named(name.to_string()),
            _ => {
                return Err(ApiError::param(
                    "tool_choice",
                    format!("tool_choice {v} names no defined function"),
                ))
            }
        },
    };
    Ok(Some(Tools {
        defs,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

/// Checks an assistant message's `tool_calls`: OpenAI's list of
/// `{"type": "function", "function": {"name", "arguments"}}`.
pub(super) fn check_history_calls(calls: &Value) -> Result<(), ApiError> {
    let well_formed = calls.as_array().is_some_and(|list| {
        list.iter().all(|c| {
            c.pointer("/function/name").is_some_and(Value::is_string)
                && c.pointer("/function/arguments")
                    .is_none_or(|a| a.is_string() || a.is_object())
        })
    });
    match well_formed {
        true => Ok(()),
        false => Err(ApiError::param(
            "messages",
            format!("tool_calls must be a list of {{\"type\": \"function\", \"function\": {{\"name\": …, \"arguments\": …}}}}, got {calls}"),
        )),
    }
}

/// Earlier calls of assistant turns written into their text, in the format the tools'
/// system turn teaches (`<tool_call>` blocks), for a template that never reads
/// `tool_calls`: left there, they would vanish from the prompt.
pub(super) fn inline_history_calls(msgs: &mut [ChatMessage]) {
    for m in msgs {
        let Some(calls) = m.tool_calls.take() else {
            continue;
        };
        let blocks: Vec<String> = calls
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let name = c.pointer("/function/name").cloned().unwrap_or_default();
                // OpenAI sends the arguments as a JSON string; the block holds the object.
                let args = match c.pointer("/function/arguments") {
                    Some(Value::String(s)) => {
                        serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone()))
                    }
                    Some(other) => other.clone(),
                    None => json!({}),
                };
                let call = json!({"name": name, "arguments": args});
                format!("<tool_call>\n{call}\n</tool_call>")
            })
            .collect();
        let calls_text = blocks.join("\n");
        m.content = match m.content.is_empty() {
            true => calls_text,
            false => format!("{}\n{calls_text}", m.content),
        };
    }
}

/// Splits a reply into its text outside calls (`None` when empty) and its calls in
/// OpenAI's shape. A block that does not parse as `{"name", "arguments"}` stays text.
pub(super) fn parse_calls(text: &str) -> (Option<String>, Vec<Value>) {
    let (open, close) = ("<tool_call>", "</tool_call>");
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        let after = &rest[start + open.len()..];
        let Some(end) = after.find(close) else { break };
        let body = after[..end].trim();
        let parsed = serde_json::from_str::<Value>(body).ok().and_then(|v| {
            let name = v.get("name")?.as_str()?.to_string();
            let args = v.get("arguments").cloned().unwrap_or_else(|| json!({}));
            Some((name, args))
        });
        match parsed {
            Some((name, args)) => {
                content.push_str(&rest[..start]);
                calls.push(json!({
                    "id": new_id("call"),
                    "type": "function",
                    "function": {"name": name, "arguments": args.to_string()},
                }));
            }
            None => content.push_str(&rest[..start + open.len() + end + close.len()]),
        }
        rest = &after[end + close.len()..];
    }
    content.push_str(rest);
    let content = content.trim();
    ((!content.is_empty()).then(|| content.to_string()), calls)
}

/// The call a grammar-forced reply was writing when `max_tokens` cut it short: its name
/// (the forced one, or as far as the text completes it) and its arguments' text so far,
/// which need not be valid JSON (OpenAI's `arguments` of a reply that hit its limit is
/// not either). `None` when the text has no unclosed call or no name yet.
pub(super) fn truncated_call(text: &str, forced_name: Option<&str>) -> Option<Value> {
    let start = text.rfind("<tool_call>")?;
    let body = &text[start + "<tool_call>".len()..];
    if body.contains("</tool_call>") {
        return None;
    }
    let written_name = || {
        let after = body
            .split_once("\"name\"")?
            .1
            .trim_start()
            .strip_prefix(':')?;
        let quoted = after.trim_start().strip_prefix('"')?;
        quoted.split_once('"').map(|(name, _)| name.to_string())
    };
    // The call's JSON may be whole with only the closing tag cut: its arguments are then
    // the parsed object's, not the text up to the end.
    let mut whole = serde_json::Deserializer::from_str(body.trim_start()).into_iter::<Value>();
    if let Some(Ok(v)) = whole.next() {
        let name = v.get("name").and_then(Value::as_str).map(str::to_string);
        if let (Some(name), Some(args)) =
            (forced_name.map(str::to_string).or(name), v.get("arguments"))
        {
            return Some(json!({
                "id": new_id("call"),
                "type": "function",
                "function": {"name": name, "arguments": args.to_string()},
            }));
        }
    }
    let name = forced_name.map(str::to_string).or_else(written_name)?;
    let arguments = body
        .split_once("\"arguments\"")
        .and_then(|(_, a)| a.trim_start().strip_prefix(':'))
        .map_or("", str::trim_start);
    Some(json!({
        "id": new_id("call"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_parsed_out_of_the_text_and_bad_blocks_stay_text() {
        let (content, calls) = parse_calls(
            "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>",
        );
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "f");
        assert_eq!(calls[0]["function"]["arguments"], "{\"x\":1}");
        assert_eq!(
            content.unwrap(),
            "Sure.\n\n<tool_call>\nnot json\n</tool_call>"
        );
        assert_eq!(parse_calls("plain").1.len(), 0);
    }

    /// A forced call cut short is still a call: the forced name, or the written one once
    /// complete, and the arguments so far; nothing before the name is complete.
    #[test]
    fn a_call_cut_short_keeps_its_name_and_partial_arguments() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa";
        let call = truncated_call(text, None).unwrap();
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(call["function"]["arguments"], "{\"city\": \"Pa");
        let early = "<tool_call>\n{\"name\": \"get_wea";
        assert_eq!(truncated_call(early, None), None);
        let named = truncated_call(early, Some("get_weather")).unwrap();
        assert_eq!(named["function"]["name"], "get_weather");
        assert_eq!(named["function"]["arguments"], "");
        let closed = "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(truncated_call(closed, None), None);
        // Whole JSON, the closing tag cut: the arguments are the object's, nothing after.
        let tag_cut =
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call";
        let call = truncated_call(tag_cut, Some("f")).unwrap();
        assert_eq!(call["function"]["arguments"], "{\"city\":\"Paris\"}");
    }

    #[test]
    fn earlier_calls_are_written_into_the_turn_for_a_template_without_them() {
        let calls = json!([{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]);
        check_history_calls(&calls).unwrap();
        assert!(check_history_calls(&json!({"name": "f"})).is_err());
        assert!(check_history_calls(&json!([{"function": {"arguments": "{}"}}])).is_err());
        let mut msg = ChatMessage::new("assistant", "");
        msg.tool_calls = Some(calls);
        let mut msgs = vec![ChatMessage::new("user", "weather?"), msg];
        inline_history_calls(&mut msgs);
        assert_eq!(
            msgs[1].content,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert!(msgs[1].tool_calls.is_none());
        assert_eq!(msgs[0].content, "weather?");
    }

    #[test]
    fn tool_choice_is_checked_against_the_tools() {
        let tools = Some(vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}),
        ]);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = parse(&tools, &Some(named), None).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        assert!(t.parallel, "parallel_tool_calls defaults to true");
        let GrammarSpec::Lark(lark) = t.grammar().unwrap().spec else {
            panic!("a Lark grammar")
        };
        assert!(
            lark.starts_with("start: call\n"),
            "one call of a named function: {lark}"
        );
        let required = parse(&tools, &Some(json!("required")), None)
            .unwrap()
            .unwrap();
        let GrammarSpec::Lark(lark) = required.grammar().unwrap().spec else {
            panic!("a Lark grammar")
        };
        assert!(lark.starts_with("start: call (\"\\n\" call)*"), "{lark}");
        let other = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(
            parse(&tools, &Some(other), None)
                .err()
                .unwrap()
                .param
                .as_deref(),
            Some("tool_choice")
        );
        assert_eq!(
            parse(&None, &Some(json!("required")), None)
                .err()
                .unwrap()
                .param
                .as_deref(),
            Some("tool_choice")
        );
        let bad = Some(vec![
            json!({"type": "function", "function": {"name": "has space"}}),
        ]);
        assert_eq!(
            parse(&bad, &None, None).err().unwrap().param.as_deref(),
            Some("tools")
        );
    }
}
