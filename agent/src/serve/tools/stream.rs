//! Streaming tool calls: text arrives token by token and leaves as content deltas, call headers
//! (index + name; the handler adds id and type) and argument deltas, the way the OpenAI SDK
//! assembles `tool_calls` from chunks.
//!
//! Forced calls stream their arguments as they are generated: a named call's output *is* the
//! arguments; a required call's array is scanned ([`RequiredScanner`]) for each element's name
//! and the text of its `parameters` value. Calls in the model's own format (`auto`) are held
//! until each is complete (a call that turns out not to parse is sent as content).

use super::parsers::{hermes_call, HERMES_CLOSE, HERMES_OPEN, PYTHON_TAG};
use super::{parsers, ToolCallFormat, ToolPlan};

/// One piece of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolDelta {
    Content(String),
    /// The start of call `index`: its name (arguments follow).
    Call { index: usize, name: String },
    Arguments { index: usize, text: String },
}

/// Turns one request's streamed text into deltas, per its [`ToolPlan`].
#[derive(Debug)]
pub struct ToolStream {
    kind: Kind,
    calls: usize,
}

#[derive(Debug)]
enum Kind {
    Off,
    Named { name: String, started: bool },
    Required { scanner: RequiredScanner, named: usize, held: Vec<(usize, String)> },
    Hermes(Hermes),
    Llama3(Llama3),
}

#[derive(Debug)]
enum Hermes {
    /// Text, holding back a tail that may be the start of `<tool_call>` (and, after a call,
    /// whitespace: between and after calls it is dropped, as the whole-output parser drops it).
    Content { held: String, after_call: bool },
    /// After a `<tool_call>`: the call's text so far.
    InCall(String),
}

#[derive(Debug)]
enum Llama3 {
    /// Only whitespace (or part of `<|python_tag|>`) so far.
    Undecided(String),
    /// It began like a call: held whole until the end.
    Calls(String),
    Text,
}

impl ToolStream {
    pub fn new(plan: &ToolPlan) -> Self {
        let kind = match plan {
            ToolPlan::Off => Kind::Off,
            ToolPlan::Named(name) => Kind::Named { name: name.clone(), started: false },
            ToolPlan::Required => Kind::Required { scanner: RequiredScanner::default(), named: 0, held: Vec::new() },
            ToolPlan::Auto(ToolCallFormat::Hermes) => Kind::Hermes(Hermes::Content { held: String::new(), after_call: false }),
            ToolPlan::Auto(ToolCallFormat::Llama3Json) => Kind::Llama3(Llama3::Undecided(String::new())),
        };
        ToolStream { kind, calls: 0 }
    }

    /// Whether any call was sent (then `finish_reason` is `tool_calls`).
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        match &mut self.kind {
            Kind::Off => {
                if !text.is_empty() {
                    out.push(ToolDelta::Content(text.to_string()));
                }
            }
            Kind::Named { name, started } => {
                if !*started {
                    *started = true;
                    out.push(ToolDelta::Call { index: 0, name: name.clone() });
                }
                if !text.is_empty() {
                    out.push(ToolDelta::Arguments { index: 0, text: text.to_string() });
                }
            }
            Kind::Required { scanner, named, held } => {
                for event in scanner.push(text) {
                    match event {
                        ScanEvent::Name { index, name } => {
                            out.push(ToolDelta::Call { index, name });
                            *named = (*named).max(index + 1);
                            // Arguments that came before their name (not in our schema's order).
                            for (i, t) in held.iter().filter(|(i, _)| *i == index) {
                                out.push(ToolDelta::Arguments { index: *i, text: t.clone() });
                            }
                            held.retain(|(i, _)| *i != index);
                        }
                        ScanEvent::Arguments { index, text } if index < *named => out.push(ToolDelta::Arguments { index, text }),
                        ScanEvent::Arguments { index, text } => held.push((index, text)),
                    }
                }
            }
            Kind::Hermes(state) => hermes_push(state, text, self.calls, &mut out),
            Kind::Llama3(state) => match state {
                Llama3::Text => {
                    if !text.is_empty() {
                        out.push(ToolDelta::Content(text.to_string()));
                    }
                }
                Llama3::Calls(buf) => buf.push_str(text),
                Llama3::Undecided(buf) => {
                    buf.push_str(text);
                    let t = buf.trim_start();
                    if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                        *state = Llama3::Calls(std::mem::take(buf));
                    } else if !t.is_empty() && !PYTHON_TAG.starts_with(t) {
                        out.push(ToolDelta::Content(std::mem::take(buf)));
                        *state = Llama3::Text;
                    }
                }
            },
        }
        self.count(&out);
        out
    }

    /// What is left when the output ends.
    pub fn finish(&mut self) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        match &mut self.kind {
            Kind::Off | Kind::Required { .. } => {}
            Kind::Named { name, started } => {
                if !*started {
                    *started = true;
                    out.push(ToolDelta::Call { index: 0, name: name.clone() });
                }
            }
            Kind::Hermes(Hermes::Content { held, after_call }) => {
                let held = std::mem::take(held);
                // After a call, trailing whitespace is dropped (as the whole-output parser does).
                let dropped = held.is_empty() || *after_call && held.trim().is_empty();
                if !dropped {
                    out.push(ToolDelta::Content(held));
                }
            }
            Kind::Hermes(Hermes::InCall(buf)) => {
                let body = std::mem::take(buf);
                if !body.trim().is_empty() {
                    match hermes_call(&body) {
                        Some(call) => push_call(self.calls, call, &mut out),
                        None => out.push(ToolDelta::Content(format!("{HERMES_OPEN}{body}"))),
                    }
                }
            }
            Kind::Llama3(Llama3::Undecided(buf)) | Kind::Llama3(Llama3::Calls(buf)) => {
                let text = std::mem::take(buf);
                let parsed = parsers::parse(ToolCallFormat::Llama3Json, &text);
                if let Some(content) = parsed.content {
                    if !content.is_empty() {
                        out.push(ToolDelta::Content(content));
                    }
                }
                for (i, call) in parsed.calls.into_iter().enumerate() {
                    push_call(self.calls + i, call, &mut out);
                }
            }
            Kind::Llama3(Llama3::Text) => {}
        }
        self.count(&out);
        out
    }

    fn count(&mut self, out: &[ToolDelta]) {
        self.calls += out.iter().filter(|d| matches!(d, ToolDelta::Call { .. })).count();
    }
}

fn push_call(index: usize, call: super::ParsedCall, out: &mut Vec<ToolDelta>) {
    out.push(ToolDelta::Call { index, name: call.name });
    out.push(ToolDelta::Arguments { index, text: call.arguments });
}

/// `calls`: the calls sent before this push (the next one's index).
fn hermes_push(state: &mut Hermes, text: &str, calls: usize, out: &mut Vec<ToolDelta>) {
    let mut next = calls;
    match state {
        Hermes::Content { held, .. } => held.push_str(text),
        Hermes::InCall(buf) => buf.push_str(text),
    }
    loop {
        match state {
            Hermes::Content { held, after_call } => {
                if let Some(p) = held.find(HERMES_OPEN) {
                    if p > 0 && !(*after_call && held[..p].trim().is_empty()) {
                        out.push(ToolDelta::Content(held[..p].to_string()));
                    }
                    let rest = held[p + HERMES_OPEN.len()..].to_string();
                    *state = Hermes::InCall(rest);
                    continue;
                }
                // Send all but a tail that could still grow into `<tool_call>`.
                let keep = if *after_call && HERMES_OPEN.starts_with(held.trim_start()) {
                    held.len()
                } else {
                    (1..HERMES_OPEN.len().min(held.len() + 1))
                        .rev()
                        .find(|&n| held.is_char_boundary(held.len() - n) && HERMES_OPEN.starts_with(&held[held.len() - n..]))
                        .unwrap_or(0)
                };
                let send = held.len() - keep;
                if send > 0 {
                    out.push(ToolDelta::Content(held[..send].to_string()));
                    held.drain(..send);
                }
                break;
            }
            Hermes::InCall(buf) => {
                let Some(close) = buf.find(HERMES_CLOSE) else { break };
                let body = buf[..close].to_string();
                let rest = buf[close + HERMES_CLOSE.len()..].to_string();
                match hermes_call(&body) {
                    Some(call) => {
                        push_call(next, call, out);
                        next += 1;
                    }
                    None => out.push(ToolDelta::Content(format!("{HERMES_OPEN}{body}{HERMES_CLOSE}"))),
                }
                // Whitespace between calls is dropped; anything else is content again.
                *state = Hermes::Content { held: rest.trim_start().to_string(), after_call: true };
            }
        }
    }
}

/// What [`RequiredScanner`] finds in `[{"name": ..., "parameters": ...}, ...]`.
#[derive(Debug, Clone, PartialEq)]
pub enum ScanEvent {
    Name { index: usize, name: String },
    /// More of the text of element `index`'s `parameters` value.
    Arguments { index: usize, text: String },
}

/// An incremental scanner of the forced `required` array. It does not validate (the grammar
/// guarantees the shape); it tracks strings and nesting so that it knows where each element's
/// name and `parameters` value are.
#[derive(Debug, Default)]
pub struct RequiredScanner {
    /// Text not consumed yet (a key or name string still incomplete).
    pending: String,
    at: At,
    /// Elements started so far.
    elements: usize,
}

#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum At {
    #[default]
    Start,
    Between,
    Keys,
    Colon(Key),
    Value(Key, ValueScan),
    AfterValue,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Key {
    Name,
    Parameters,
    Other,
}

#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct ValueScan {
    started: bool,
    depth: usize,
    in_string: bool,
    escape: bool,
}

impl RequiredScanner {
    pub fn push(&mut self, text: &str) -> Vec<ScanEvent> {
        self.pending.push_str(text);
        let pending = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        // The current element's arguments text found in this push; flushed before anything that
        // follows it in the text, so events stay in text order.
        let mut args = String::new();
        let flush = |args: &mut String, out: &mut Vec<ScanEvent>, elements: usize| {
            if !args.is_empty() {
                out.push(ScanEvent::Arguments { index: elements.saturating_sub(1), text: std::mem::take(args) });
            }
        };
        let mut i = 0;
        while i < pending.len() {
            let Some(c) = pending[i..].chars().next() else { break };
            let mut step = c.len_utf8();
            match self.at {
                At::Done => step = pending.len() - i,
                At::Start => {
                    if c == '[' {
                        self.at = At::Between;
                    }
                }
                At::Between => match c {
                    '{' => {
                        flush(&mut args, &mut out, self.elements);
                        self.elements += 1;
                        self.at = At::Keys;
                    }
                    ']' => self.at = At::Done,
                    _ => {}
                },
                At::Keys => match c {
                    '"' => {
                        let Some(len) = string_len(&pending[i..]) else { break };
                        let key: String = serde_json::from_str(&pending[i..i + len]).unwrap_or_default();
                        self.at = At::Colon(match key.as_str() {
                            "name" => Key::Name,
                            "parameters" => Key::Parameters,
                            _ => Key::Other,
                        });
                        step = len;
                    }
                    '}' => self.at = At::Between,
                    _ => {}
                },
                At::Colon(key) => {
                    if c == ':' {
                        self.at = At::Value(key, ValueScan::default());
                    }
                }
                At::Value(Key::Name, _) if c == '"' => {
                    let Some(len) = string_len(&pending[i..]) else { break };
                    let name: String = serde_json::from_str(&pending[i..i + len]).unwrap_or_default();
                    flush(&mut args, &mut out, self.elements);
                    out.push(ScanEvent::Name { index: self.elements.saturating_sub(1), name });
                    self.at = At::AfterValue;
                    step = len;
                }
                At::Value(key, mut scan) => {
                    let (consumed, done) = scan.next(c);
                    if consumed && key == Key::Parameters {
                        args.push(c);
                    }
                    if done && !consumed {
                        // The character that ended a scalar belongs to what follows it.
                        step = 0;
                    }
                    self.at = if done { At::AfterValue } else { At::Value(key, scan) };
                }
                At::AfterValue => match c {
                    ',' => self.at = At::Keys,
                    '}' => self.at = At::Between,
                    _ => {}
                },
            }
            i += step;
        }
        flush(&mut args, &mut out, self.elements);
        self.pending = pending[i..].to_string();
        out
    }
}

impl ValueScan {
    /// Feeds one character of a value: (part of the value?, value complete?). A character that
    /// ends a scalar (`,` `}` `]` or whitespace) is not part of it and is looked at again.
    fn next(&mut self, c: char) -> (bool, bool) {
        if !self.started {
            if c.is_whitespace() {
                return (false, false);
            }
            self.started = true;
        }
        if self.in_string {
            if self.escape {
                self.escape = false;
            } else if c == '\\' {
                self.escape = true;
            } else if c == '"' {
                self.in_string = false;
                return (true, self.depth == 0);
            }
            return (true, false);
        }
        match c {
            '"' => {
                self.in_string = true;
                (true, false)
            }
            '{' | '[' => {
                self.depth += 1;
                (true, false)
            }
            '}' | ']' if self.depth == 0 => (false, true),
            '}' | ']' => {
                self.depth -= 1;
                (true, self.depth == 0)
            }
            ',' if self.depth == 0 => (false, true),
            c if c.is_whitespace() && self.depth == 0 => (false, true),
            _ => (true, false),
        }
    }
}

/// Length in bytes of the JSON string at the start of `s` (quotes included), None if incomplete.
fn string_len(s: &str) -> Option<usize> {
    let mut escape = false;
    for (i, c) in s.char_indices().skip(1) {
        if escape {
            escape = false;
        } else if c == '\\' {
            escape = true;
        } else if c == '"' {
            return Some(i + 1);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `size` characters and assembles what a client would: the content
    /// and each call's name and arguments, checking indexes arrive in order with the name first.
    fn run(plan: &ToolPlan, text: &str, size: usize) -> (String, Vec<(String, String)>, bool) {
        let mut stream = ToolStream::new(plan);
        let chars: Vec<char> = text.chars().collect();
        let mut deltas = Vec::new();
        for piece in chars.chunks(size) {
            deltas.extend(stream.push(&piece.iter().collect::<String>()));
        }
        deltas.extend(stream.finish());
        let (mut content, mut calls) = (String::new(), Vec::<(String, String)>::new());
        for d in deltas {
            match d {
                ToolDelta::Content(t) => content.push_str(&t),
                ToolDelta::Call { index, name } => {
                    assert_eq!(index, calls.len(), "calls start in order");
                    calls.push((name, String::new()));
                }
                ToolDelta::Arguments { index, text } => calls[index].1.push_str(&text),
            }
        }
        (content, calls, stream.called())
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    }

    #[test]
    fn required_arrays_stream_names_then_exact_arguments() {
        let text = r#"[{"name":"get_weather","parameters":{"city":"Pa\"ris}","days":[1,2]}},{"name":"now","parameters":{}}]"#;
        for size in [1, 2, 5, 1000] {
            let (content, calls, called) = run(&ToolPlan::Required, text, size);
            assert_eq!(content, "");
            assert_eq!(calls, pairs(&[("get_weather", r#"{"city":"Pa\"ris}","days":[1,2]}"#), ("now", "{}")]), "size {size}");
            assert!(called);
        }
        // Whitespace and a scalar value are scanned too.
        let (_, calls, _) = run(&ToolPlan::Required, "[ { \"name\" : \"f\" , \"parameters\" : 12 } ]", 1);
        assert_eq!(calls, pairs(&[("f", "12")]));
    }

    #[test]
    fn named_calls_stream_the_output_as_arguments() {
        let plan = ToolPlan::Named("f".into());
        assert_eq!(run(&plan, r#"{"x":1}"#, 2), (String::new(), pairs(&[("f", r#"{"x":1}"#)]), true));
    }

    #[test]
    fn hermes_streams_content_and_holds_calls_until_complete() {
        let plan = ToolPlan::Auto(ToolCallFormat::Hermes);
        let text = "Checking <b>.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"q\": \"<tool_call>\"}}\n</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {}}";
        for size in [1, 3, 1000] {
            let (content, calls, _) = run(&plan, text, size);
            assert_eq!(content, "Checking <b>.\n", "size {size}");
            assert_eq!(calls, pairs(&[("a", r#"{"q":"<tool_call>"}"#), ("b", "{}")]), "size {size}");
        }
        // Text that only looks like the start of a tag is sent in the end; a broken call is content.
        assert_eq!(run(&plan, "a <tool", 1), ("a <tool".into(), vec![], false));
        assert_eq!(run(&plan, "<tool_call>oops</tool_call> ok", 2), ("<tool_call>oops</tool_call>ok".into(), vec![], false));
    }

    #[test]
    fn llama3_streams_text_at_once_and_calls_at_the_end() {
        let plan = ToolPlan::Auto(ToolCallFormat::Llama3Json);
        let (content, calls, called) = run(&plan, "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}", 1);
        assert_eq!((content.as_str(), calls, called), ("", pairs(&[("a", r#"{"x":1}"#)]), true));
        let mut stream = ToolStream::new(&plan);
        assert_eq!(stream.push("  Hello"), vec![ToolDelta::Content("  Hello".into())]);
        assert_eq!(run(&plan, "{not a call", 3), ("{not a call".into(), vec![], false));
    }

    #[test]
    fn off_passes_text_through() {
        assert_eq!(run(&ToolPlan::Off, "<tool_call>{}</tool_call>", 4), ("<tool_call>{}</tool_call>".into(), vec![], false));
    }
}
