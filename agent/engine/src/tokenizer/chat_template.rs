//! The model's own chat template, rendered with minijinja the way `transformers`'
//! `apply_chat_template` renders it with Jinja2.

use std::sync::Arc;

use minijinja::value::Kwargs;
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

mod strftime;

/// One chat turn. The optional fields are left out of the template's view when absent, so that
/// templates testing `message.tool_calls is defined` see what transformers would show them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls: `[{"id", "type": "function", "function": {"name", "arguments"}}]`,
    /// with `arguments` as a JSON object (templates `tojson` it), as vLLM hands them to templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A compiled chat template plus the BOS/EOS strings templates refer to as `bos_token`/`eos_token`.
/// Cheap to clone.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: Arc<str>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

const NAME: &str = "chat";

fn template_err(e: Error) -> EngineError {
    // `{:#}` includes the source line and the cause, which is what a template author needs.
    EngineError::ChatTemplate(format!("{e:#}"))
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported here rather than on the first request.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self> {
        let source: String = source.into();
        let mut env = Environment::new();
        // transformers builds its Jinja2 environment with these two set, and templates are written
        // against them: without them the rendered whitespace differs from what the model was trained on.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(template_err)?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        // Python string/dict methods (`.strip()`, `.startswith()`, `.items()` ...) HF templates call.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime::strftime_now);
        // Python's `json.dumps` output (no HTML escaping, `, ` and `: ` separators, non-ASCII kept),
        // as transformers' own `tojson` produces; minijinja's escapes `<`, `>`, `&` and `'`.
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.clone())
            .map_err(template_err)?;
        Ok(ChatTemplate {
            env: Arc::new(env),
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with the assistant turn's header.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Self::render`] with the request's `tools` (OpenAI's list of `{"type": "function",
    /// "function": {...}}`), passed as transformers' `apply_chat_template(tools=...)` passes them
    /// (`none` without tools). Templates that ignore `tools` render as without them.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(template_err)?;
        tmpl.render(context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            tools => tools.map(|t| Value::from(minijinja::value::Serde(t))),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(template_err)
    }
}

/// Templates call `raise_exception("...")` to reject conversations they cannot format.
fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json_err = |e: serde_json::Error| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    };
    let mut out = Vec::new();
    if sort_keys == Some(true) {
        // Sorted explicitly: serde_json's map keeps insertion order whenever any crate in the build
        // enables its `preserve_order` feature (llguidance does).
        let mut v = serde_json::to_value(value).map_err(json_err)?;
        v.sort_all_objects();
        write_json(&mut out, &v, indent).map_err(json_err)?;
    } else {
        write_json(&mut out, value, indent).map_err(json_err)?;
    }
    let text = String::from_utf8(out)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "JSON output is not UTF-8"))?;
    Ok(Value::from_safe_string(text))
}

fn write_json<T: Serialize + ?Sized>(
    out: &mut Vec<u8>,
    v: &T,
    indent: Option<usize>,
) -> serde_json::Result<()> {
    match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            v.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(out, PyFormatter);
            v.serialize(&mut ser)
        }
    }
}

/// `json.dumps` without indent: `[1, 2]`, `{"a": 1}`.
struct PyFormatter;

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
        ]
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        // Jinja2 with trim_blocks + lstrip_blocks drops the newline after a block tag and the
        // indentation before it; this is what transformers renders for this template.
        let src = "{% for m in messages %}\n    {{ m.role }}: {{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}\nassistant:\n{% endif %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(
            t.render(&msgs(), true).unwrap(),
            "    system: Be brief.\n    user: Hi\nassistant:\n"
        );
    }

    #[test]
    fn python_methods_tokens_and_raise_exception() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools: ' + m.role) }}{% endif %}{{ m['content'].strip().upper() }}{% if m.content.startswith('Be') %}!{% endif %}{{ eos_token }}{% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        assert_eq!(t.render(&msgs(), false).unwrap(), "<s>BE BRIEF.!</s>HI</s>");
        let err = t
            .render(&[ChatMessage::new("tool", "x")], false)
            .unwrap_err();
        assert!(
            matches!(&err, EngineError::ChatTemplate(m) if m.contains("no tools: tool")),
            "{err}"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        // Python: json.dumps({"a": "<b>é", "n": [1, 2.5, True, None]}, ensure_ascii=False)
        let t = ChatTemplate::new(
            "{{ {'a': '<b>é', 'n': [1, 2.5, true, none]} | tojson }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[], false).unwrap(),
            r#"{"a": "<b>é", "n": [1, 2.5, true, null]}"#
        );
        // Python: json.dumps({"b": 1, "a": [1]}, indent=2, sort_keys=True)
        let t = ChatTemplate::new(
            "{{ {'b': 1, 'a': [1]} | tojson(indent=2, sort_keys=true) }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[], false).unwrap(),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": 1\n}"
        );
    }

    #[test]
    fn tools_tool_calls_and_tool_turns_reach_the_template() {
        // A Hermes-style template: tools listed in the system turn, an assistant turn's calls as
        // `<tool_call>` lines, tool results with their call id; absent fields stay undefined.
        let src = concat!(
            "{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t.function.name + ': ' }}{{ t.function.parameters | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}",
            "{% for m in messages %}",
            "{% if m.tool_calls is defined %}{{ '<|im_start|>assistant\\n' }}{% for c in m.tool_calls %}",
            "{{ '<tool_call>' + c.function.name + ' ' }}{{ c.function.arguments | tojson }}{{ '</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}",
            "{% elif m.role == 'tool' %}{{ '<|im_start|>tool ' + m.tool_call_id + '\\n' + m.content + '<|im_end|>\\n' }}",
            "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}",
            "{% endfor %}",
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        );
        let t = ChatTemplate::new(src, "", "").unwrap();
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let messages = vec![
            ChatMessage::new("user", "Hi"),
            ChatMessage {
                tool_calls: Some(serde_json::json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}])),
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "42") },
        ];
        assert_eq!(
            t.render_with_tools(&messages, Some(&tools), true).unwrap(),
            concat!(
                "<|im_start|>system\nf: {\"type\": \"object\"}\n<|im_end|>\n",
                "<|im_start|>user\nHi<|im_end|>\n",
                "<|im_start|>assistant\n<tool_call>f {\"x\": 1}</tool_call><|im_end|>\n",
                "<|im_start|>tool call_1\n42<|im_end|>\n",
                "<|im_start|>assistant\n",
            )
        );
        // Without tools the template sees `none` (transformers passes `tools=None`).
        assert!(!t.render_with_tools(&messages[..1], None, false).unwrap().contains("system"));
    }

    #[test]
    fn syntax_error_is_a_chat_template_error() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
        assert!(matches!(err, EngineError::ChatTemplate(_)), "{err}");
    }
}
