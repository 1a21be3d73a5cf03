//! llguidance's token masks, as the sampler applies them, against a brute-force reference: for a
//! regex, a token is allowed exactly when the text so far plus the token's bytes can still be
//! extended to a full match, which a minimized DFA (`regex-automata`, independent of llguidance)
//! answers for every token of the vocabulary. EOS is allowed exactly when the text so far matches.

mod common;

use peregrine_engine::model::gguf::GgufFile;
use peregrine_engine::structured::{token_bytes, GrammarCompiler, GrammarOutcome, GrammarSpec, GrammarState};
use peregrine_engine::tokenizer::Tokenizer;
use regex_automata::dfa::{dense, Automaton};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start::Config as StartConfig;
use regex_automata::Anchored;

fn gguf_tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(common::model_path()).unwrap()).unwrap()
}

/// Both loaders (the bare `tokenizer.json` has no EOS id, so it only serves the byte checks).
fn tokenizers() -> Vec<(&'static str, Tokenizer)> {
    let json = Tokenizer::from_tokenizer_json(common::fixtures_dir().join("smollm2/tokenizer.json")).unwrap();
    vec![("gguf", gguf_tokenizer()), ("tokenizer.json", json)]
}

/// A minimized DFA for `^(?:rx)$`: every state but the dead one can still reach a match.
struct Reference {
    dfa: dense::DFA<Vec<u32>>,
}

impl Reference {
    fn new(rx: &str) -> Self {
        let dfa = dense::Builder::new()
            .configure(dense::Config::new().minimize(true))
            .build(&format!(r"^(?:{rx})\z"))
            .unwrap();
        Reference { dfa }
    }

    fn start(&self) -> StateID {
        self.dfa.start_state(&StartConfig::new().anchored(Anchored::Yes)).unwrap()
    }

    fn walk(&self, mut s: StateID, bytes: &[u8]) -> StateID {
        for &b in bytes {
            s = self.dfa.next_state(s, b);
        }
        s
    }

    fn viable(&self, s: StateID) -> bool {
        !self.dfa.is_dead_state(s)
    }

    fn accepts(&self, s: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(s))
    }

    /// Every id the reference allows after `text`: the ordinary tokens (`words`, their bytes) that
    /// keep a match reachable, and the end ids where `text` matches already. Sorted.
    fn allowed_after(&self, text: &[u8], words: &[Vec<u8>], eos: &[u32]) -> Vec<u32> {
        let at = self.walk(self.start(), text);
        let ordinary = |id: u32| !words[id as usize].is_empty() && words[id as usize].first() != Some(&0xFF);
        let mut want: Vec<u32> =
            (0..words.len() as u32).filter(|&id| ordinary(id) && self.viable(self.walk(at, &words[id as usize]))).collect();
        if self.accepts(at) {
            want.extend(eos);
        }
        want.sort_unstable();
        want.dedup();
        want
    }
}

/// Allowed ids under the sampler's mask: the logits it leaves finite.
fn allowed(state: &mut GrammarState, vocab: usize) -> Vec<u32> {
    let mut logits = vec![0.0f32; vocab];
    state.apply(&mut logits);
    logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, _)| i as u32).collect()
}

#[test]
fn regex_masks_equal_brute_force() {
    let rx = r"-?[0-9]{1,3}(\.[0-9]+)? (apples|pears|plums)";
    for (name, tok) in [("gguf", gguf_tokenizer())] {
        let words = token_bytes(&tok).unwrap();
        let eos = tok.eos_token_ids().to_vec();
        let reference = Reference::new(rx);
        let grammar = GrammarCompiler::new(&tok).unwrap().compile(&GrammarSpec::Regex(rx.into())).unwrap();
        for prefix in ["", "-", "12", "12.", "12.5 ", "12.5 pl", "7 apples"] {
            let mut state = GrammarState::new(&grammar);
            // Walk the prefix token by token, as sampling would.
            for id in tok.encode(prefix).unwrap() {
                let mask = allowed(&mut state, tok.vocab_size());
                assert!(mask.contains(&id), "{name}: prefix {prefix:?}: token {id} of the prefix itself is masked");
                state.commit(id);
            }
            let want = reference.allowed_after(prefix.as_bytes(), &words, &eos);
            let got = allowed(&mut state, tok.vocab_size());
            assert!(!got.is_empty(), "{name}: prefix {prefix:?}: empty mask");
            assert_eq!(got, want, "{name}: prefix {prefix:?}");
        }
    }
}

/// The masks come from the grammar's own pool of threads: with every thread of rayon's global pool
/// taken, many sequences of one grammar (each with its own matcher, its commits and masks all in
/// flight at once) still get masks equal to the brute-force reference at every step.
#[test]
fn concurrent_sequences_on_the_mask_pool_equal_brute_force_while_the_global_pool_is_busy() {
    let rx = r"-?[0-9]{1,3}(\.[0-9]+)? (apples|pears|plums)";
    let texts = ["12.5 pears", "-7 plums", "999 apples", "3.14159 pears", "0 plums", "-42.0 apples"];

    // Take every thread of the global pool until the test is done.
    let (release, blocked) = crossbeam_channel::bounded::<()>(0);
    let (started_tx, started) = crossbeam_channel::unbounded();
    let global = rayon::current_num_threads();
    for _ in 0..global {
        let (blocked, started_tx) = (blocked.clone(), started_tx.clone());
        rayon::spawn(move || {
            started_tx.send(()).unwrap();
            let _ = blocked.recv();
        });
    }
    for _ in 0..global {
        started.recv().unwrap();
    }

    let (done_tx, done) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let tok = gguf_tokenizer();
        let words = token_bytes(&tok).unwrap();
        let eos = tok.eos_token_ids().to_vec();
        let reference = Reference::new(rx);
        let grammar = GrammarCompiler::new(&tok).unwrap().compile(&GrammarSpec::Regex(rx.into())).unwrap();
        // Eight sequences per text, all started (and later committed) before any mask is read.
        let paths: Vec<Vec<u32>> = texts.iter().flat_map(|t| std::iter::repeat_n(tok.encode(t).unwrap(), 8)).collect();
        let mut states: Vec<GrammarState> = paths.iter().map(|_| GrammarState::new(&grammar)).collect();
        let longest = paths.iter().map(Vec::len).max().unwrap();
        let mut checked = 0;
        for step in 0..=longest {
            for (i, (state, path)) in states.iter_mut().zip(&paths).enumerate() {
                if step > path.len() {
                    continue;
                }
                let text: Vec<u8> = path[..step].iter().flat_map(|&id| words[id as usize].clone()).collect();
                assert_eq!(allowed(state, tok.vocab_size()), reference.allowed_after(&text, &words, &eos), "sequence {i}, after {:?}", String::from_utf8_lossy(&text));
                checked += 1;
            }
            for (state, path) in states.iter_mut().zip(&paths) {
                if let Some(&id) = path.get(step) {
                    state.commit(id);
                }
            }
            for (state, path) in states.iter().zip(&paths) {
                // Only the last token can complete the grammar.
                if step + 1 < path.len() {
                    assert_eq!(state.outcome(), GrammarOutcome::Continue);
                }
            }
        }
        done_tx.send(checked).unwrap();
    });
    // A bound only so that masks queued behind the blocked global pool fail the test instead of
    // hanging it: a pass takes about a second.
    let checked = match done.recv_timeout(std::time::Duration::from_secs(300)) {
        Ok(n) => n,
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => panic!("the masks waited for rayon's global pool"),
        Err(e) => panic!("the checking thread failed (its panic is above): {e}"),
    };
    drop(release);
    assert!(checked >= 6 * 8 * 3, "{checked} masks checked");
}

#[test]
fn choice_ends_when_complete() {
    let tok = gguf_tokenizer();
    let grammar = GrammarCompiler::new(&tok).unwrap().compile(&GrammarSpec::Choice(vec!["yes".into(), "nope".into()])).unwrap();
    let mut state = GrammarState::new(&grammar);
    for id in tok.encode("nope").unwrap() {
        assert_eq!(state.outcome(), GrammarOutcome::Continue);
        let mask = allowed(&mut state, tok.vocab_size());
        assert!(mask.contains(&id));
        state.commit(id);
    }
    // "nope" is complete: the sequence stops with no EOS needed, and only the end ids are allowed.
    assert_eq!(state.outcome(), GrammarOutcome::Complete);
    let mut want = tok.eos_token_ids().to_vec();
    want.sort_unstable();
    assert_eq!(allowed(&mut state, tok.vocab_size()), want);
}

/// Token bytes agree with the tokenizer's own decoder wherever one token decodes to whole
/// characters on its own (the rest are parts of multi-byte characters).
#[test]
fn token_bytes_match_the_decoder() {
    for (name, tok) in tokenizers() {
        let words = token_bytes(&tok).unwrap();
        assert_eq!(words.len(), tok.vocab_size());
        let mut checked = 0;
        for (id, bytes) in words.iter().enumerate() {
            let id = id as u32;
            if tok.is_special(id) {
                assert_eq!(bytes.first(), Some(&0xFF), "{name}: special token {id} must carry the marker");
                continue;
            }
            let text = tok.decode(&[id], false).unwrap();
            if !text.contains('\u{FFFD}') {
                assert_eq!(bytes.as_slice(), text.as_bytes(), "{name}: token {id}");
                checked += 1;
            }
        }
        assert!(checked > words.len() / 2, "{name}: only {checked} tokens compared");
    }
}

#[test]
fn bad_constraints_are_errors_naming_the_problem() {
    let tok = gguf_tokenizer();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    let e = compiler.compile(&GrammarSpec::Regex("(unclosed".into())).unwrap_err();
    assert!(!e.0.is_empty());
    let e = compiler.compile(&GrammarSpec::Lark("start: undefined_rule".into())).unwrap_err();
    assert!(e.0.contains("undefined_rule"), "{e}");
    let e = compiler.compile(&GrammarSpec::JsonSchema(serde_json::json!({"type": "no-such-type"}))).unwrap_err();
    assert!(!e.0.is_empty());
    // The same schema twice is compiled once.
    let schema = GrammarSpec::JsonSchema(serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}}));
    compiler.compile(&schema).unwrap();
    compiler.compile(&schema).unwrap();
    assert_eq!(compiler.cached(), 1);
}
