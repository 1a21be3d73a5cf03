//! llguidance's view of our tokenizer: the bytes every token id stands for, and the EOS id.
//!
//! Built from [`Tokenizer`] itself (GGUF and HF alike), not from a `tokenizer.json` file, so every
//! model the engine loads can be constrained. Three kinds of vocabulary entries:
//! - special (control) tokens: `0xFF` + their text, llguidance's marker that keeps them out of
//!   ordinary text (a grammar can only produce them by name);
//! - byte-level BPE pieces (GPT-2, Llama 3, SmolLM, Qwen): each char maps back to one byte through
//!   GPT-2's byte ↔ printable-char table;
//! - SentencePiece pieces (Llama 2, Mistral): `▁` is a space and `<0xAB>` is the byte 0xAB.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// How the tokenizer's pieces encode bytes, read from its decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceEncoding {
    ByteLevel,
    SentencePiece,
}

/// The token environment llguidance compiles grammars against.
pub fn token_env(tokenizer: &Tokenizer) -> Result<TokEnv> {
    let words = token_bytes(tokenizer)?;
    let eos = *tokenizer
        .eos_token_ids()
        .first()
        .ok_or_else(|| EngineError::Unsupported("structured outputs need a model with an end-of-sequence token".into()))?;
    let vocab_size = u32::try_from(words.len()).map_err(|_| EngineError::Unsupported("vocabulary too large".into()))?;
    let mut info = TokRxInfo::new(vocab_size, eos);
    info.tok_bos = tokenizer.bos_token_id();
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(ApproximateTokEnv::new(trie)))
}

/// The bytes of every id below the vocabulary size (empty for ids the vocabulary skips).
pub fn token_bytes(tokenizer: &Tokenizer) -> Result<Vec<Vec<u8>>> {
    let encoding = piece_encoding(tokenizer)?;
    let byte_of_char = gpt2_char_to_byte();
    let added = tokenizer.added_tokens();
    (0..tokenizer.vocab_size() as u32)
        .map(|id| {
            if let Some((content, special)) = added.get(&id) {
                let mut bytes = Vec::with_capacity(content.len() + 1);
                if *special {
                    bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
                }
                bytes.extend_from_slice(content.as_bytes());
                return Ok(bytes);
            }
            let Some(piece) = tokenizer.token_piece(id) else { return Ok(Vec::new()) };
            match encoding {
                PieceEncoding::ByteLevel => piece
                    .chars()
                    .map(|c| byte_of_char.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .ok_or_else(|| EngineError::Tokenizer(format!("token {id} ({piece:?}) is not a byte-level piece"))),
                PieceEncoding::SentencePiece => Ok(sentencepiece_bytes(&piece)),
            }
        })
        .collect()
}

fn piece_encoding(tokenizer: &Tokenizer) -> Result<PieceEncoding> {
    let decoder = tokenizer.decoder_json();
    let kinds: Vec<&str> = match decoder["type"].as_str() {
        Some("Sequence") => decoder["decoders"].as_array().map(|d| d.iter().filter_map(|d| d["type"].as_str()).collect()).unwrap_or_default(),
        Some(t) => vec![t],
        None => Vec::new(),
    };
    if kinds.contains(&"ByteLevel") {
        Ok(PieceEncoding::ByteLevel)
    } else if kinds.iter().any(|k| matches!(*k, "ByteFallback" | "Metaspace" | "Replace")) {
        Ok(PieceEncoding::SentencePiece)
    } else {
        Err(EngineError::Unsupported(format!("structured outputs: unknown tokenizer decoder {kinds:?}")))
    }
}

/// `<0xAB>` is one raw byte; otherwise `▁` stands for a space.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    if let Some(hex) = piece.strip_prefix("<0x").and_then(|r| r.strip_suffix('>')) {
        if hex.len() == 2 {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return vec![b];
            }
        }
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

/// GPT-2's table, inverted: printable bytes stand for themselves, the others (controls, space,
/// 0x7F-0xA0, 0xAD) are shifted to U+0100 onwards in byte order.
fn gpt2_char_to_byte() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = HashMap::with_capacity(256);
    for b in 0..=255u8 {
        if printable(b) {
            map.insert(char::from(b), b);
        } else {
            if let Some(c) = char::from_u32(next) {
                map.insert(c, b);
            }
            next += 1;
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_table_covers_every_byte_once() {
        let map = gpt2_char_to_byte();
        assert_eq!(map.len(), 256);
        let mut bytes: Vec<u8> = map.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
        // 'Ġ' (U+0120) is the space, 'Ċ' (U+010A) the newline: GPT-2's best-known pieces.
        assert_eq!(map[&'\u{120}'], b' ');
        assert_eq!(map[&'\u{10A}'], b'\n');
        assert_eq!(map[&'a'], b'a');
    }

    #[test]
    fn sentencepiece_pieces() {
        assert_eq!(sentencepiece_bytes("\u{2581}hello"), b" hello");
        assert_eq!(sentencepiece_bytes("<0x0A>"), vec![b'\n']);
        assert_eq!(sentencepiece_bytes("<0xZZ>"), b"<0xZZ>");
    }
}
