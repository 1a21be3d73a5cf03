//! Tool calling on chat completions: which format the model writes its calls in, the grammar that
//! forces a call (`tool_choice` `required` or named), and the output → `tool_calls` parsing, whole
//! ([`parse_output`]) or streamed ([`stream::ToolStream`]).
//!
//! As in vLLM, a forced call does not depend on the model's own format: the grammar makes the
//! output the arguments object (named) or a JSON array of `{"name", "parameters"}` (required), and
//! the server turns that into `tool_calls`. With `auto` the model writes calls its own way and a
//! format parser ([`parsers`]) finds them.

pub mod parsers;
pub mod stream;

use peregrine_api::tools::{Tool, ToolCall, ToolType, FunctionCall, ToolUse};
use serde_json::{json, Value};

/// `--tool-call-parser`: the format `tool_choice: auto` outputs are parsed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ToolParserArg {
    /// From the chat template: `<tool_call>` → hermes, `<|python_tag|>` → llama3_json, else none.
    #[default]
    Auto,
    /// Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    Hermes,
    /// Llama 3.1 / 3.2 JSON: `{"name": ..., "parameters": {...}}`, several joined by `;`.
    #[value(name = "llama3_json")]
    Llama3Json,
    /// Outputs are never parsed; `tool_choice: auto` is refused.
    None,
}

/// A model's own tool-call format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallFormat {
    Hermes,
    Llama3Json,
}

impl ToolParserArg {
    /// The format outputs are parsed in, given the model's chat template (`auto` reads it).
    pub fn resolve(self, template: Option<&str>) -> Option<ToolCallFormat> {
        match self {
            ToolParserArg::Hermes => Some(ToolCallFormat::Hermes),
            ToolParserArg::Llama3Json => Some(ToolCallFormat::Llama3Json),
            ToolParserArg::None => None,
            ToolParserArg::Auto => {
                let t = template?;
                if t.contains("<tool_call>") {
                    Some(ToolCallFormat::Hermes)
                } else if t.contains("<|python_tag|>") || t.contains("ipython") {
                    Some(ToolCallFormat::Llama3Json)
                } else {
                    None
                }
            }
        }
    }
}

/// How one request's output becomes `tool_calls`.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolPlan {
    /// Plain text.
    Off,
    /// The model's own format, parsed.
    Auto(ToolCallFormat),
    /// The grammar makes the output `[{"name": ..., "parameters": {...}}, ...]`.
    Required,
    /// The grammar makes the output this function's arguments object.
    Named(String),
}

impl ToolPlan {
    /// None: `auto` was asked for but the model has no known call format (a 400, as vLLM refuses
    /// `auto` without `--tool-call-parser`).
    pub fn new(tool_use: &ToolUse, format: Option<ToolCallFormat>) -> Option<ToolPlan> {
        Some(match tool_use {
            ToolUse::Off => ToolPlan::Off,
            ToolUse::Auto => ToolPlan::Auto(format?),
            ToolUse::Required { .. } => ToolPlan::Required,
            ToolUse::Named(n) => ToolPlan::Named(n.clone()),
        })
    }

    pub fn is_off(&self) -> bool {
        matches!(self, ToolPlan::Off)
    }
}

/// The JSON schema a forced call's output must follow; None unless the call is forced.
pub fn forced_schema(tools: &[Tool], tool_use: &ToolUse) -> Option<Value> {
    match tool_use {
        ToolUse::Off | ToolUse::Auto => None,
        ToolUse::Named(name) => tools.iter().find(|t| &t.function.name == name).map(|t| t.function.parameters_schema()),
        ToolUse::Required { parallel } => {
            // One alternative per function: its name as a constant, then its arguments. The keys
            // are listed name first so the name is known before the arguments stream.
            let calls: Vec<Value> = tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t.function.name]},
                            "parameters": t.function.parameters_schema(),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            Some(schema)
        }
    }
}

/// One call found in an output.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// JSON text of the arguments.
    pub arguments: String,
}

/// A complete output split into text and calls.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedOutput {
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
}

/// Splits a finished output. Output that does not parse as calls stays content, as vLLM does.
pub fn parse_output(plan: &ToolPlan, text: &str) -> ParsedOutput {
    let as_content = || ParsedOutput { content: Some(text.to_string()), calls: Vec::new() };
    match plan {
        ToolPlan::Off => as_content(),
        ToolPlan::Auto(format) => parsers::parse(*format, text),
        ToolPlan::Named(name) => ParsedOutput { content: None, calls: vec![ParsedCall { name: name.clone(), arguments: text.to_string() }] },
        ToolPlan::Required => parsers::parse_required(text).map(|calls| ParsedOutput { content: None, calls }).unwrap_or_else(as_content),
    }
}

/// The id of a request's `index`-th call: unique per process run (the response id's hex) and call.
pub fn call_id(response_id: &str, index: usize) -> String {
    let unique = response_id.rsplit('-').next().unwrap_or(response_id);
    format!("call_{unique}{index:02x}")
}

/// Parsed calls as the API's objects.
pub fn api_calls(response_id: &str, calls: Vec<ParsedCall>) -> Vec<ToolCall> {
    calls
        .into_iter()
        .enumerate()
        .map(|(i, c)| ToolCall { id: call_id(response_id, i), kind: ToolType::Function, function: FunctionCall { name: c.name, arguments: c.arguments } })
        .collect()
}

/// The request's `tool_calls` history as chat templates expect it: `arguments` as a JSON object
/// (templates `tojson` it), as vLLM and transformers hand them over; text that is not JSON stays
/// a string.
pub fn template_tool_calls(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| {
                let arguments = serde_json::from_str::<Value>(&c.function.arguments).unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
                json!({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": arguments}})
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_reads_the_template() {
        assert_eq!(ToolParserArg::Auto.resolve(Some("{{ '<tool_call>' }}")), Some(ToolCallFormat::Hermes));
        assert_eq!(ToolParserArg::Auto.resolve(Some("{{ '<|python_tag|>' }}")), Some(ToolCallFormat::Llama3Json));
        assert_eq!(ToolParserArg::Auto.resolve(Some("{{ messages }}")), None);
        assert_eq!(ToolParserArg::Auto.resolve(None), None);
        assert_eq!(ToolParserArg::Hermes.resolve(None), Some(ToolCallFormat::Hermes));
        assert_eq!(ToolParserArg::None.resolve(Some("<tool_call>")), None);
    }

    #[test]
    fn forced_schemas() {
        let tools: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b"}}
        ]))
        .unwrap();
        assert_eq!(forced_schema(&tools, &ToolUse::Named("a".into())).unwrap()["properties"]["x"]["type"], "integer");
        assert_eq!(forced_schema(&tools, &ToolUse::Named("b".into())).unwrap()["additionalProperties"], false);
        let one = forced_schema(&tools, &ToolUse::Required { parallel: false }).unwrap();
        assert_eq!(one["maxItems"], 1);
        assert_eq!(one["items"]["anyOf"][1]["properties"]["name"]["enum"][0], "b");
        assert!(forced_schema(&tools, &ToolUse::Required { parallel: true }).unwrap().get("maxItems").is_none());
        assert!(forced_schema(&tools, &ToolUse::Auto).is_none());
    }

    #[test]
    fn whole_outputs_by_plan() {
        let named = parse_output(&ToolPlan::Named("f".into()), r#"{"x":1}"#);
        assert_eq!(named.calls, vec![ParsedCall { name: "f".into(), arguments: r#"{"x":1}"#.into() }]);
        let required = parse_output(&ToolPlan::Required, r#"[{"name":"f","parameters":{"x":1}},{"name":"g","parameters":{}}]"#);
        assert_eq!(required.calls.len(), 2);
        assert_eq!(required.calls[1], ParsedCall { name: "g".into(), arguments: "{}".into() });
        // Cut off by max_tokens: not a call, the text is returned as it is.
        let cut = parse_output(&ToolPlan::Required, r#"[{"name":"f","para"#);
        assert_eq!((cut.content.as_deref(), cut.calls.len()), (Some(r#"[{"name":"f","para"#), 0));
        assert_eq!(parse_output(&ToolPlan::Off, "<tool_call>").content.as_deref(), Some("<tool_call>"));
    }

    #[test]
    fn history_arguments_become_objects_for_templates() {
        let calls = vec![ToolCall { id: "call_1".into(), kind: ToolType::Function, function: FunctionCall { name: "f".into(), arguments: r#"{"x": 1}"#.into() } }];
        assert_eq!(template_tool_calls(&calls)[0]["function"]["arguments"]["x"], 1);
        assert_eq!(call_id("chatcmpl-1a2b", 3), "call_1a2b03");
    }
}
