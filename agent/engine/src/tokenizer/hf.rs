//! Loading a tokenizer from a Hugging Face model folder.

use std::path::Path;

use serde_json::Value;

use super::{ChatTemplate, Tokenizer, TokenizerParts};
use crate::error::{EngineError, Result};

fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let bytes = std::fs::read(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| EngineError::invalid_model(path, format!("not a valid tokenizer.json: {e}")))
}

pub(super) fn from_tokenizer_json(path: &Path) -> Result<Tokenizer> {
    let tk = load_tokenizer_json(path)?;
    Ok(Tokenizer::from_parts(TokenizerParts {
        tk,
        bos_token_id: None,
        eos_token_ids: Vec::new(),
        force_bos: false,
        chat_template: None,
    }))
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| EngineError::invalid_model(path, format!("not valid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(EngineError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// `bos_token` and friends are either a plain string or a serialized `AddedToken` object.
fn token_content(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is either one string or a list of `{name, template}`; the one named "default"
/// (else the first) is the one `apply_chat_template` uses without a `chat_template` argument.
fn template_source(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let named = |n: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(n))
            };
            named("default")
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        }
        _ => None,
    }
}

fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

pub(super) fn from_hf_folder(dir: &Path) -> Result<Tokenizer> {
    let tk_path = dir.join("tokenizer.json");
    if !tk_path.is_file() {
        return Err(EngineError::invalid_model(
            dir,
            "no tokenizer.json in the model folder",
        ));
    }
    let tk = load_tokenizer_json(&tk_path)?;
    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let gen_config = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);

    let bos = token_content(config.get("bos_token"));
    let eos = token_content(config.get("eos_token"));
    let bos_token_id = bos.as_deref().and_then(|t| tk.token_to_id(t));
    let mut eos_token_ids: Vec<u32> = eos
        .as_deref()
        .and_then(|t| tk.token_to_id(t))
        .into_iter()
        .collect();
    // generation_config.json may list more ids that end a turn (Llama 3: <|eot_id|>, <|eom_id|>).
    eos_token_ids.extend(ids_of(gen_config.get("eos_token_id")));

    // Newer HF folders keep the template in its own file, which wins over the config entry.
    let jinja_path = dir.join("chat_template.jinja");
    let source = match std::fs::read_to_string(&jinja_path) {
        Ok(s) => Some(s),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            config.get("chat_template").and_then(template_source)
        }
        Err(source) => {
            return Err(EngineError::Io {
                path: jinja_path,
                source,
            })
        }
    };
    let chat_template = source
        .map(|s| {
            ChatTemplate::new(
                s,
                bos.clone().unwrap_or_default(),
                eos.clone().unwrap_or_default(),
            )
        })
        .transpose()?;

    Ok(Tokenizer::from_parts(TokenizerParts {
        tk,
        bos_token_id,
        eos_token_ids,
        force_bos: config.get("add_bos_token").and_then(Value::as_bool) == Some(true),
        chat_template,
    }))
}
