//! Text → token ids and token type ids for an encoder: single texts (`[CLS] a [SEP]`) and pairs
//! (`[CLS] a [SEP] b [SEP]`, types 0 then 1), with the folder's own post-processor. The padding and
//! truncation a `tokenizer.json` may carry are switched off: batches are ragged, and truncation
//! happens only when the client asks for it (longest-first, to `max_seq_length`).

use std::path::Path;

use tokenizers::{TruncationDirection, TruncationParams, TruncationStrategy};

use crate::tokenizer::tok_err;
use crate::{EngineError, Result};

/// One tokenized input: ids and their token types, the same length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderInput {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
}

impl EncoderInput {
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

#[derive(Clone)]
pub struct EncoderTokenizer {
    plain: tokenizers::Tokenizer,
    truncating: tokenizers::Tokenizer,
    max_seq_length: usize,
}

impl std::fmt::Debug for EncoderTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncoderTokenizer").field("max_seq_length", &self.max_seq_length).finish()
    }
}

impl EncoderTokenizer {
    pub fn load(dir: &Path, max_seq_length: usize) -> Result<EncoderTokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(EngineError::invalid_model(&path, "tokenizer.json is missing"));
        }
        let plain = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| EngineError::invalid_model(&path, format!("cannot load: {e}")))?;
        Self::from_tokenizer(plain, max_seq_length)
    }

    /// An already loaded `tokenizers` pipeline (a decoder's, for its embeddings), used as it is
    /// (its post-processor's special tokens), with padding and truncation off.
    pub fn from_tokenizer(mut plain: tokenizers::Tokenizer, max_seq_length: usize) -> Result<EncoderTokenizer> {
        plain.with_padding(None);
        plain.with_truncation(None).map_err(tok_err)?;
        let mut tokenizer = EncoderTokenizer { truncating: plain.clone(), plain, max_seq_length };
        tokenizer.set_max_seq_length(max_seq_length)?;
        Ok(tokenizer)
    }

    pub fn max_seq_length(&self) -> usize {
        self.max_seq_length
    }

    /// Changes the limit (refusal and truncation length); the caller checks it against the model.
    pub fn set_max_seq_length(&mut self, max_seq_length: usize) -> Result<()> {
        self.truncating
            .with_truncation(Some(TruncationParams {
                max_length: max_seq_length,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(tok_err)?;
        self.max_seq_length = max_seq_length;
        Ok(())
    }

    pub fn vocab_size(&self) -> usize {
        self.plain.get_vocab_size(true)
    }

    /// One text. Above `max_seq_length` tokens: truncated when `truncate`, else an error that says so.
    pub fn encode(&self, text: &str, truncate: bool) -> Result<EncoderInput> {
        self.run(tokenizers::EncodeInput::Single(text.into()), truncate)
    }

    /// A (query, document) pair for a cross-encoder.
    pub fn encode_pair(&self, first: &str, second: &str, truncate: bool) -> Result<EncoderInput> {
        self.run(tokenizers::EncodeInput::Dual(first.into(), second.into()), truncate)
    }

    /// Token ids a client sent: checked against the vocabulary and the length limit (truncated to
    /// `max_seq_length` when asked); no special tokens are added, as OpenAI's API treats them.
    pub fn check_ids(&self, ids: &[u32], truncate: bool) -> Result<EncoderInput> {
        let vocab = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!("token id {bad} is outside the vocabulary (size {vocab})")));
        }
        let ids = self.limit(ids.to_vec(), truncate)?;
        Ok(EncoderInput { type_ids: vec![0; ids.len()], ids })
    }

    fn run(&self, input: tokenizers::EncodeInput<'_>, truncate: bool) -> Result<EncoderInput> {
        let tok = if truncate { &self.truncating } else { &self.plain };
        let enc = tok.encode(input, true).map_err(tok_err)?;
        let ids = self.limit(enc.get_ids().to_vec(), false)?;
        Ok(EncoderInput { type_ids: enc.get_type_ids().to_vec(), ids })
    }

    fn limit(&self, mut ids: Vec<u32>, truncate: bool) -> Result<Vec<u32>> {
        if ids.len() > self.max_seq_length {
            if !truncate {
                return Err(EngineError::InvalidRequest(format!(
                    "input has {} tokens, more than this model's max_seq_length {}; shorten it or ask for truncation",
                    ids.len(),
                    self.max_seq_length
                )));
            }
            ids.truncate(self.max_seq_length);
        }
        Ok(ids)
    }
}
