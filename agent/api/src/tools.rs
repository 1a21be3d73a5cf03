//! Tool calling on `/v1/chat/completions`: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`,
//! the assistant's `tool_calls` (in requests and responses) and their streamed deltas.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ValidationError;

/// Most tools one request may declare (OpenAI allows 128).
pub const MAX_TOOLS: usize = 128;
/// Longest function name (OpenAI: 64 characters of `a-z A-Z 0-9 _ -`).
pub const MAX_FUNCTION_NAME: usize = 64;

/// One entry of `tools`. Only function tools exist in the chat API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: ToolType,
    pub function: FunctionDefinition,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolType {
    #[default]
    Function,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDefinition {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of the arguments object; absent: a function without parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// Accepted for compatibility: forced calls always follow the schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl FunctionDefinition {
    /// The arguments' schema; a function without `parameters` takes an empty object.
    pub fn parameters_schema(&self) -> Value {
        self.parameters
            .clone()
            .unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false}))
    }
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": ...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(ToolChoiceMode),
    Named(NamedToolChoice),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolChoiceMode {
    None,
    Auto,
    Required,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedToolChoice {
    #[serde(rename = "type")]
    pub kind: ToolType,
    pub function: FunctionName,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionName {
    pub name: String,
}

/// A call the assistant made: in a response, and in the history a client sends back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default)]
    pub kind: ToolType,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI sends and returns a string, not an object).
    pub arguments: String,
}

/// One streamed piece of a tool call: the first for an `index` carries `id`, `type` and the name;
/// later ones append to `arguments`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ToolType>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// What the request asks of the model about tools, once checked.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolUse {
    /// No tools, or `tool_choice: "none"`: plain text, never parsed.
    Off,
    /// The model may call tools in its own format; the server parses its output.
    Auto,
    /// At least one call (exactly one unless `parallel` is set), enforced by a grammar.
    Required { parallel: bool },
    /// Exactly one call of this function, enforced by a grammar.
    Named(String),
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls` together (OpenAI's defaults: `auto`
/// with tools, `none` without; parallel calls allowed).
pub fn tool_use(
    tools: Option<&[Tool]>,
    choice: Option<&ToolChoice>,
    parallel: Option<bool>,
) -> Result<ToolUse, ValidationError> {
    let tools = tools.unwrap_or(&[]);
    if tools.len() > MAX_TOOLS {
        return Err(ValidationError::new("tools", format!("at most {MAX_TOOLS} tools are allowed, got {}", tools.len())));
    }
    for (i, t) in tools.iter().enumerate() {
        let name = &t.function.name;
        let valid = !name.is_empty()
            && name.len() <= MAX_FUNCTION_NAME
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(ValidationError::new(
                &format!("tools[{i}].function.name"),
                format!("function names must be 1 to {MAX_FUNCTION_NAME} characters of a-z, A-Z, 0-9, _ and -"),
            ));
        }
        if tools[..i].iter().any(|o| &o.function.name == name) {
            return Err(ValidationError::new(&format!("tools[{i}].function.name"), format!("function `{name}` is declared twice")));
        }
        if let Some(p) = &t.function.parameters {
            if !p.is_object() {
                return Err(ValidationError::new(&format!("tools[{i}].function.parameters"), "parameters must be a JSON schema object"));
            }
        }
    }
    let parallel = parallel.unwrap_or(true);
    match choice {
        None if tools.is_empty() => Ok(ToolUse::Off),
        None => Ok(ToolUse::Auto),
        Some(ToolChoice::Mode(ToolChoiceMode::None)) => Ok(ToolUse::Off),
        Some(ToolChoice::Mode(_)) | Some(ToolChoice::Named(_)) if tools.is_empty() => {
            Err(ValidationError::new("tool_choice", "tool_choice needs `tools`"))
        }
        Some(ToolChoice::Mode(ToolChoiceMode::Auto)) => Ok(ToolUse::Auto),
        Some(ToolChoice::Mode(ToolChoiceMode::Required)) => Ok(ToolUse::Required { parallel }),
        Some(ToolChoice::Named(n)) => {
            if tools.iter().any(|t| t.function.name == n.function.name) {
                Ok(ToolUse::Named(n.function.name.clone()))
            } else {
                Err(ValidationError::new("tool_choice", format!("tool_choice names `{}`, which is not in `tools`", n.function.name)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools(v: Value) -> Vec<Tool> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn choices_parse_and_resolve() {
        let t = tools(json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]));
        let parse = |v: Value| serde_json::from_value::<ToolChoice>(v).unwrap();
        assert_eq!(tool_use(Some(&t[..]), None, None).unwrap(), ToolUse::Auto);
        assert_eq!(tool_use(None, None, None).unwrap(), ToolUse::Off);
        assert_eq!(tool_use(Some(&t[..]), Some(&parse(json!("none"))), None).unwrap(), ToolUse::Off);
        assert_eq!(tool_use(Some(&t[..]), Some(&parse(json!("required"))), Some(false)).unwrap(), ToolUse::Required { parallel: false });
        let named = parse(json!({"type": "function", "function": {"name": "get_weather"}}));
        assert_eq!(tool_use(Some(&t[..]), Some(&named), None).unwrap(), ToolUse::Named("get_weather".into()));
        let other = parse(json!({"type": "function", "function": {"name": "nope"}}));
        assert_eq!(tool_use(Some(&t[..]), Some(&other), None).unwrap_err().param.as_deref(), Some("tool_choice"));
        assert!(tool_use(None, Some(&parse(json!("required"))), None).is_err());
        assert!(serde_json::from_value::<ToolChoice>(json!("sometimes")).is_err());
    }

    #[test]
    fn bad_tools_are_refused_with_their_path() {
        let dup = tools(json!([
            {"type": "function", "function": {"name": "a"}},
            {"type": "function", "function": {"name": "a"}}
        ]));
        assert_eq!(tool_use(Some(&dup[..]), None, None).unwrap_err().param.as_deref(), Some("tools[1].function.name"));
        let bad = tools(json!([{"type": "function", "function": {"name": "has space"}}]));
        assert!(tool_use(Some(&bad[..]), None, None).is_err());
        let params = tools(json!([{"type": "function", "function": {"name": "a", "parameters": [1]}}]));
        assert!(tool_use(Some(&params[..]), None, None).is_err());
        let many: Vec<Tool> = (0..=MAX_TOOLS)
            .map(|i| Tool { kind: ToolType::Function, function: FunctionDefinition { name: format!("f{i}"), description: None, parameters: None, strict: None } })
            .collect();
        assert!(tool_use(Some(&many[..]), None, None).is_err());
    }
}
