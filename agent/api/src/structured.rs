//! Structured-output fields: OpenAI's `response_format` and vLLM's `structured_outputs` (and the
//! older `guided_*` names vLLM still accepts), on both completions and chat.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ValidationError;

/// Largest regex or grammar text accepted (the body limit bounds schemas too; this bounds the
/// compile work a single text field can ask for).
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;
/// Most strings a `choice` constraint may list.
pub const MAX_CHOICES: usize = 1024;

/// OpenAI's `response_format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ResponseFormat {
    /// Unconstrained text (the default).
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Absent: any JSON object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
    /// Accepted for compatibility: the output always follows the schema, strict or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs` object: exactly one of its constraints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StructuredOutputs {
    /// A JSON schema, as an object or as a JSON string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice: Option<Vec<String>>,
    /// A Lark or GBNF grammar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_object: Option<bool>,
}

/// The structured-output fields of a request, flattened into it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StructuredFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub structured_outputs: Option<StructuredOutputs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_json: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_regex: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_choice: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided_grammar: Option<String>,
}

/// What the output must follow, whichever field asked for it.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    JsonObject,
    JsonSchema(Value),
    Regex(String),
    Choice(Vec<String>),
    /// A Lark grammar.
    Grammar(String),
}

/// A constraint together with the request field it came from (errors name that field).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedConstraint {
    pub param: &'static str,
    pub constraint: OutputConstraint,
}

impl StructuredFields {
    /// The one constraint the request asks for, checked: at most one field may set one, schemas
    /// must be JSON objects (or JSON text of one), texts are bounded.
    pub fn constraint(&self) -> Result<Option<NamedConstraint>, ValidationError> {
        let mut found: Vec<NamedConstraint> = Vec::new();
        fn add(found: &mut Vec<NamedConstraint>, param: &'static str, c: Result<OutputConstraint, ValidationError>) -> Result<(), ValidationError> {
            found.push(NamedConstraint { param, constraint: c? });
            Ok(())
        }
        match &self.response_format {
            None | Some(ResponseFormat::Text) => {}
            Some(ResponseFormat::JsonObject) => add(&mut found, "response_format", Ok(OutputConstraint::JsonObject))?,
            Some(ResponseFormat::JsonSchema { json_schema }) => add(&mut found, 
                "response_format",
                match &json_schema.schema {
                    None => Ok(OutputConstraint::JsonObject),
                    Some(s) => schema("response_format", s).map(OutputConstraint::JsonSchema),
                },
            )?,
        }
        if let Some(so) = &self.structured_outputs {
            const P: &str = "structured_outputs";
            let before = found.len();
            if let Some(j) = &so.json {
                add(&mut found, P, schema(P, j).map(OutputConstraint::JsonSchema))?;
            }
            if let Some(r) = &so.regex {
                add(&mut found, P, text(P, r).map(OutputConstraint::Regex))?;
            }
            if let Some(c) = &so.choice {
                add(&mut found, P, choices(P, c).map(OutputConstraint::Choice))?;
            }
            if let Some(g) = &so.grammar {
                add(&mut found, P, grammar(P, g).map(OutputConstraint::Grammar))?;
            }
            if so.json_object == Some(true) {
                add(&mut found, P, Ok(OutputConstraint::JsonObject))?;
            }
            if found.len() == before {
                return Err(ValidationError::new(P, "structured_outputs must set one of json, regex, choice, grammar, json_object"));
            }
        }
        if let Some(j) = &self.guided_json {
            add(&mut found, "guided_json", schema("guided_json", j).map(OutputConstraint::JsonSchema))?;
        }
        if let Some(r) = &self.guided_regex {
            add(&mut found, "guided_regex", text("guided_regex", r).map(OutputConstraint::Regex))?;
        }
        if let Some(c) = &self.guided_choice {
            add(&mut found, "guided_choice", choices("guided_choice", c).map(OutputConstraint::Choice))?;
        }
        if let Some(g) = &self.guided_grammar {
            add(&mut found, "guided_grammar", grammar("guided_grammar", g).map(OutputConstraint::Grammar))?;
        }
        match found.len() {
            0 => Ok(None),
            1 => Ok(found.pop()),
            _ => {
                let names: Vec<&str> = found.iter().map(|c| c.param).collect();
                Err(ValidationError::new(
                    found[1].param,
                    format!("only one output constraint may be given per request; got several ({})", names.join(", ")),
                ))
            }
        }
    }
}

/// A JSON schema: an object or a boolean, or a JSON string holding one.
fn schema(param: &str, v: &Value) -> Result<Value, ValidationError> {
    let parsed = match v {
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| ValidationError::new(param, format!("the JSON schema is not valid JSON: {e}")))?,
        other => other.clone(),
    };
    match parsed {
        Value::Object(_) | Value::Bool(_) => Ok(parsed),
        _ => Err(ValidationError::new(param, "the JSON schema must be a JSON object")),
    }
}

fn text(param: &str, s: &str) -> Result<String, ValidationError> {
    if s.is_empty() {
        return Err(ValidationError::new(param, "must not be empty"));
    }
    if s.len() > MAX_GRAMMAR_BYTES {
        return Err(ValidationError::new(param, format!("must be at most {MAX_GRAMMAR_BYTES} bytes")));
    }
    Ok(s.to_string())
}

fn choices(param: &str, c: &[String]) -> Result<Vec<String>, ValidationError> {
    if c.is_empty() || c.len() > MAX_CHOICES {
        return Err(ValidationError::new(param, format!("choice must list between 1 and {MAX_CHOICES} strings")));
    }
    if c.iter().any(String::is_empty) {
        return Err(ValidationError::new(param, "choices must not be empty strings"));
    }
    if c.iter().map(String::len).sum::<usize>() > MAX_GRAMMAR_BYTES {
        return Err(ValidationError::new(param, format!("choices must total at most {MAX_GRAMMAR_BYTES} bytes")));
    }
    Ok(c.to_vec())
}

/// A Lark grammar, or a GBNF one (llama.cpp's `name ::= ...` rules, as vLLM tells them apart),
/// converted to Lark.
fn grammar(param: &str, g: &str) -> Result<String, ValidationError> {
    let g = text(param, g)?;
    if g.contains("::=") {
        return crate::gbnf::gbnf_to_lark(&g).map_err(|e| ValidationError::new(param, format!("invalid GBNF grammar: {e}")));
    }
    Ok(g)
}
