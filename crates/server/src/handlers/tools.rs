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
        let calls = if self.parallel {
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
    }

    #[test]
    fn tool_choice_is_checked_against_the_tools() {
        let tools = Some(vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}),
        ]);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = parse(&tools, &Some(named), None).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_weather".into()));
        assert!(t.grammar().is_some());
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
