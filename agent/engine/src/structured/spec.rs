//! What a request constrains its output to, as the engine understands it, and its llguidance
//! grammar.

use llguidance::api::TopLevelGrammar;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One output constraint. The server maps OpenAI's `response_format` and vLLM's
/// `structured_outputs` / `guided_*` fields onto these.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid under this JSON schema.
    JsonSchema(Value),
    /// Text matching this regular expression (Rust `regex` syntax), in full.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect; `start` is the start rule).
    Lark(String),
}

impl GrammarSpec {
    /// The field of vLLM's `structured_outputs` this constraint corresponds to, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonObject => "json_object",
            GrammarSpec::JsonSchema(_) => "json",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
            GrammarSpec::Lark(_) => "grammar",
        }
    }

    /// A stable hash of the constraint: the key of the compiled-grammar cache.
    pub fn cache_key(&self) -> u64 {
        // serde_json writes object keys in insertion order here (`preserve_order` is on for
        // minijinja); the same schema sent with its keys reordered compiles once more, which only
        // costs a cache slot.
        let text = serde_json::to_vec(self).unwrap_or_default();
        xxhash_rust::xxh3::xxh3_64(&text)
    }

    /// llguidance's grammar for this constraint. JSON is generated compactly (no free whitespace
    /// between tokens) unless the schema sets its own `x-guidance` options: a small model given
    /// free whitespace can spend its whole budget on newlines.
    pub fn to_grammar(&self) -> TopLevelGrammar {
        match self {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"}))),
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema.clone())),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Choice(choices) => {
                let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

fn compact(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}
