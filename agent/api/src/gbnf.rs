//! GBNF (llama.cpp's grammar format) → the Lark dialect llguidance reads, for the subset
//! llama.cpp documents: `name ::= ...` rules (`root` is the start), alternation, groups,
//! `* + ?`, `{m}` `{m,}` `{m,n}`, string literals, character classes (`[a-z]`, `[^"\\]`), `.`,
//! `#` comments. llguidance ships a GBNF converter only as a Python script, so this is ours.
//!
//! Rules become lowercase Lark rules named by their index (`r0_json_value`), since GBNF names may
//! hold capitals (Lark terminals) and either case of the same word; literals become JSON-escaped
//! strings and classes regexes whose every character is written `\x{...}`, so no text of the
//! grammar is ever interpreted twice.

use std::collections::HashMap;
use std::fmt::Write;

/// Most nesting of groups (bounds the recursion on hostile input).
const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Defines,
    Literal(String),
    /// (negated, inclusive ranges)
    Class(bool, Vec<(char, char)>),
    Any,
    Open,
    Close,
    Bar,
    Star,
    Plus,
    Question,
    /// `{m}`, `{m,}`, `{m,n}`.
    Repeat(u32, Option<u32>),
    Newline,
}

/// Converts a GBNF grammar to llguidance Lark; the error says what and where (1-based line).
pub fn gbnf_to_lark(src: &str) -> Result<String, String> {
    let toks = tokenize(src)?;
    // A rule starts at `NAME ::=`; its body runs to the next rule's start.
    let starts: Vec<usize> = (0..toks.len())
        .filter(|&i| matches!(toks[i].0, Tok::Name(_)) && matches!(toks.get(i + 1), Some((Tok::Defines, _))))
        .collect();
    if starts.is_empty() {
        return Err("no rule (`name ::= ...`) found".into());
    }
    if let Some((t, line)) = toks[..starts[0]].iter().find(|(t, _)| *t != Tok::Newline) {
        return Err(format!("line {line}: unexpected {t:?} before the first rule"));
    }
    let mut names: HashMap<String, String> = HashMap::new();
    for (i, &s) in starts.iter().enumerate() {
        let Tok::Name(name) = &toks[s].0 else { continue };
        let safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
        if names.insert(name.clone(), format!("r{i}_{safe}")).is_some() {
            return Err(format!("line {}: rule `{name}` is defined twice", toks[s].1));
        }
    }
    let root = names.get("root").ok_or("the grammar has no `root` rule")?;
    let mut out = format!("start: {root}\n");
    for (i, &s) in starts.iter().enumerate() {
        let Tok::Name(name) = &toks[s].0 else { continue };
        let end = starts.get(i + 1).copied().unwrap_or(toks.len());
        let body: Vec<&(Tok, usize)> = toks[s + 2..end].iter().filter(|(t, _)| *t != Tok::Newline).collect();
        let mut p = Parser { toks: &body, pos: 0, names: &names, line: toks[s].1 };
        let expr = p.alternatives(0)?;
        if let Some((t, line)) = body.get(p.pos) {
            return Err(format!("line {line}: unexpected {t:?}"));
        }
        let _ = writeln!(out, "{}: {expr}", names.get(name).map_or("", String::as_str));
    }
    Ok(out)
}

struct Parser<'a> {
    toks: &'a [&'a (Tok, usize)],
    pos: usize,
    names: &'a HashMap<String, String>,
    line: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|(t, _)| t)
    }

    fn err(&self, what: &str) -> String {
        let line = self.toks.get(self.pos).map_or(self.line, |(_, l)| *l);
        format!("line {line}: {what}")
    }

    fn alternatives(&mut self, depth: usize) -> Result<String, String> {
        if depth > MAX_DEPTH {
            return Err(self.err("groups nest too deeply"));
        }
        let mut alts = vec![self.sequence(depth)?];
        while self.peek() == Some(&Tok::Bar) {
            self.pos += 1;
            alts.push(self.sequence(depth)?);
        }
        // An empty alternative (`ws ::= | " "`) makes the rest optional.
        let optional = alts.iter().any(Option::is_none);
        let alts: Vec<String> = alts.into_iter().flatten().collect();
        match (alts.is_empty(), optional) {
            (true, _) => Err(self.err("a rule or group that matches only the empty string")),
            (false, true) => Ok(format!("({})?", alts.join(" | "))),
            (false, false) => Ok(alts.join(" | ")),
        }
    }

    /// None: the empty sequence.
    fn sequence(&mut self, depth: usize) -> Result<Option<String>, String> {
        let mut items = Vec::new();
        while let Some(t) = self.peek() {
            let atom = match t {
                Tok::Bar | Tok::Close => break,
                Tok::Name(n) => {
                    let lark = self.names.get(n).ok_or_else(|| self.err(&format!("rule `{n}` is not defined")))?;
                    lark.clone()
                }
                Tok::Literal(s) => serde_json::to_string(s).map_err(|e| self.err(&e.to_string()))?,
                Tok::Class(negated, ranges) => class_regex(*negated, ranges),
                Tok::Any => "/(?s:.)/".to_string(),
                Tok::Open => {
                    self.pos += 1;
                    let inner = self.alternatives(depth + 1)?;
                    if self.peek() != Some(&Tok::Close) {
                        return Err(self.err("`(` is not closed"));
                    }
                    format!("({inner})")
                }
                other => return Err(self.err(&format!("unexpected {other:?}"))),
            };
            self.pos += 1;
            let mut item = atom;
            loop {
                let suffix = match self.peek() {
                    Some(Tok::Star) => "*".to_string(),
                    Some(Tok::Plus) => "+".to_string(),
                    Some(Tok::Question) => "?".to_string(),
                    Some(Tok::Repeat(m, Some(n))) if m == n => format!("{{{m}}}"),
                    Some(Tok::Repeat(m, Some(n))) => format!("{{{m},{n}}}"),
                    Some(Tok::Repeat(m, None)) => format!("{{{m},}}"),
                    _ => break,
                };
                self.pos += 1;
                // Lark allows one operator per atom: group before another.
                item = if item.ends_with(['*', '+', '?', '}']) { format!("({item}){suffix}") } else { format!("{item}{suffix}") };
            }
            items.push(item);
        }
        Ok((!items.is_empty()).then(|| items.join(" ")))
    }
}

/// A class as a regex, every character as `\x{..}` (nothing in it is read as regex syntax).
fn class_regex(negated: bool, ranges: &[(char, char)]) -> String {
    let mut s = String::from(if negated { "/[^" } else { "/[" });
    for &(a, b) in ranges {
        let _ = write!(s, "\\x{{{:x}}}", a as u32);
        if b != a {
            let _ = write!(s, "-\\x{{{:x}}}", b as u32);
        }
    }
    s.push_str("]/");
    s
}

fn tokenize(src: &str) -> Result<Vec<(Tok, usize)>, String> {
    let chars: Vec<char> = src.chars().collect();
    let mut toks = Vec::new();
    let (mut i, mut line) = (0usize, 1usize);
    while i < chars.len() {
        let c = chars[i];
        let err = |what: &str| format!("line {line}: {what}");
        match c {
            '\n' => {
                toks.push((Tok::Newline, line));
                line += 1;
                i += 1;
            }
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ':' if chars.get(i + 1) == Some(&':') && chars.get(i + 2) == Some(&'=') => {
                toks.push((Tok::Defines, line));
                i += 3;
            }
            '"' => {
                let mut s = String::new();
                i += 1;
                loop {
                    match chars.get(i) {
                        None | Some('\n') => return Err(err("unterminated string")),
                        Some('"') => break,
                        Some('\\') => {
                            let (ch, next) = escape(&chars, i).map_err(|e| err(&e))?;
                            s.push(ch);
                            i = next;
                        }
                        Some(&ch) => {
                            s.push(ch);
                            i += 1;
                        }
                    }
                }
                i += 1;
                toks.push((Tok::Literal(s), line));
            }
            '[' => {
                i += 1;
                let negated = chars.get(i) == Some(&'^');
                if negated {
                    i += 1;
                }
                let mut ranges = Vec::new();
                loop {
                    let start = match chars.get(i) {
                        None | Some('\n') => return Err(err("unterminated character class")),
                        Some(']') => break,
                        Some('\\') => {
                            let (ch, next) = escape(&chars, i).map_err(|e| err(&e))?;
                            i = next;
                            ch
                        }
                        Some(&ch) => {
                            i += 1;
                            ch
                        }
                    };
                    let mut end = start;
                    if chars.get(i) == Some(&'-') && chars.get(i + 1).is_some_and(|&c| c != ']') {
                        i += 1;
                        end = match chars.get(i) {
                            Some('\\') => {
                                let (ch, next) = escape(&chars, i).map_err(|e| err(&e))?;
                                i = next;
                                ch
                            }
                            Some(&ch) => {
                                i += 1;
                                ch
                            }
                            None => return Err(err("unterminated character class")),
                        };
                        if end < start {
                            return Err(err(&format!("character range {start:?}-{end:?} is reversed")));
                        }
                    }
                    ranges.push((start, end));
                }
                i += 1;
                if ranges.is_empty() {
                    return Err(err("empty character class"));
                }
                toks.push((Tok::Class(negated, ranges), line));
            }
            '{' => {
                let close = (i..chars.len()).find(|&j| chars[j] == '}').ok_or_else(|| err("unterminated `{`"))?;
                let inner: String = chars[i + 1..close].iter().filter(|c| !c.is_whitespace()).collect();
                let num = |s: &str| s.parse::<u32>().map_err(|_| err(&format!("bad repetition {{{inner}}}")));
                let rep = match inner.split_once(',') {
                    None => {
                        let m = num(&inner)?;
                        Tok::Repeat(m, Some(m))
                    }
                    Some((m, "")) => Tok::Repeat(num(m)?, None),
                    Some((m, n)) => {
                        let (m, n) = (num(m)?, num(n)?);
                        if n < m {
                            return Err(err(&format!("bad repetition {{{inner}}}")));
                        }
                        Tok::Repeat(m, Some(n))
                    }
                };
                toks.push((rep, line));
                i = close + 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' | '.' => {
                let t = match c {
                    '(' => Tok::Open,
                    ')' => Tok::Close,
                    '|' => Tok::Bar,
                    '*' => Tok::Star,
                    '+' => Tok::Plus,
                    '?' => Tok::Question,
                    _ => Tok::Any,
                };
                toks.push((t, line));
                i += 1;
            }
            c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_') {
                    i += 1;
                }
                toks.push((Tok::Name(chars[start..i].iter().collect()), line));
            }
            other => return Err(err(&format!("unexpected character {other:?}"))),
        }
    }
    Ok(toks)
}

/// The escape at `chars[i] == '\\'`: the character and the index after it.
fn escape(chars: &[char], i: usize) -> Result<(char, usize), String> {
    let hex = |len: usize| -> Result<(char, usize), String> {
        let digits: String = chars.get(i + 2..i + 2 + len).ok_or("truncated escape")?.iter().collect();
        let v = u32::from_str_radix(&digits, 16).map_err(|_| format!("bad escape \\{}{digits}", chars[i + 1]))?;
        Ok((char::from_u32(v).ok_or(format!("escape {v:#x} is not a character"))?, i + 2 + len))
    };
    match chars.get(i + 1) {
        Some('n') => Ok(('\n', i + 2)),
        Some('t') => Ok(('\t', i + 2)),
        Some('r') => Ok(('\r', i + 2)),
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some(&c @ ('\\' | '"' | '[' | ']' | '-' | '^')) => Ok((c, i + 2)),
        Some(c) => Err(format!("unknown escape \\{c}")),
        None => Err("truncated escape".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_grammar_converts() {
        // The shape of llama.cpp's grammars/arithmetic.gbnf.
        let g = "root  ::= (expr \"=\" ws term \"\\n\")+\nexpr  ::= term ([-+*/] term)*\nterm  ::= ident | num | \"(\" ws expr \")\" ws\nident ::= [a-z] [a-z0-9_]* ws\nnum   ::= [0-9]+ ws\nws    ::= [ \\t\\n]*\n";
        assert_eq!(
            gbnf_to_lark(g).unwrap(),
            concat!(
                "start: r0_root\n",
                "r0_root: (r1_expr \"=\" r5_ws r2_term \"\\n\")+\n",
                "r1_expr: r2_term (/[\\x{2d}\\x{2b}\\x{2a}\\x{2f}]/ r2_term)*\n",
                "r2_term: r3_ident | r4_num | \"(\" r5_ws r1_expr \")\" r5_ws\n",
                "r3_ident: /[\\x{61}-\\x{7a}]/ /[\\x{61}-\\x{7a}\\x{30}-\\x{39}\\x{5f}]/* r5_ws\n",
                "r4_num: /[\\x{30}-\\x{39}]/+ r5_ws\n",
                "r5_ws: /[\\x{20}\\x{9}\\x{a}]/*\n",
            )
        );
    }

    #[test]
    fn json_grammar_shapes_convert() {
        // Multi-line rules, nested groups, negated classes with escapes, `{m,n}` and comments, in
        // the shape of llama.cpp's grammars/json.gbnf (the served-model test uses the same file).
        let g = include_str!("../../../scripts/grammars/json.gbnf");
        let lark = gbnf_to_lark(g).unwrap();
        let lines: Vec<&str> = lark.lines().collect();
        assert_eq!(lines[0], "start: r0_root");
        assert_eq!(lines[2], "r1_value: r2_object | r3_array | r4_string | r5_number | (\"true\" | \"false\" | \"null\") r6_ws");
        assert_eq!(
            lines[5],
            r#"r4_string: "\"" (/[^\x{22}\x{5c}\x{7f}\x{0}-\x{1f}]/ | "\\" (/[\x{22}\x{5c}\x{62}\x{66}\x{6e}\x{72}\x{74}]/ | "u" /[\x{30}-\x{39}\x{61}-\x{66}\x{41}-\x{46}]/{4}))* "\"" r6_ws"#
        );
        assert!(lines[6].contains("/[\\x{31}-\\x{39}]/ /[\\x{30}-\\x{39}]/{0,15}"), "{}", lines[6]);
        assert_eq!(lines[7], r#"r6_ws: (" " | "\n" /[\x{20}\x{9}]/{0,20})?"#);
    }

    #[test]
    fn bad_grammars_say_where() {
        for (g, needle) in [
            ("expr ::= \"a\"", "no `root`"),
            ("root ::= missing", "`missing` is not defined"),
            ("root ::= \"a\nb\"", "line 1: unterminated string"),
            ("root ::= (\"a\"", "not closed"),
            ("root ::= \"a\"\nroot ::= \"b\"", "line 2: rule `root` is defined twice"),
            ("root ::= [z-a]", "reversed"),
            ("root ::= \"a\"{3,1}", "bad repetition"),
            ("just text", "no rule"),
            ("root ::= \"\\q\"", "unknown escape"),
        ] {
            let e = gbnf_to_lark(g).unwrap_err();
            assert!(e.contains(needle), "{g:?}: {e}");
        }
    }
}
