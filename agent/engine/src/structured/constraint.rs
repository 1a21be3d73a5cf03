//! One sequence's grammar state during decoding.
//!
//! The mask for the next token is computed on the mask pool ([`super::mask_pool`]) as soon as the
//! previous token is committed (queued by the commit, started with the step's other masks by
//! [`super::start_queued_masks`]), so it runs while the engine thread emits events, schedules and runs
//! the next forward pass; sampling then only waits for what is left of it. Each sequence has its
//! own task and its own matcher (lexer included: see [`CompiledGrammar::start`]): none waits for
//! another's mask. The task also packs the mask into the 32-bit words the device applies, so the
//! engine thread only copies it. Tokens are committed on the engine thread (see
//! [`GrammarState::commit`]).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver};
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

use super::compiler::CompiledGrammar;
use super::mask_pool;

/// Where a constrained sequence stands after its latest token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarOutcome {
    /// More tokens may follow.
    Continue,
    /// The grammar is complete (it allows nothing but the end): the sequence stops. llguidance
    /// reports this as soon as the last token of the grammar is committed, with no EOS needed.
    Complete,
    /// The grammar could not go on (a parser limit, a token it did not allow): the request fails.
    Failed(String),
}

/// What a mask task hands back: the matcher, and its next mask packed into words (or why none).
struct Computed {
    matcher: Box<Matcher>,
    words: Result<Vec<u32>, String>,
}

/// Where a mask task gets its matcher.
enum MatcherSource {
    /// The sequence's own, after its latest token.
    Owned(Box<Matcher>),
    /// A new sequence: its matcher is made from the grammar on the mask thread (a deep copy of the
    /// lexer, kept off the engine thread).
    Fresh(CompiledGrammar),
}

enum State {
    Ready(Box<Matcher>),
    Computing(Receiver<Computed>),
    Done,
    Failed(String),
}

const TASK_STOPPED: &str = "the grammar mask task stopped";

pub struct GrammarState {
    state: State,
    eos_ids: Arc<[u32]>,
}

impl std::fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Ready(..) => "ready",
            State::Computing(_) => "computing",
            State::Done => "done",
            State::Failed(_) => "failed",
        };
        f.debug_struct("GrammarState").field("state", &state).finish()
    }
}

impl GrammarState {
    /// A fresh matcher for one sequence; it is made, and its first mask computed, on the mask pool
    /// (queued: the engine starts it before its next step, during prefill).
    pub fn new(grammar: &CompiledGrammar) -> Self {
        let eos_ids = grammar.eos_ids().clone();
        let state = State::Computing(spawn_mask(MatcherSource::Fresh(grammar.clone()), eos_ids.clone()));
        GrammarState { state, eos_ids }
    }

    /// Sets every logit the grammar does not allow to -inf. Waits for this sequence's mask if it is
    /// still being computed.
    pub fn apply(&mut self, logits: &mut [f32]) {
        let mut words = vec![0u32; logits.len().div_ceil(32)];
        if !self.write_mask(&mut words) {
            return;
        }
        for (id, l) in logits.iter_mut().enumerate() {
            if (words[id / 32] >> (id % 32)) & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Writes the allowed-token bitmask for the next token into `words` (bit `t % 32` of word
    /// `t / 32` set where token `t` is allowed; ids past the grammar's vocabulary are not), the form
    /// the GPU applies (token_mask.cu). Waits for this sequence's mask if it is still being computed.
    /// False where no mask applies (the grammar failed: the request ends after this token), `words`
    /// then untouched.
    pub fn write_mask(&mut self, words: &mut [u32]) -> bool {
        let computed = match std::mem::replace(&mut self.state, State::Done) {
            // Asked twice for one state: computed here (llguidance answers it from its cache).
            State::Ready(mut matcher) => {
                let words = compute_packed(&mut matcher, &self.eos_ids);
                Computed { matcher, words }
            }
            State::Computing(rx) => {
                // This sequence's task may still be queued (nothing started the queue since).
                mask_pool::start_queued();
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => {
                        self.state = State::Failed(TASK_STOPPED.into());
                        return false;
                    }
                }
            }
            State::Done => {
                // Complete: only the end may follow (the worker ends the sequence before sampling
                // again; this keeps the mask right for any caller that samples once more).
                words.fill(0);
                self.allow_eos(words);
                return true;
            }
            State::Failed(e) => {
                self.state = State::Failed(e);
                return false;
            }
        };
        match computed.words {
            Ok(packed) => {
                let n = packed.len().min(words.len());
                words[..n].copy_from_slice(&packed[..n]);
                words[n..].fill(0);
                self.state = State::Ready(computed.matcher);
                true
            }
            Err(e) => {
                self.state = State::Failed(format!("grammar: {e}"));
                false
            }
        }
    }

    fn allow_eos(&self, words: &mut [u32]) {
        for &e in self.eos_ids.iter() {
            if let Some(w) = words.get_mut(e as usize / 32) {
                *w |= 1 << (e % 32);
            }
        }
    }

    /// Advances the grammar by the sampled token, then starts its next mask on the mask pool.
    /// The token is consumed here, on the caller's thread (microseconds): the engine must know at
    /// once whether it completed or broke the grammar, and a commit queued on the pool would wait
    /// behind other sequences' masks.
    pub fn commit(&mut self, token: u32) {
        let State::Ready(matcher) = &mut self.state else { return };
        // Any of the model's end ids ends the text the grammar sees.
        let token = if self.eos_ids.contains(&token) { self.eos_ids[0] } else { token };
        if let Err(e) = matcher.consume_token(token) {
            self.state = State::Failed(format!("grammar: {e}"));
            return;
        }
        if matcher.is_stopped() {
            self.state = State::Done;
            return;
        }
        let State::Ready(matcher) = std::mem::replace(&mut self.state, State::Done) else { return };
        self.state = State::Computing(spawn_mask(MatcherSource::Owned(matcher), self.eos_ids.clone()));
    }

    /// Where the grammar stands after the latest committed token.
    pub fn outcome(&self) -> GrammarOutcome {
        match &self.state {
            State::Ready(_) | State::Computing(_) => GrammarOutcome::Continue,
            State::Done => GrammarOutcome::Complete,
            State::Failed(e) => GrammarOutcome::Failed(e.clone()),
        }
    }
}

/// Queues the next mask for the mask pool (see [`mask_pool::queue`]); it comes on the returned
/// channel.
fn spawn_mask(source: MatcherSource, eos_ids: Arc<[u32]>) -> Receiver<Computed> {
    let (tx, rx) = bounded(1);
    mask_pool::queue(move || {
        let t0 = Instant::now();
        let mut matcher = match source {
            MatcherSource::Owned(m) => m,
            MatcherSource::Fresh(grammar) => Box::new(grammar.start()),
        };
        // A panic inside llguidance must fail this request only (a panicking pool task would
        // abort the process); the matcher is not used again after an error.
        let words = catch_unwind(AssertUnwindSafe(|| compute_packed(&mut matcher, &eos_ids)))
            .unwrap_or_else(|_| Err("the mask computation failed".into()));
        record_task_time(t0.elapsed());
        // The sequence may be gone (aborted) by now: nobody to tell.
        let _ = tx.send(Computed { matcher, words });
    });
    rx
}

/// Mask tasks run so far and their total time (on the mask threads): for
/// `bench --json-schema`, whose per-mask cost on one core predicts the time on more cores.
static TASKS: AtomicU64 = AtomicU64::new(0);
static TASK_NANOS: AtomicU64 = AtomicU64::new(0);

fn record_task_time(d: Duration) {
    TASKS.fetch_add(1, Ordering::Relaxed);
    TASK_NANOS.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// (mask tasks completed, their summed time) since the process started.
pub fn mask_task_totals() -> (u64, Duration) {
    (TASKS.load(Ordering::Relaxed), Duration::from_nanos(TASK_NANOS.load(Ordering::Relaxed)))
}

/// The matcher's next mask, packed (see [`pack_mask`]).
fn compute_packed(matcher: &mut Matcher, eos_ids: &[u32]) -> Result<Vec<u32>, String> {
    matcher.compute_mask().map(|mask| pack_mask(mask, eos_ids)).map_err(|e| e.to_string())
}

/// llguidance's mask as words of 32 token bits (its own storage, taken over: no copy): bits past
/// the grammar's vocabulary cleared, and every one of the model's end ids allowed where the grammar
/// allows its one end id.
fn pack_mask(mask: SimpleVob, eos_ids: &[u32]) -> Vec<u32> {
    let bits = mask.len();
    // The grammar sees one end id; the model may have several: all of them end it.
    let ends = eos_ids.first().is_some_and(|&e| (e as usize) < bits && mask.is_allowed(e));
    let grammar_words = bits.div_ceil(32);
    let eos_words = eos_ids.iter().map(|&e| e as usize / 32 + 1).max().unwrap_or(0);
    let mut words = Vec::<u32>::from(mask);
    words.truncate(grammar_words);
    words.resize(grammar_words.max(eos_words), 0);
    if !bits.is_multiple_of(32) {
        if let Some(last) = words.get_mut(bits / 32) {
            *last &= (1u32 << (bits % 32)) - 1;
        }
    }
    if ends {
        for &e in eos_ids {
            if let Some(w) = words.get_mut(e as usize / 32) {
                *w |= 1 << (e % 32);
            }
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;
    use llguidance::api::TopLevelGrammar;
    use llguidance::toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};
    use llguidance::ParserFactory;

    /// Ids: 0 "a", 1 "b", 2 "ab", 3 "1", 4 the end (a special token).
    const END: u32 = 4;

    fn toy_grammar(rx: &str) -> CompiledGrammar {
        let words: Vec<Vec<u8>> = vec![b"a".to_vec(), b"b".to_vec(), b"ab".to_vec(), b"1".to_vec(), vec![TokTrie::SPECIAL_TOKEN_MARKER, b'e']];
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, END), &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        let matcher = Matcher::new(factory.create_parser(TopLevelGrammar::from_regex(rx)));
        assert!(!matcher.is_error(), "{:?}", matcher.get_error());
        CompiledGrammar::from_matcher(matcher, &[END])
    }

    /// A sequence whose first mask is ready without the mask pool.
    fn ready(grammar: &CompiledGrammar) -> GrammarState {
        GrammarState { state: State::Ready(Box::new(grammar.start())), eos_ids: grammar.eos_ids().clone() }
    }

    fn mask(state: &mut GrammarState) -> u32 {
        let mut words = [0u32; 1];
        assert!(state.write_mask(&mut words));
        words[0]
    }

    /// Commits and their outcomes never wait for the mask pool (the engine reads every outcome
    /// before the next step: one queued behind other sequences' masks would undo the overlap).
    #[test]
    fn commits_and_outcomes_do_not_wait_for_the_mask_pool() {
        // Every mask thread taken until the checks are done.
        let (release, blocked) = bounded::<()>(0);
        let (started_tx, started) = crossbeam_channel::unbounded();
        let threads = mask_pool::mask_threads();
        for _ in 0..threads {
            let (blocked, started_tx) = (blocked.clone(), started_tx.clone());
            mask_pool::spawn(move || {
                let _ = started_tx.send(());
                let _ = blocked.recv();
            });
        }
        for _ in 0..threads {
            started.recv().unwrap();
        }
        let (done_tx, done) = bounded(1);
        std::thread::spawn(move || {
            let grammar = toy_grammar("(ab)+1");
            let mut s = ready(&grammar);
            assert_eq!(mask(&mut s), 0b101, "a or ab first");
            s.commit(2);
            assert_eq!(s.outcome(), GrammarOutcome::Continue);
            let mut done_now = ready(&toy_grammar("ab"));
            mask(&mut done_now);
            done_now.commit(2);
            assert_eq!(done_now.outcome(), GrammarOutcome::Complete);
            assert_eq!(mask(&mut done_now), 1 << END, "only the end after completion");
            let mut refused = ready(&grammar);
            mask(&mut refused);
            refused.commit(3);
            assert!(matches!(refused.outcome(), GrammarOutcome::Failed(_)));
            done_tx.send(s).unwrap();
        });
        let mut s = match done.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(s) => s,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => panic!("a commit or an outcome waited for the mask pool"),
            Err(e) => panic!("the checking thread failed (its panic is above): {e}"),
        };
        drop(release);
        // The queued mask arrives once the pool is free: after "ab", "a", "ab" or "1".
        assert_eq!(mask(&mut s), 0b1101);
    }

    fn vob(size: usize, allowed: &[u32]) -> SimpleVob {
        let mut v = SimpleVob::alloc(size);
        for &t in allowed {
            v.allow_token(t);
        }
        v
    }

    #[test]
    fn packed_masks_keep_the_vocabulary_and_allow_every_end_id_with_the_grammars() {
        // 70 tokens: three words, the last one holding 6 tokens.
        assert_eq!(pack_mask(vob(70, &[0, 33, 69]), &[5, 64]), vec![1, 2, 1 << 5]);
        // The grammar's end id (5) allowed: every end id is.
        assert_eq!(pack_mask(vob(70, &[5, 33]), &[5, 64]), vec![1 << 5, 2, 1]);
        // An end id past the grammar's vocabulary still gets its word.
        assert_eq!(pack_mask(vob(40, &[5]), &[5, 100]), vec![1 << 5, 0, 0, 1 << 4]);
        // Bits set past the vocabulary (llguidance's words are whole) are cleared.
        let mut narrow = SimpleVob::alloc_with_capacity(41, 64);
        for t in [39, 40, 63] {
            narrow.allow_token(t);
        }
        assert_eq!(pack_mask(narrow, &[5]), vec![0, (1 << 7) | (1 << 8)]);
    }
}
