//! Grammar compilation against one tokenizer, with a bounded cache: a schema sent again (the common
//! case for an agent's tool or output schema) is compiled once.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use llguidance::{Matcher, ParserFactory};
use parking_lot::Mutex;

use super::spec::GrammarSpec;
use super::token_env::token_env;
use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Compiled grammars kept for reuse (each holds its lexer tables: tens of KB to a few MB).
pub const GRAMMAR_CACHE_CAPACITY: usize = 64;
/// Longest grammar error passed on to the client (llguidance's messages can quote a whole grammar).
const MAX_ERROR_LEN: usize = 400;

/// A grammar ready to constrain a sequence: the matcher in its start state, cloned per request.
#[derive(Clone)]
pub struct CompiledGrammar {
    key: u64,
    matcher: Arc<Matcher>,
    /// Every id that ends generation: llguidance allows its one EOS id where the grammar may end;
    /// the model's other end ids (e.g. `<|im_end|>`) are allowed there too.
    eos_ids: Arc<[u32]>,
}

impl CompiledGrammar {
    /// A matcher for one sequence, with a lexer of its own. A plain `clone` would share the
    /// compiled matcher's lexer behind one mutex, which llguidance holds for a whole mask: every
    /// sequence of the grammar would then compute its masks one at a time, and wait for the others
    /// to commit a token. The deep copy costs the lexer's tables (small next to a mask for the
    /// schemas we serve) and its lazily built states are rebuilt per sequence.
    pub(super) fn start(&self) -> Matcher {
        self.matcher.deep_clone()
    }

    /// The end-of-sequence ids the grammar treats as its end.
    pub fn eos_ids(&self) -> &Arc<[u32]> {
        &self.eos_ids
    }

    /// A grammar from a matcher made by hand (unit tests, on a toy vocabulary).
    #[cfg(test)]
    pub(super) fn from_matcher(matcher: Matcher, eos_ids: &[u32]) -> Self {
        CompiledGrammar { key: 0, matcher: Arc::new(matcher), eos_ids: eos_ids.into() }
    }
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar").field("key", &format_args!("{:016x}", self.key)).finish()
    }
}

/// Two grammars are the same when they were compiled from the same constraint.
impl PartialEq for CompiledGrammar {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

/// Why a constraint cannot be compiled, in words for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

pub struct GrammarCompiler {
    factory: ParserFactory,
    eos_ids: Arc<[u32]>,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    grammars: HashMap<u64, CompiledGrammar>,
    /// Oldest first: the first to go when the cache is full.
    order: VecDeque<u64>,
}

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer` (tens of milliseconds for a 128k vocabulary): do it once
    /// per model, off the engine thread.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self> {
        let env = token_env(tokenizer)?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| crate::EngineError::Unsupported(format!("structured outputs: {e}")))?;
        factory.quiet();
        // Errors name the problem, not the parser's whole state.
        factory.limits_mut().verbose_errors = false;
        Ok(GrammarCompiler { factory, eos_ids: tokenizer.eos_token_ids().into(), cache: Mutex::new(Cache::default()) })
    }

    /// The compiled grammar of `spec`, from the cache when it was compiled before. Takes
    /// milliseconds for a large schema: call it off the engine thread and the async runtime.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        let key = spec.cache_key();
        if let Some(hit) = self.cache.lock().grammars.get(&key) {
            return Ok(hit.clone());
        }
        let grammar = spec.to_grammar();
        // llguidance reports bad grammars as errors; a panic on some input it does not expect
        // must still only fail this request.
        let parser = catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(grammar)))
            .map_err(|_| GrammarError(format!("the {} constraint could not be compiled", spec.kind())))?
            .map_err(|e| GrammarError(short(&e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError(short(&e)));
        }
        let compiled = CompiledGrammar { key, matcher: Arc::new(matcher), eos_ids: self.eos_ids.clone() };
        let mut cache = self.cache.lock();
        if cache.grammars.insert(key, compiled.clone()).is_none() {
            cache.order.push_back(key);
        }
        while cache.order.len() > GRAMMAR_CACHE_CAPACITY {
            if let Some(old) = cache.order.pop_front() {
                cache.grammars.remove(&old);
            }
        }
        Ok(compiled)
    }

    /// Grammars in the cache now.
    pub fn cached(&self) -> usize {
        self.cache.lock().grammars.len()
    }
}

fn short(message: &str) -> String {
    match message.char_indices().nth(MAX_ERROR_LEN) {
        Some((cut, _)) => format!("{}…", &message[..cut]),
        None => message.to_string(),
    }
}
