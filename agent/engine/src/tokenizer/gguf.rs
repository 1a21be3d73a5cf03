//! Rebuilding a `tokenizers` pipeline from GGUF `tokenizer.ggml.*` metadata.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

use super::{pretokenizer, ChatTemplate, Tokenizer, TokenizerParts};
use crate::error::{EngineError, Result};
use crate::model::gguf::{GgufFile, GgufValue};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

pub(super) fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
    let invalid = |message: String| EngineError::invalid_model(file.path(), message);
    let get = |key: &str| file.get(key);
    let string_array = |key: &str| -> Result<Vec<&str>> {
        let arr = get(key)
            .and_then(GgufValue::as_array)
            .ok_or_else(|| invalid(format!("missing array {key}")))?;
        arr.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .ok_or_else(|| invalid(format!("{key}[{i}] is not a string")))
            })
            .collect()
    };
    let token_id = |key: &str| -> Result<Option<u32>> {
        match get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| invalid(format!("{key} is not a token id"))),
        }
    };
    let flag = |key: &str| get(key).and_then(GgufValue::as_bool);

    let model = get("tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .ok_or_else(|| invalid("missing tokenizer.ggml.model".into()))?;
    if model != "gpt2" {
        return Err(EngineError::Unsupported(format!(
            "GGUF tokenizer model {model:?} (only byte-level BPE, \"gpt2\", is supported; use the HF folder's tokenizer.json)"
        )));
    }
    let tokens = string_array("tokenizer.ggml.tokens")?;
    let merges = string_array("tokenizer.ggml.merges")?;
    let token_types: Vec<u64> = match get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(v) => {
            let arr = v
                .as_array()
                .ok_or_else(|| invalid("tokenizer.ggml.token_type is not an array".into()))?;
            if arr.len() != tokens.len() {
                return Err(invalid(format!(
                    "tokenizer.ggml.token_type has {} entries for {} tokens",
                    arr.len(),
                    tokens.len()
                )));
            }
            arr.iter().map(|t| t.as_u64().unwrap_or(1)).collect()
        }
    };

    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| ((*t).to_owned(), id as u32))
        .collect();
    if vocab.len() != tokens.len() {
        return Err(invalid(format!(
            "tokenizer.ggml.tokens has duplicate entries ({} unique of {})",
            vocab.len(),
            tokens.len()
        )));
    }
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| {
                    invalid(format!(
                        "tokenizer.ggml.merges[{i}] {m:?} is not \"left right\""
                    ))
                })
        })
        .collect::<Result<Vec<_>>>()?;

    let pre_name = match get("tokenizer.ggml.pre") {
        Some(v) => v
            .as_str()
            .ok_or_else(|| invalid("tokenizer.ggml.pre is not a string".into()))?,
        None => {
            tracing::warn!(path = %file.path().display(), "GGUF has no tokenizer.ggml.pre; using the GPT-2 split");
            "default"
        }
    };
    let (pre_tokenizer, ignore_merges) = pretokenizer::for_gguf_pre(pre_name)?;

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| {
            invalid(format!(
                "cannot build BPE from tokenizer.ggml.tokens/merges: {e}"
            ))
        })?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(pre_tokenizer));
    tk.with_decoder(Some(ByteLevelDecoder::default()));

    let bos_token_id = token_id("tokenizer.ggml.bos_token_id")?;
    let eos_token_id = token_id("tokenizer.ggml.eos_token_id")?;
    for (what, id) in [("bos", bos_token_id), ("eos", eos_token_id)] {
        if id.is_some_and(|id| id as usize >= tokens.len()) {
            return Err(invalid(format!(
                "{what} token id is outside the vocabulary"
            )));
        }
    }
    let token_text = |id: Option<u32>| {
        id.and_then(|id| tokens.get(id as usize))
            .map(|t| (*t).to_owned())
    };

    // Like llama.cpp: control tokens are special (matched in text, dropped by skip_special_tokens);
    // user-defined ones are matched in text but are ordinary text when decoding.
    let added = |wanted: u64, special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(&token_types)
            .filter(|(_, &t)| t == wanted)
            .map(|(text, _)| AddedToken::from(*text, special).normalized(false))
            .collect()
    };
    tk.add_special_tokens(&added(TOKEN_TYPE_CONTROL, true));
    tk.add_tokens(&added(TOKEN_TYPE_USER_DEFINED, false));

    let add_bos = flag("tokenizer.ggml.add_bos_token").unwrap_or(false);
    let add_eos = flag("tokenizer.ggml.add_eos_token").unwrap_or(false);
    let with_text = |what: &str, id: Option<u32>| -> Result<(String, u32)> {
        id.and_then(|id| token_text(Some(id)).map(|t| (t, id)))
            .ok_or_else(|| {
                invalid(format!(
                    "add_{what}_token is set but there is no {what} token id"
                ))
            })
    };
    let mut single: Vec<String> = Vec::new();
    let mut specials: Vec<(String, u32)> = Vec::new();
    if add_bos {
        let (text, id) = with_text("bos", bos_token_id)?;
        single.push(text.clone());
        specials.push((text, id));
    }
    single.push("$A".to_owned());
    if add_eos {
        let (text, id) = with_text("eos", eos_token_id)?;
        single.push(text.clone());
        if !specials.iter().any(|(_, i)| *i == id) {
            specials.push((text, id));
        }
    }
    let processor = TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| {
            b.special_tokens(specials)
                .build()
                .map_err(|e| e.to_string())
        })
        .map_err(|e| invalid(format!("cannot build the BOS/EOS template: {e}")))?;
    tk.with_post_processor(Some(processor));

    let mut eos_token_ids: Vec<u32> = eos_token_id.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        eos_token_ids.extend(token_id(key)?.filter(|&id| (id as usize) < tokens.len()));
    }

    let chat_template = match get("tokenizer.chat_template") {
        None => None,
        Some(v) => {
            let source = v
                .as_str()
                .ok_or_else(|| invalid("tokenizer.chat_template is not a string".into()))?;
            Some(ChatTemplate::new(
                source,
                token_text(bos_token_id).unwrap_or_default(),
                token_text(eos_token_id).unwrap_or_default(),
            )?)
        }
    };

    Ok(Tokenizer::from_parts(TokenizerParts {
        tk,
        bos_token_id,
        eos_token_ids,
        force_bos: false,
        chat_template,
    }))
}
