//! Streaming detokenization.
//!
//! Decoding each new id on its own is wrong twice over: a byte-level token may hold only part of a
//! UTF-8 character, and SentencePiece-style decoders treat the first token of a sequence specially
//! (they drop its leading space). So, like vLLM and TGI, we decode a short window of ids that ends
//! at the newest one, decode the same window without the unread ids, and emit the difference, but
//! only once it no longer ends in U+FFFD (a character still being assembled).

use super::Tokenizer;
use crate::error::Result;

pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    ids: Vec<u32>,
    /// Start of the context window: ids before it are never decoded again.
    prefix_offset: usize,
    /// Ids from here on have not been emitted as text yet.
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> Self {
        IncrementalDecoder {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one id and returns the text it completes: empty while a multi-byte character is
    /// unfinished, never broken UTF-8.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let (prefix, full) = self.decode_window()?;
        if full.len() <= prefix.len() || full.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        let new_text = suffix_after(&full, &prefix);
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(new_text)
    }

    /// Emits whatever is still held back (bytes that never formed a character come out as U+FFFD,
    /// as a full `decode` would show them).
    pub fn finish(&mut self) -> String {
        let text = match self.decode_window() {
            Ok((prefix, full)) if full.len() > prefix.len() => suffix_after(&full, &prefix),
            _ => String::new(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        text
    }

    /// Every id pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn decode_window(&self) -> Result<(String, String)> {
        let prefix = self.tokenizer.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        )?;
        let full = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        Ok((prefix, full))
    }
}

/// `full` minus its leading `prefix`. The prefix decodes a window that ended on a complete
/// character, so `full` starts with it; if a decoder ever breaks that, fall back to the longest
/// common prefix (on a char boundary) rather than slicing inside a character.
fn suffix_after(full: &str, prefix: &str) -> String {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest.to_owned();
    }
    let common = full
        .char_indices()
        .zip(prefix.chars())
        .take_while(|((_, a), b)| a == b)
        .last()
        .map(|((i, c), _)| i + c.len_utf8())
        .unwrap_or(0);
    full[common..].to_owned()
}
