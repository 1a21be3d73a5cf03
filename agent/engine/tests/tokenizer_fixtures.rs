//! Tokenizer, chat template, incremental decoding and stop strings against the transformers
//! reference (`fixtures/smollm2/reference.json` and the `tokenizer.json` transformers built from
//! the same GGUF).

mod common;

use peregrine_engine::model::gguf::GgufFile;
use peregrine_engine::tokenizer::{
    ChatMessage, IncrementalDecoder, StopMatcher, StopOutput, Tokenizer,
};
use peregrine_engine::EngineError;
use serde_json::Value;

fn gguf_tokenizer() -> Tokenizer {
    let file = GgufFile::open(common::model_path()).unwrap();
    Tokenizer::from_gguf(&file).unwrap()
}

fn json_tokenizer() -> Tokenizer {
    Tokenizer::from_tokenizer_json(common::fixtures_dir().join("smollm2/tokenizer.json")).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_owned())
        .collect()
}

fn messages(v: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Every text/ids pair the fixtures pin down: tokenizer cases, prompts, rendered chats.
fn check_against_reference(tk: &Tokenizer, which: &str) {
    let r = common::reference();
    for case in r["tokenizer_cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = tk.encode(text).unwrap();
        assert_eq!(got, ids(&case["ids"]), "{which}: ids of {text:?}");
        let pieces: Vec<String> = got.iter().map(|&id| tk.token_piece(id).unwrap()).collect();
        assert_eq!(pieces, strs(&case["tokens"]), "{which}: tokens of {text:?}");
        assert_eq!(
            tk.decode(&got, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{which}: {text:?}"
        );
        assert_eq!(
            tk.decode(&got, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap(),
            "{which}: {text:?}"
        );
    }
    for p in r["prompts"].as_array().unwrap() {
        let text = p["prompt"].as_str().unwrap();
        let got = tk.encode(text).unwrap();
        assert_eq!(got, ids(&p["input_ids"]), "{which}: prompt {text:?}");
        let pieces: Vec<String> = got.iter().map(|&id| tk.token_piece(id).unwrap()).collect();
        assert_eq!(
            pieces,
            strs(&p["tokens"]),
            "{which}: prompt tokens {text:?}"
        );
        assert_eq!(
            tk.decode(&ids(&p["greedy"]["ids"]), false).unwrap(),
            p["greedy"]["text"].as_str().unwrap()
        );
    }
    for c in r["chat"].as_array().unwrap() {
        let text = c["rendered_text"].as_str().unwrap();
        assert_eq!(
            tk.encode(text).unwrap(),
            ids(&c["input_ids"]),
            "{which}: chat {text:?}"
        );
        assert_eq!(
            tk.decode(&ids(&c["greedy"]["ids"]), false).unwrap(),
            c["greedy"]["text"].as_str().unwrap()
        );
    }
}

#[test]
fn tokenizer_cases_gguf() {
    check_against_reference(&gguf_tokenizer(), "gguf");
}

#[test]
fn tokenizer_cases_tokenizer_json() {
    check_against_reference(&json_tokenizer(), "tokenizer.json");
}

#[test]
fn gguf_tokenizer_matches_transformers_facts() {
    let r = common::reference();
    let info = &r["tokenizer_info"];
    let tk = gguf_tokenizer();
    let reference = json_tokenizer();
    assert_eq!(
        tk.vocab_size(),
        info["vocab_size_with_added"].as_u64().unwrap() as usize
    );
    assert_eq!(
        tk.bos_token_id(),
        Some(info["bos_token_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(
        tk.eos_token_ids(),
        &[info["eos_token_id"].as_u64().unwrap() as u32]
    );
    // The same ids are special in both (transformers marks the 17 control tokens special).
    for id in 0..tk.vocab_size() as u32 {
        assert_eq!(
            tk.is_special(id),
            reference.is_special(id),
            "is_special({id})"
        );
        assert_eq!(tk.token_piece(id), reference.token_piece(id), "piece {id}");
    }
    assert!(tk.is_special(1) && tk.is_special(2) && !tk.is_special(504));
    // The "smollm" pre-tokenizer splits digits one by one (as llama.cpp does, and as SmolLM2's own
    // tokenizer.json does); the vocabulary has no digit merges, so on digits this agrees with the
    // plain byte-level split transformers' GGUF loader builds. (They differ on " ²": transformers
    // merges it into one token, llama.cpp and the original tokenizer split the space off.)
    for text in [
        "In 2024, 3.14159 and 1,000,000 people",
        "x=12345;y=-0.5e10",
        "٣٤ and 7",
        "<|im_start|>user\n42<|im_end|>",
    ] {
        assert_eq!(
            tk.encode(text).unwrap(),
            reference.encode(text).unwrap(),
            "{text:?}"
        );
    }
    // No BOS is prepended for SmolLM2.
    assert_eq!(
        tk.encode("The capital of France is").unwrap(),
        [504, 3575, 282, 4649, 314]
    );
    // Special tokens written in text are matched, and skip_special_tokens drops them.
    assert_eq!(tk.encode("<|im_start|>user").unwrap()[0], 1);
    assert_eq!(tk.decode(&[1, 4093, 2], true).unwrap(), "user");
    // Logprob text: byte-level pieces shown as the text they stand for.
    assert_eq!(tk.token_str(905).as_deref(), Some(" world"));
    assert_eq!(tk.token_str(2).as_deref(), Some("<|im_end|>"));
    assert_eq!(tk.token_str(49152), None);
    assert!(matches!(
        tk.decode(&[49152], false),
        Err(EngineError::InvalidRequest(_))
    ));
}

#[test]
fn chat_template_from_gguf_renders_like_transformers() {
    let r = common::reference();
    let tk = gguf_tokenizer();
    let template = tk
        .chat_template()
        .expect("the GGUF has tokenizer.chat_template");
    assert_eq!(
        template.source(),
        r["tokenizer_info"]["chat_template"].as_str().unwrap()
    );
    let chats = r["chat"].as_array().unwrap();
    assert!(!chats.is_empty());
    for c in chats {
        let msgs = messages(&c["messages"]);
        let rendered = template
            .render(&msgs, c["add_generation_prompt"].as_bool().unwrap())
            .unwrap();
        assert_eq!(rendered, c["rendered_text"].as_str().unwrap());
        assert_eq!(tk.encode(&rendered).unwrap(), ids(&c["input_ids"]));
    }
}

#[test]
fn hf_folder_reads_config_template_and_generation_eos() {
    let r = common::reference();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        common::fixtures_dir().join("smollm2/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "add_bos_token": false,
        "chat_template": r["tokenizer_info"]["chat_template"],
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [2, 0]}"#,
    )
    .unwrap();
    let tk = Tokenizer::for_model(dir.path()).unwrap();
    assert_eq!(tk.bos_token_id(), Some(1));
    assert_eq!(tk.eos_token_ids(), &[2, 0]);
    for c in r["chat"].as_array().unwrap() {
        let rendered = tk
            .chat_template()
            .unwrap()
            .render(&messages(&c["messages"]), true)
            .unwrap();
        assert_eq!(rendered, c["rendered_text"].as_str().unwrap());
        assert_eq!(tk.encode(&rendered).unwrap(), ids(&c["input_ids"]));
    }
    // add_bos_token: true in the config makes encode prepend BOS even though tokenizer.json does not.
    let mut config = config;
    config["add_bos_token"] = true.into();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let tk = Tokenizer::for_model(dir.path()).unwrap();
    assert_eq!(tk.encode("Hello, world!").unwrap(), [1, 19556, 28, 905, 17]);
    // A .gguf path goes through from_gguf.
    let tk = Tokenizer::for_model(common::model_path()).unwrap();
    assert_eq!(tk.encode("Hello, world!").unwrap(), [19556, 28, 905, 17]);
}

/// Texts with multi-byte characters split across byte-level tokens.
const MULTIBYTE: &[&str] = &[
    "emoji 😀 test",
    "naïve café, Zürich, señor, Ærøskøbing",
    "日本語のテキストと中文文本",
    "families 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 and skin 👍🏽",
    "Ελληνικά и русский, עברית, العربية",
    "math: ∀x∈ℝ, x² ≥ 0 — “quotes” …",
    "🙂",
    "  leading and trailing  ",
];

fn check_incremental(tk: &Tokenizer, ids: &[u32], skip_special: bool) {
    let mut dec = IncrementalDecoder::new(tk.clone(), skip_special);
    let mut out = String::new();
    for &id in ids {
        let piece = dec.push(id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "U+FFFD emitted for id {id} in {ids:?}: {piece:?}"
        );
        out.push_str(&piece);
    }
    out.push_str(&dec.finish());
    assert_eq!(out, tk.decode(ids, skip_special).unwrap(), "ids {ids:?}");
}

#[test]
fn incremental_decoding_equals_full_decode() {
    let r = common::reference();
    for tk in [gguf_tokenizer(), json_tokenizer()] {
        let mut texts: Vec<String> = MULTIBYTE.iter().map(|s| s.to_string()).collect();
        texts.extend(
            r["tokenizer_cases"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["text"].as_str().unwrap().to_owned()),
        );
        texts.extend(
            r["prompts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["prompt"].as_str().unwrap().to_owned()),
        );
        let mut id_lists: Vec<Vec<u32>> = texts.iter().map(|t| tk.encode(t).unwrap()).collect();
        for p in r["prompts"].as_array().unwrap() {
            id_lists.push(ids(&p["greedy"]["ids"]));
        }
        for c in r["chat"].as_array().unwrap() {
            id_lists.push(ids(&c["input_ids"]));
            id_lists.push(ids(&c["greedy"]["ids"]));
        }
        for list in &id_lists {
            // The multi-byte texts must really be split mid-character, or this proves nothing.
            check_incremental(&tk, list, false);
            check_incremental(&tk, list, true);
        }
        let split_mid_char = id_lists
            .iter()
            .filter(|l| {
                l.iter()
                    .any(|&id| tk.token_str(id).unwrap().contains('\u{FFFD}'))
            })
            .count();
        assert!(
            split_mid_char >= 4,
            "only {split_mid_char} id lists split a character"
        );
    }
}

#[test]
fn incremental_decoder_holds_back_partial_characters() {
    let tk = gguf_tokenizer();
    // "emoji 😀 test" = em|oji|Ġ + first 3 bytes of 😀|last byte of 😀|Ġtest
    let mut dec = IncrementalDecoder::new(tk.clone(), false);
    let pieces: Vec<String> = [391, 33777, 40303, 218, 1028]
        .iter()
        .map(|&id| dec.push(id).unwrap())
        .collect();
    assert_eq!(pieces, ["em", "oji", "", " 😀", " test"]);
    assert_eq!(dec.finish(), "");
    // A character that never completes comes out at finish(), as decode shows it.
    let mut dec = IncrementalDecoder::new(tk.clone(), false);
    assert_eq!(dec.push(391).unwrap(), "em");
    assert_eq!(dec.push(40303).unwrap(), "");
    assert_eq!(dec.finish(), tk.decode(&[40303], false).unwrap());
    // Special tokens: kept or skipped.
    let mut keep = IncrementalDecoder::new(tk.clone(), false);
    let mut skip = IncrementalDecoder::new(tk, true);
    assert_eq!(keep.push(2).unwrap(), "<|im_end|>");
    assert_eq!(skip.push(2).unwrap(), "");
    assert_eq!(skip.push(19556).unwrap(), "Hello");
}

fn run_stops(stops: &[&str], pieces: &[&str]) -> (Vec<StopOutput>, String) {
    let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
    let outs: Vec<StopOutput> = pieces.iter().map(|p| m.push(p)).collect();
    let tail = m.finish();
    (outs, tail)
}

fn out(text: &str, stopped: bool) -> StopOutput {
    StopOutput {
        text: text.to_owned(),
        stopped,
    }
}

#[test]
fn stop_strings() {
    // Split across pushes: "EN" is held back until "D" completes "END".
    let (outs, tail) = run_stops(&["END"], &["Hello E", "N", "D and more"]);
    assert_eq!(outs, [out("Hello ", false), out("", false), out("", true)]);
    assert_eq!(tail, "");
    // A held-back prefix that turns out not to be a stop is released.
    let (outs, tail) = run_stops(&["END"], &["Hello E", "Nx", " done E"]);
    assert_eq!(
        outs,
        [
            out("Hello ", false),
            out("ENx", false),
            out(" done ", false)
        ]
    );
    assert_eq!(tail, "E");
    // Overlapping candidates: "aab" inside "aaab"; the stop starts at the second 'a'.
    let (outs, _) = run_stops(&["aab"], &["a", "a", "a", "b!"]);
    assert_eq!(
        outs,
        [
            out("", false),
            out("", false),
            out("a", false),
            out("", true)
        ]
    );
    // Multiple stops: the earliest in the text wins, whatever the list order.
    let mut m = StopMatcher::new(vec!["world".into(), "lo w".into()]);
    assert_eq!(m.push("hello world"), out("hel", true));
    assert_eq!(m.matched_stop(), Some("lo w"));
    assert_eq!(m.push("more"), out("", true));
    // One stop a prefix of another: a shorter complete match ends generation at once.
    let (outs, _) = run_stops(&["\n\n", "\n\nUser:"], &["Hi\n", "\nUser:"]);
    assert_eq!(outs, [out("Hi", false), out("", true)]);
    // No stop strings (or only empty ones): everything passes straight through.
    let (outs, tail) = run_stops(&[""], &["a", "b"]);
    assert_eq!(outs, [out("a", false), out("b", false)]);
    assert_eq!(tail, "");
    // Multi-byte text is never cut inside a character.
    let (outs, tail) = run_stops(&["éclair"], &["café é", "cl"]);
    assert_eq!(outs, [out("café ", false), out("", false)]);
    assert_eq!(tail, "écl");
}

#[test]
fn corrupt_tokenizer_json_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(
        &path,
        br#"{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}"#,
    )
    .unwrap();
    match Tokenizer::from_tokenizer_json(&path) {
        Err(EngineError::InvalidModel { path: p, message }) => {
            assert_eq!(p, path);
            assert!(message.contains("tokenizer.json"), "{message}");
        }
        other => panic!("expected InvalidModel, got {other:?}"),
    }
    assert!(matches!(
        Tokenizer::from_tokenizer_json(dir.path().join("missing.json")),
        Err(EngineError::Io { .. })
    ));
    // A folder without tokenizer.json.
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        Tokenizer::for_model(empty.path()),
        Err(EngineError::InvalidModel { .. })
    ));
}

/// A minimal GGUF v3 file with the given string / string-array metadata and no tensors.
/// A metadata entry: a string (`Ok`) or an array of strings (`Err`).
type Kv<'a> = (&'a str, Result<&'a str, &'a [&'a str]>);

fn tiny_gguf(kvs: &[Kv]) -> Vec<u8> {
    fn put_str(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }
    const STRING: u32 = 8;
    const ARRAY: u32 = 9;
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
    for (key, value) in kvs {
        put_str(&mut b, key);
        match value {
            Ok(s) => {
                b.extend_from_slice(&STRING.to_le_bytes());
                put_str(&mut b, s);
            }
            Err(items) => {
                b.extend_from_slice(&ARRAY.to_le_bytes());
                b.extend_from_slice(&STRING.to_le_bytes());
                b.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for s in *items {
                    put_str(&mut b, s);
                }
            }
        }
    }
    // Tensor data (none here) starts at the next multiple of the default alignment.
    b.resize(b.len().next_multiple_of(32), 0);
    b
}

fn gguf_error(kvs: &[Kv]) -> EngineError {
    let file = GgufFile::from_bytes("tiny.gguf", tiny_gguf(kvs)).unwrap();
    Tokenizer::from_gguf(&file).unwrap_err()
}

#[test]
fn gguf_without_tokenizer_data_is_a_clear_error() {
    let model = ("tokenizer.ggml.model", Ok("gpt2"));
    let tokens: Kv = ("tokenizer.ggml.tokens", Err(&["a", "b", "ab"]));
    let cases: [(&[Kv], &str); 4] = [
        (&[], "tokenizer.ggml.model"),
        (&[model], "tokenizer.ggml.tokens"),
        (&[model, tokens], "tokenizer.ggml.merges"),
        (
            &[model, tokens, ("tokenizer.ggml.merges", Err(&["ab"]))],
            "merges[0]",
        ),
    ];
    for (kvs, needle) in cases {
        match gguf_error(kvs) {
            EngineError::InvalidModel { message, .. } => {
                assert!(message.contains(needle), "{message}")
            }
            other => panic!("expected InvalidModel mentioning {needle}, got {other}"),
        }
    }
    assert!(matches!(
        gguf_error(&[("tokenizer.ggml.model", Ok("bert"))]),
        EngineError::Unsupported(_)
    ));
    // With the arrays present, a tiny tokenizer works end to end.
    let file = GgufFile::from_bytes(
        "tiny.gguf",
        tiny_gguf(&[
            model,
            tokens,
            ("tokenizer.ggml.merges", Err(&["a b"])),
            ("tokenizer.ggml.pre", Ok("gpt2")),
        ]),
    )
    .unwrap();
    let tk = Tokenizer::from_gguf(&file).unwrap();
    assert_eq!(tk.encode("abba").unwrap(), [2, 1, 0]);
    assert_eq!(tk.decode(&[2, 1, 0], false).unwrap(), "abba");
}
