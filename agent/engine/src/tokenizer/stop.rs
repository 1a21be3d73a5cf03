//! Stop strings: cut generated text where any of them first appears.
//!
//! Text arrives in pieces, and a stop string can straddle two pieces, so any tail of the text that
//! is the beginning of some stop string is held back until the next piece settles it.

/// What [`StopMatcher::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text safe to emit now (on a match: everything before the stop string).
    pub text: String,
    /// A stop string matched; generation should end and no more text follows.
    pub stopped: bool,
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted, because it may be the start of a stop string.
    held: String,
    matched: Option<usize>,
}

impl StopMatcher {
    /// Empty strings are ignored (they would match everywhere).
    pub fn new(stop_strings: Vec<String>) -> Self {
        StopMatcher {
            stops: stop_strings.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            matched: None,
        }
    }

    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.matched.is_some() {
            return StopOutput {
                text: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(text);
        // The earliest occurrence wins; among stops starting at the same place, the longest is
        // reported (either way the emitted text is the same).
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                self.held
                    .find(s.as_str())
                    .map(|at| (at, std::cmp::Reverse(s.len()), i))
            })
            .min();
        if let Some((at, _, i)) = first {
            self.matched = Some(i);
            let text = self.held[..at].to_owned();
            self.held.clear();
            return StopOutput {
                text,
                stopped: true,
            };
        }
        let keep_from = self.partial_match_start();
        let text = self.held[..keep_from].to_owned();
        self.held.drain(..keep_from);
        StopOutput {
            text,
            stopped: false,
        }
    }

    /// The held-back tail (empty after a match, since that tail belonged to the stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Which stop string matched (an index into the list given to `new`, empty strings not counted).
    pub fn matched_stop(&self) -> Option<&str> {
        self.matched
            .and_then(|i| self.stops.get(i))
            .map(String::as_str)
    }

    /// Byte offset of the earliest tail of `held` that is a proper prefix of some stop string
    /// (`held.len()` if none). Only tails shorter than the longest stop string can qualify.
    fn partial_match_start(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let lower = self.held.len().saturating_sub(longest.saturating_sub(1));
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= lower)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops
                    .iter()
                    .any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }
}
