//! Finished outputs → calls, per format: the model's own (Hermes/Qwen `<tool_call>` tags, Llama 3
//! JSON) for `tool_choice: auto`, and the forced array for `required`.

use serde_json::Value;

use super::stream::{RequiredScanner, ScanEvent};
use super::{ParsedCall, ParsedOutput, ToolCallFormat};

pub const HERMES_OPEN: &str = "<tool_call>";
pub const HERMES_CLOSE: &str = "</tool_call>";
/// Llama 3.1's marker before a call (a special token: present only when special tokens are kept).
pub const PYTHON_TAG: &str = "<|python_tag|>";

/// The calls in a finished `auto` output. Anything that does not parse is returned as content.
pub fn parse(format: ToolCallFormat, text: &str) -> ParsedOutput {
    let parsed = match format {
        ToolCallFormat::Hermes => hermes(text),
        ToolCallFormat::Llama3Json => llama3_json(text),
    };
    parsed.unwrap_or_else(|| ParsedOutput { content: Some(text.to_string()), calls: Vec::new() })
}

/// `text <tool_call>{...}</tool_call> <tool_call>{...}</tool_call>`: the text before the first tag
/// is content; the last call may lack its closing tag (generation stopped at EOS right after it).
fn hermes(text: &str) -> Option<ParsedOutput> {
    let start = text.find(HERMES_OPEN)?;
    let content = text[..start].trim();
    let mut calls = Vec::new();
    let mut rest = &text[start..];
    while let Some(open) = rest.find(HERMES_OPEN) {
        if !rest[..open].trim().is_empty() {
            return None;
        }
        let body_start = open + HERMES_OPEN.len();
        let (body, next) = match rest[body_start..].find(HERMES_CLOSE) {
            Some(close) => (&rest[body_start..body_start + close], &rest[body_start + close + HERMES_CLOSE.len()..]),
            None => (&rest[body_start..], ""),
        };
        calls.push(hermes_call(body)?);
        rest = next;
    }
    if !rest.trim().is_empty() {
        return None;
    }
    Some(ParsedOutput { content: (!content.is_empty()).then(|| content.to_string()), calls })
}

/// One `{"name": ..., "arguments": {...}}` (arguments may also be JSON text).
pub fn hermes_call(body: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    call_from(&v, &["arguments", "parameters"])
}

/// `[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*`: the whole output is calls or
/// it is content (Llama 3 writes no text beside its JSON calls).
fn llama3_json(text: &str) -> Option<ParsedOutput> {
    let body = text.trim_start();
    let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body).trim();
    if !body.starts_with('{') {
        return None;
    }
    let mut calls = Vec::new();
    let mut rest = body;
    loop {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = values.next()?.ok()?;
        calls.push(call_from(&v, &["parameters", "arguments"])?);
        rest = rest[values.byte_offset()..].trim_start();
        if rest.is_empty() {
            break;
        }
        rest = rest.strip_prefix(';')?.trim_start();
    }
    Some(ParsedOutput { content: None, calls })
}

/// `{"name": "f", <args key>: {...}}` → a call; the arguments as compact JSON text.
fn call_from(v: &Value, args_keys: &[&str]) -> Option<ParsedCall> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let args = args_keys.iter().find_map(|k| obj.get(*k));
    let arguments = match args {
        None => "{}".to_string(),
        // Some models write the arguments as a JSON string.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
        Some(a) => serde_json::to_string(a).ok()?,
    };
    Some(ParsedCall { name, arguments })
}

/// The forced `required` output `[{"name": ..., "parameters": {...}}, ...]`, checked whole with
/// serde_json, its arguments taken as the exact text the model wrote (what streaming sent).
pub fn parse_required(text: &str) -> Option<Vec<ParsedCall>> {
    let items: Vec<Value> = serde_json::from_str(text).ok()?;
    if items.is_empty() || items.iter().any(|i| i.get("name").and_then(Value::as_str).is_none()) {
        return None;
    }
    let mut scanner = RequiredScanner::default();
    let mut calls: Vec<ParsedCall> = Vec::new();
    for event in scanner.push(text) {
        match event {
            ScanEvent::Name { index, name } if index == calls.len() => calls.push(ParsedCall { name, arguments: String::new() }),
            ScanEvent::Arguments { index, text } => calls.get_mut(index)?.arguments.push_str(&text),
            _ => return None,
        }
    }
    (calls.len() == items.len()).then_some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: arguments.into() }
    }

    #[test]
    fn hermes_outputs() {
        // Qwen 2.5's way: a newline-wrapped JSON object per call, text before the first.
        let out = parse(
            ToolCallFormat::Hermes,
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(out.content.as_deref(), Some("Let me check."));
        assert_eq!(out.calls, vec![call("get_weather", r#"{"city":"Paris"}"#), call("get_time", "{}")]);
        // Stopped at EOS before the closing tag.
        let out = parse(ToolCallFormat::Hermes, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}");
        assert_eq!((out.content, out.calls), (None, vec![call("f", r#"{"a": 1}"#)]));
        // No tag, or a tag around something that is not a call: all content.
        for text in ["Just text.", "<tool_call>not json</tool_call>", "<tool_call>{\"name\": \"f\"}</tool_call> trailing"] {
            let out = parse(ToolCallFormat::Hermes, text);
            assert_eq!((out.content.as_deref(), out.calls.len()), (Some(text), 0), "{text}");
        }
    }

    #[test]
    fn llama3_json_outputs() {
        let out = parse(ToolCallFormat::Llama3Json, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 2}}");
        assert_eq!(out.calls, vec![call("get_weather", r#"{"city":"Paris","days":2}"#)]);
        assert_eq!(out.content, None);
        // With the python tag kept, and two calls joined by `;`.
        let out = parse(ToolCallFormat::Llama3Json, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": {\"x\": [1]}}");
        assert_eq!(out.calls, vec![call("a", "{}"), call("b", r#"{"x":[1]}"#)]);
        for text in ["The weather is nice.", "{\"name\": \"a\", \"parameters\": {}} and more", "{\"city\": \"Paris\"}", "{\"name\": "] {
            let out = parse(ToolCallFormat::Llama3Json, text);
            assert_eq!((out.content.as_deref(), out.calls.len()), (Some(text), 0), "{text}");
        }
    }

    #[test]
    fn required_keeps_the_arguments_text() {
        let calls = parse_required(r#"[{"name":"f","parameters":{"s":"a,}\"]","n":1.50}},{"name":"g","parameters":{}}]"#).unwrap();
        assert_eq!(calls, vec![call("f", r#"{"s":"a,}\"]","n":1.50}"#), call("g", "{}")]);
        assert!(parse_required("[]").is_none());
        assert!(parse_required(r#"[{"name":"f","parameters":{}}"#).is_none());
    }
}
