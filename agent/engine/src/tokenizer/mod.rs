//! Text ⇄ token ids for the models the engine serves.
//!
//! - [`Tokenizer`]: a cheap-to-clone handle over a `tokenizers` pipeline, loaded from a HF
//!   `tokenizer.json` (+ `tokenizer_config.json`) or rebuilt from GGUF metadata.
//! - [`IncrementalDecoder`]: turns a stream of generated ids into text pieces that are always valid
//!   UTF-8, for streaming responses.
//! - [`ChatTemplate`]: renders the model's own Jinja chat template with minijinja.
//! - [`StopMatcher`]: cuts generated text at stop strings, holding back what may still become one.

mod chat_template;
mod gguf;
mod hf;
mod incremental;
mod pretokenizer;
mod stop;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use incremental::IncrementalDecoder;
pub use stop::{StopMatcher, StopOutput};

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use crate::error::{EngineError, Result};

/// A tokenizer plus the model facts that go with it (special ids, chat template).
///
/// Cloning is cheap (one `Arc`), and the handle is `Send + Sync`, so every request handler can own one.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tk: tokenizers::Tokenizer,
    /// Cached: `tokenizers` rebuilds the whole vocabulary map to answer this.
    vocab_size: usize,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    /// Prepended when the tokenizer's own post-processor does not already do it (HF folders whose
    /// `tokenizer_config.json` says `add_bos_token: true` but whose `tokenizer.json` has no template).
    force_bos: bool,
    chat_template: Option<ChatTemplate>,
    special_ids: HashSet<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token_id", &self.inner.bos_token_id)
            .field("eos_token_ids", &self.inner.eos_token_ids)
            .field("has_chat_template", &self.inner.chat_template.is_some())
            .finish()
    }
}

/// What a loader found out besides the `tokenizers` pipeline itself.
pub(crate) struct TokenizerParts {
    pub tk: tokenizers::Tokenizer,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub force_bos: bool,
    pub chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    pub(crate) fn from_parts(parts: TokenizerParts) -> Self {
        let special_ids = parts
            .tk
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, tok)| tok.special)
            .map(|(id, _)| id)
            .collect();
        let mut eos_token_ids = Vec::new();
        for id in parts.eos_token_ids {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        // One past the highest id, so every id below it is valid (also if the ids have gaps).
        let vocab_size = parts
            .tk
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&max| max as usize + 1);
        Tokenizer {
            inner: Arc::new(Inner {
                vocab_size,
                tk: parts.tk,
                bos_token_id: parts.bos_token_id,
                eos_token_ids,
                force_bos: parts.force_bos,
                chat_template: parts.chat_template,
                special_ids,
            }),
        }
    }

    /// Loads a bare `tokenizer.json`. Special ids come from its added tokens; there is no chat template.
    /// Use [`Tokenizer::for_model`] on a HF folder to also read `tokenizer_config.json`.
    pub fn from_tokenizer_json(path: impl AsRef<Path>) -> Result<Self> {
        hf::from_tokenizer_json(path.as_ref())
    }

    /// Builds the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &crate::model::gguf::GgufFile) -> Result<Self> {
        gguf::from_gguf(file)
    }

    /// The tokenizer of a model: a `.gguf` file, or a HF folder (`tokenizer.json` +
    /// `tokenizer_config.json`, and `generation_config.json` for extra end-of-sequence ids).
    pub fn for_model(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            hf::from_hf_folder(path)
        } else if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            let file = crate::model::gguf::GgufFile::open(path)?;
            gguf::from_gguf(&file)
        } else if path.file_name().is_some_and(|n| n == "tokenizer.json") {
            hf::from_tokenizer_json(path)
        } else if !path.exists() {
            Err(EngineError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
            })
        } else {
            Err(EngineError::invalid_model(
                path,
                "expected a .gguf file or a Hugging Face model folder",
            ))
        }
    }

    /// The `tokenizers` pipeline itself (for a decoder's embeddings, which tokenize through it).
    pub fn pipeline(&self) -> &tokenizers::Tokenizer {
        &self.inner.tk
    }

    /// Tokenizes `text` the way the model expects by default: special tokens written in the text
    /// (e.g. `<|im_start|>`) are matched as such, and BOS/EOS are added only if the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.tk.encode_fast(text, true).map_err(tok_err)?;
        let ids = enc.get_ids();
        match self.inner.bos_token_id {
            Some(bos) if self.inner.force_bos && ids.first() != Some(&bos) => {
                let mut out = Vec::with_capacity(ids.len() + 1);
                out.push(bos);
                out.extend_from_slice(ids);
                Ok(out)
            }
            _ => Ok(ids.to_vec()),
        }
    }

    /// Turns ids back into text. Bytes that do not form valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let vocab = self.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        self.inner
            .tk
            .decode(ids, skip_special_tokens)
            .map_err(tok_err)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The text one token stands for on its own (what OpenAI logprobs show), e.g. `" world"` rather
    /// than the byte-level `"Ġworld"`. A token holding part of a multi-byte character shows U+FFFD.
    pub fn token_str(&self, id: u32) -> Option<String> {
        if id as usize >= self.vocab_size() {
            return None;
        }
        self.inner.tk.decode(&[id], false).ok()
    }

    /// The raw vocabulary entry for `id` (e.g. `"Ġworld"`), as `tokenizers` stores it.
    pub fn token_piece(&self, id: u32) -> Option<String> {
        self.inner.tk.id_to_token(id)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tk.token_to_id(token)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_token_id
    }

    /// Every id that ends generation (the EOS token first, then e.g. `<|eot_id|>`), without repeats.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_token_ids
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.inner.chat_template.as_ref()
    }

    /// Tokens added on top of the model's vocabulary: id → (text, whether it is special).
    pub fn added_tokens(&self) -> std::collections::HashMap<u32, (String, bool)> {
        self.inner.tk.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, (t.content, t.special))).collect()
    }

    /// The decoder stage of the pipeline as `tokenizer.json` writes it (`{"type": "ByteLevel", ...}`),
    /// `null` when there is none: it tells how vocabulary pieces encode bytes.
    pub fn decoder_json(&self) -> serde_json::Value {
        self.inner.tk.get_decoder().and_then(|d| serde_json::to_value(d).ok()).unwrap_or_default()
    }

    /// Whether `id` is a special (control) token, i.e. one that `skip_special_tokens` drops.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.special_ids.contains(&id)
    }
}

pub(crate) fn tok_err(e: tokenizers::Error) -> EngineError {
    EngineError::Tokenizer(e.to_string())
}
