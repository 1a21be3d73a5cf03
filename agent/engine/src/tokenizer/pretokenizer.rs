//! How text is split into words before BPE, by `tokenizer.ggml.pre` name.
//!
//! GGUF stores only a name; the regexes behind each name are the ones llama.cpp uses for it
//! (`llama-vocab.cpp`) and that the models' own `tokenizer.json` files carry.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{EngineError, Result};

const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer for a GGUF `tokenizer.ggml.pre` value, and whether BPE should take a word
/// that is already a vocabulary entry as-is instead of merging (`ignore_merges`, Llama 3).
pub(super) fn for_gguf_pre(name: &str) -> Result<(PreTokenizerWrapper, bool)> {
    // ByteLevel with its built-in regex is the GPT-2 split:
    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    let gpt2 = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    let split_then_bytes = |regex: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(regex.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| EngineError::Tokenizer(format!("pre-tokenizer regex for {name:?}: {e}")))?;
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ])))
    };
    match name {
        "default" | "gpt2" | "gpt-2" | "olmo" | "mpt" | "jais" | "trillion" => Ok((gpt2(), false)),
        // StarCoder-family vocabularies: every digit is its own word, then the GPT-2 split.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            Ok((
                PreTokenizerWrapper::Sequence(Sequence::new(vec![
                    Digits::new(true).into(),
                    gpt2(),
                ])),
                false,
            ))
        }
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" => {
            Ok((split_then_bytes(LLAMA3_REGEX)?, true))
        }
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => {
            Ok((split_then_bytes(QWEN2_REGEX)?, false))
        }
        other => Err(EngineError::Unsupported(format!(
            "GGUF pre-tokenizer {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn words(name: &str, text: &str) -> Vec<String> {
        let (pt, _) = for_gguf_pre(name).unwrap();
        let mut s = PreTokenizedString::from(text);
        pt.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(w, _, _)| w.to_owned())
            .collect()
    }

    #[test]
    fn splits_like_the_reference_regexes() {
        assert_eq!(words("gpt2", "I'm 2024 go"), ["I", "'m", "Ġ2024", "Ġgo"]);
        assert_eq!(words("smollm", "a 2024"), ["a", "Ġ", "2", "0", "2", "4"]);
        assert_eq!(
            words("llama-bpe", "I'M 12345 go"),
            ["I", "'M", "Ġ", "123", "45", "Ġgo"]
        );
        assert_eq!(words("qwen2", "x 123"), ["x", "Ġ", "1", "2", "3"]);
        assert!(matches!(
            for_gguf_pre("no-such-pre"),
            Err(EngineError::Unsupported(_))
        ));
    }
}
