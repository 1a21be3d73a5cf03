//! Rebuilding a `tokenizers` pipeline from GGUF `tokenizer.ggml.*` metadata.
//!
//! `from_gguf` reads the metadata through `Meta` (typed getters whose errors name the key) and
//! assembles the pipeline in the order `tokenizers` needs it: vocabulary and merges → BPE model and
//! pre-tokenizer → added tokens → BOS/EOS post-processor; then the EOS ids and the chat template.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

use super::{pretokenizer, ChatTemplate, Tokenizer, TokenizerParts};
use crate::error::{EngineError, Result};
use crate::model::gguf::{GgufFile, GgufValue};

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_NORMAL: u64 = 1;
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

pub(super) fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
    let meta = Meta { file };
    check_tokenizer_model(&meta)?;
    let vocab = VocabMeta::read(&meta)?;
    let mut tk = byte_level_bpe(&meta, &vocab)?;

    // Like llama.cpp: control tokens are special (matched in text, dropped by skip_special_tokens);
    // user-defined ones are matched in text but are ordinary text when decoding.
    tk.add_special_tokens(&vocab.added_tokens(TOKEN_TYPE_CONTROL, true));
    tk.add_tokens(&vocab.added_tokens(TOKEN_TYPE_USER_DEFINED, false));

    let bos_token_id = vocab.checked_id(&meta, "bos", "tokenizer.ggml.bos_token_id")?;
    let eos_token_id = vocab.checked_id(&meta, "eos", "tokenizer.ggml.eos_token_id")?;
    tk.with_post_processor(Some(bos_eos_processor(&meta, &vocab, bos_token_id, eos_token_id)?));

    let mut eos_token_ids: Vec<u32> = eos_token_id.into_iter().collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        eos_token_ids.extend(meta.token_id(key)?.filter(|&id| vocab.contains(id)));
    }
    let chat_template = chat_template(&meta, &vocab, bos_token_id, eos_token_id)?;

    Ok(Tokenizer::from_parts(TokenizerParts {
        tk,
        bos_token_id,
        eos_token_ids,
        force_bos: false,
        chat_template,
    }))
}

/// Typed access to the file's metadata; every error names the key and the model file.
struct Meta<'a> {
    file: &'a GgufFile,
}

impl<'a> Meta<'a> {
    fn invalid(&self, message: String) -> EngineError {
        EngineError::invalid_model(self.file.path(), message)
    }

    fn get(&self, key: &str) -> Option<&'a GgufValue> {
        self.file.get(key)
    }

    fn string_array(&self, key: &str) -> Result<Vec<&'a str>> {
        let arr = self
            .get(key)
            .and_then(GgufValue::as_array)
            .ok_or_else(|| self.invalid(format!("missing array {key}")))?;
        arr.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .ok_or_else(|| self.invalid(format!("{key}[{i}] is not a string")))
            })
            .collect()
    }

    fn optional_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.invalid(format!("{key} is not a string"))),
        }
    }

    fn token_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.invalid(format!("{key} is not a token id"))),
        }
    }

    fn flag(&self, key: &str) -> bool {
        self.get(key).and_then(GgufValue::as_bool).unwrap_or(false)
    }
}

/// Only byte-level BPE (llama.cpp's "gpt2" tokenizer model) is rebuilt from GGUF.
fn check_tokenizer_model(meta: &Meta) -> Result<()> {
    let model = meta
        .get("tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .ok_or_else(|| meta.invalid("missing tokenizer.ggml.model".into()))?;
    if model != "gpt2" {
        return Err(EngineError::Unsupported(format!(
            "GGUF tokenizer model {model:?} (only byte-level BPE, \"gpt2\", is supported; use the HF folder's tokenizer.json)"
        )));
    }
    Ok(())
}

/// The token strings with their llama.cpp token types, one per id.
struct VocabMeta<'a> {
    tokens: Vec<&'a str>,
    token_types: Vec<u64>,
}

impl<'a> VocabMeta<'a> {
    fn read(meta: &Meta<'a>) -> Result<Self> {
        let tokens = meta.string_array("tokenizer.ggml.tokens")?;
        let token_types = match meta.get("tokenizer.ggml.token_type") {
            None => vec![TOKEN_TYPE_NORMAL; tokens.len()],
            Some(v) => {
                let arr = v.as_array().ok_or_else(|| {
                    meta.invalid("tokenizer.ggml.token_type is not an array".into())
                })?;
                if arr.len() != tokens.len() {
                    return Err(meta.invalid(format!(
                        "tokenizer.ggml.token_type has {} entries for {} tokens",
                        arr.len(),
                        tokens.len()
                    )));
                }
                arr.iter()
                    .map(|t| t.as_u64().unwrap_or(TOKEN_TYPE_NORMAL))
                    .collect()
            }
        };
        Ok(Self { tokens, token_types })
    }

    fn contains(&self, id: u32) -> bool {
        (id as usize) < self.tokens.len()
    }

    fn text(&self, id: Option<u32>) -> Option<String> {
        id.and_then(|id| self.tokens.get(id as usize))
            .map(|t| (*t).to_owned())
    }

    /// A special token id from `key`, refused when it lies outside the vocabulary.
    fn checked_id(&self, meta: &Meta, what: &str, key: &str) -> Result<Option<u32>> {
        let id = meta.token_id(key)?;
        if id.is_some_and(|id| !self.contains(id)) {
            return Err(meta.invalid(format!("{what} token id is outside the vocabulary")));
        }
        Ok(id)
    }

    fn added_tokens(&self, token_type: u64, special: bool) -> Vec<AddedToken> {
        self.tokens
            .iter()
            .zip(&self.token_types)
            .filter(|(_, &t)| t == token_type)
            .map(|(text, _)| AddedToken::from(*text, special).normalized(false))
            .collect()
    }
}

/// The BPE model from the vocabulary and merges, with the pre-tokenizer `tokenizer.ggml.pre` names
/// (chosen as llama.cpp chooses it) and the byte-level decoder.
fn byte_level_bpe(meta: &Meta, vocab_meta: &VocabMeta) -> Result<tokenizers::Tokenizer> {
    let tokens = &vocab_meta.tokens;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| ((*t).to_owned(), id as u32))
        .collect();
    if vocab.len() != tokens.len() {
        return Err(meta.invalid(format!(
            "tokenizer.ggml.tokens has duplicate entries ({} unique of {})",
            vocab.len(),
            tokens.len()
        )));
    }
    let merges = meta
        .string_array("tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| {
                    meta.invalid(format!(
                        "tokenizer.ggml.merges[{i}] {m:?} is not \"left right\""
                    ))
                })
        })
        .collect::<Result<Vec<_>>>()?;

    let pre_name = match meta.optional_str("tokenizer.ggml.pre")? {
        Some(name) => name,
        None => {
            tracing::warn!(path = %meta.file.path().display(), "GGUF has no tokenizer.ggml.pre; using the GPT-2 split");
            "default"
        }
    };
    let (pre_tokenizer, ignore_merges) = pretokenizer::for_gguf_pre(pre_name)?;

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| {
            meta.invalid(format!(
                "cannot build BPE from tokenizer.ggml.tokens/merges: {e}"
            ))
        })?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(pre_tokenizer));
    tk.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tk)
}

/// The template that adds BOS and/or EOS around every encoded text, as `add_bos_token` /
/// `add_eos_token` ask.
fn bos_eos_processor(
    meta: &Meta,
    vocab: &VocabMeta,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
) -> Result<TemplateProcessing> {
    let with_text = |what: &str, id: Option<u32>| -> Result<(String, u32)> {
        id.and_then(|id| vocab.text(Some(id)).map(|t| (t, id)))
            .ok_or_else(|| {
                meta.invalid(format!(
                    "add_{what}_token is set but there is no {what} token id"
                ))
            })
    };
    let mut single: Vec<String> = Vec::new();
    let mut specials: Vec<(String, u32)> = Vec::new();
    if meta.flag("tokenizer.ggml.add_bos_token") {
        let (text, id) = with_text("bos", bos_token_id)?;
        single.push(text.clone());
        specials.push((text, id));
    }
    single.push("$A".to_owned());
    if meta.flag("tokenizer.ggml.add_eos_token") {
        let (text, id) = with_text("eos", eos_token_id)?;
        single.push(text.clone());
        if !specials.iter().any(|(_, i)| *i == id) {
            specials.push((text, id));
        }
    }
    TemplateProcessing::builder()
        .try_single(single)
        .and_then(|b| {
            b.special_tokens(specials)
                .build()
                .map_err(|e| e.to_string())
        })
        .map_err(|e| meta.invalid(format!("cannot build the BOS/EOS template: {e}")))
}

/// The model's own chat template (`tokenizer.chat_template`), if it ships one.
fn chat_template(
    meta: &Meta,
    vocab: &VocabMeta,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
) -> Result<Option<ChatTemplate>> {
    let Some(source) = meta.optional_str("tokenizer.chat_template")? else {
        return Ok(None);
    };
    Ok(Some(ChatTemplate::new(
        source,
        vocab.text(bos_token_id).unwrap_or_default(),
        vocab.text(eos_token_id).unwrap_or_default(),
    )?))
}
