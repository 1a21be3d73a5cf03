//! Requests as OpenAI's docs and SDKs write them parse; responses serialize to OpenAI's field names.

use peregrine_api::chat::{MessageContent, Role};
use peregrine_api::{ChatCompletionRequest, CompletionRequest, Prompt, StopSequences, Usage, Validate};
use serde_json::json;

#[test]
fn openai_docs_chat_request() {
    // From OpenAI's API reference (chat create), plus the vLLM extras clients send.
    let r: ChatCompletionRequest = serde_json::from_value(json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "developer", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "Hi?"}], "name": "bob"}
        ],
        "max_completion_tokens": 20, "max_tokens": 99, "stream": true, "stream_options": {"include_usage": true},
        "logprobs": true, "top_logprobs": 2, "stop": "\n", "seed": 7, "user": "u-1",
        "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": false
    }))
    .unwrap();
    r.validate().unwrap();
    assert_eq!(r.max_tokens(), Some(20), "max_completion_tokens wins");
    assert_eq!(r.messages[0].role, Role::Developer);
    assert_eq!(r.messages[1].content.as_ref().map(MessageContent::text).as_deref(), Some("Hello!\nHi?"));
    assert_eq!(r.sampling.stop, Some(StopSequences::One("\n".into())));
    assert_eq!((r.sampling.top_k, r.sampling.seed, r.sampling.stream), (Some(40), Some(7), true));
}

#[test]
fn completion_prompt_shapes() {
    for (prompt, want) in [
        (json!("hi"), Prompt::Text("hi".into())),
        (json!(["hi"]), Prompt::Texts(vec!["hi".into()])),
        (json!([1, 2]), Prompt::Tokens(vec![1, 2])),
        (json!([[1, 2]]), Prompt::TokenBatches(vec![vec![1, 2]])),
    ] {
        let r: CompletionRequest = serde_json::from_value(json!({"model": "m", "prompt": prompt})).unwrap();
        assert_eq!(r.prompt, want);
        r.validate().unwrap();
    }
    let batch: CompletionRequest = serde_json::from_value(json!({"model": "m", "prompt": ["a", "b"]})).unwrap();
    assert_eq!(batch.validate().unwrap_err().param.as_deref(), Some("prompt"));
}

#[test]
fn validation_names_the_field() {
    let cases = [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"top_p": 0.0}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"presence_penalty": -3}), "presence_penalty"),
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"logprobs": 21}), "logprobs"),
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (json!({"best_of": 17}), "best_of"),
        (json!({"n": 3, "best_of": 2}), "best_of"),
        (json!({"best_of": 2, "stream": true}), "best_of"),
        (json!({"stop": ["a", ""]}), "stop"),
        (json!({"top_k": -2}), "top_k"),
        (json!({"repetition_penalty": 0}), "repetition_penalty"),
        (json!({"logit_bias": {"50256": -100.5}}), "logit_bias"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"logit_bias": {"-1": 1}}), "logit_bias"),
        (json!({"logit_bias": {"1": "1"}}), "logit_bias"),
        (json!({"stream_options": {"include_usage": true}}), "stream_options"),
        (json!({"echo": true}), "echo"),
    ];
    for (extra, param) in cases {
        let mut body = json!({"model": "m", "prompt": "p"});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let r: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(r.validate().unwrap_err().param.as_deref(), Some(param), "{body}");
    }
}

#[test]
fn logit_bias_entries_are_sorted_pairs_within_bounds() {
    let r: CompletionRequest = serde_json::from_value(json!({"model": "m", "prompt": "p", "logit_bias": {"50256": -100, "7": 2.5}})).unwrap();
    r.validate().unwrap();
    assert_eq!(r.sampling.logit_bias_entries().unwrap(), vec![(7, 2.5), (50256, -100.0)]);
    let many: serde_json::Map<String, serde_json::Value> =
        (0..=peregrine_api::common::MAX_LOGIT_BIAS).map(|i| (i.to_string(), json!(1))).collect();
    let r: CompletionRequest = serde_json::from_value(json!({"model": "m", "prompt": "p", "logit_bias": many})).unwrap();
    assert_eq!(r.validate().unwrap_err().param.as_deref(), Some("logit_bias"));
}

#[test]
fn unknown_fields_are_rejected() {
    let e = serde_json::from_value::<CompletionRequest>(json!({"model": "m", "prompt": "p", "functions": []})).unwrap_err();
    assert!(e.to_string().contains("unknown field `functions`"), "{e}");
    let e = serde_json::from_value::<ChatCompletionRequest>(json!({"model": "m", "messages": [{"role": "user", "content": "x", "mood": 1}]}))
        .unwrap_err();
    assert!(e.to_string().contains("unknown field `mood`"), "{e}");
    // Next to the flattened sampling fields, every stray top-level field is named.
    let e = serde_json::from_value::<ChatCompletionRequest>(
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0.5, "mood": 1, "tone": 2}),
    )
    .unwrap_err();
    assert!(e.to_string().contains("unknown field `mood`, `tone`"), "{e}");
}

#[test]
fn requests_round_trip_and_build_with_defaults() {
    use peregrine_api::SamplingFields;
    let r = CompletionRequest {
        sampling: SamplingFields { temperature: Some(0.0), max_tokens: Some(4), ..Default::default() },
        ..CompletionRequest::new("m", Prompt::Text("p".into()))
    };
    let wire = serde_json::to_value(&r).unwrap();
    assert_eq!(wire, json!({"model": "m", "prompt": "p", "echo": false, "temperature": 0.0, "max_tokens": 4, "stream": false, "ignore_eos": false}));
    assert_eq!(serde_json::from_value::<CompletionRequest>(wire).unwrap(), r);
}

#[test]
fn usage_serializes_like_openai() {
    let u = Usage::new(5, 7, 2);
    assert_eq!(
        serde_json::to_value(u).unwrap(),
        json!({"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 2}})
    );
}

#[test]
fn vllm_lora_admin_bodies() {
    use peregrine_api::{LoadLoraAdapterRequest, UnloadLoraAdapterRequest};
    // The bodies of vLLM's docs (Using LoRA adapters → dynamically serving LoRA adapters).
    let r: LoadLoraAdapterRequest =
        serde_json::from_value(json!({"lora_name": "sql_adapter", "lora_path": "/path/to/sql-lora-adapter"})).unwrap();
    r.validate().unwrap();
    let u: UnloadLoraAdapterRequest = serde_json::from_value(json!({"lora_name": "sql_adapter"})).unwrap();
    u.validate().unwrap();
    let u: UnloadLoraAdapterRequest = serde_json::from_value(json!({"lora_name": "x", "lora_int_id": 3})).unwrap();
    assert_eq!(u.lora_int_id, Some(3));
    let bad: LoadLoraAdapterRequest = serde_json::from_value(json!({"lora_name": "a b", "lora_path": "/p"})).unwrap();
    assert_eq!(bad.validate().unwrap_err().param.as_deref(), Some("lora_name"));
    let bad: LoadLoraAdapterRequest = serde_json::from_value(json!({"lora_name": "a", "lora_path": ""})).unwrap();
    assert_eq!(bad.validate().unwrap_err().param.as_deref(), Some("lora_path"));
    assert!(serde_json::from_value::<LoadLoraAdapterRequest>(json!({"lora_name": "a"})).is_err());
}

#[test]
fn structured_output_fields() {
    use peregrine_api::structured::OutputConstraint;
    let chat = |extra: serde_json::Value| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::from_value::<ChatCompletionRequest>(body).unwrap()
    };
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    // As the OpenAI SDK sends them.
    let cases = [
        (json!({"response_format": {"type": "text"}}), None),
        (json!({"response_format": {"type": "json_object"}}), Some(("response_format", OutputConstraint::JsonObject))),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": true}}}),
            Some(("response_format", OutputConstraint::JsonSchema(schema.clone()))),
        ),
        // vLLM's structured_outputs and the older guided_* names; a schema may come as JSON text.
        (json!({"structured_outputs": {"json": schema.to_string()}}), Some(("structured_outputs", OutputConstraint::JsonSchema(schema.clone())))),
        (json!({"structured_outputs": {"regex": "[a-z]+"}}), Some(("structured_outputs", OutputConstraint::Regex("[a-z]+".into())))),
        (json!({"structured_outputs": {"choice": ["a", "b"]}}), Some(("structured_outputs", OutputConstraint::Choice(vec!["a".into(), "b".into()])))),
        (json!({"structured_outputs": {"grammar": "start: \"x\""}}), Some(("structured_outputs", OutputConstraint::Grammar("start: \"x\"".into())))),
        (json!({"guided_json": schema}), Some(("guided_json", OutputConstraint::JsonSchema(schema.clone())))),
        (json!({"guided_regex": "a+"}), Some(("guided_regex", OutputConstraint::Regex("a+".into())))),
        (json!({"guided_choice": ["y"]}), Some(("guided_choice", OutputConstraint::Choice(vec!["y".into()])))),
        (json!({"guided_grammar": "start: \"y\""}), Some(("guided_grammar", OutputConstraint::Grammar("start: \"y\"".into())))),
    ];
    for (extra, want) in cases {
        let r = chat(extra.clone());
        r.validate().unwrap();
        let got = r.structured.constraint().unwrap().map(|c| (c.param, c.constraint));
        assert_eq!(got, want, "{extra}");
    }
    // Refusals name the field.
    let bad = [
        (json!({"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
        (json!({"structured_outputs": {}}), "structured_outputs"),
        (json!({"structured_outputs": {"json": "{not json"}}), "structured_outputs"),
        (json!({"guided_json": [1, 2]}), "guided_json"),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_regex": ""}), "guided_regex"),
        (json!({"guided_grammar": "root ::= missing"}), "guided_grammar"),
    ];
    for (extra, param) in bad {
        assert_eq!(chat(extra.clone()).validate().unwrap_err().param.as_deref(), Some(param), "{extra}");
    }
    // Unknown keys inside the objects are refused at parse time.
    let body = json!({"model": "m", "prompt": "p", "structured_outputs": {"regexp": "a"}});
    assert!(serde_json::from_value::<CompletionRequest>(body).is_err());
    let body = json!({"model": "m", "prompt": "p", "response_format": {"type": "yaml"}});
    assert!(serde_json::from_value::<CompletionRequest>(body).is_err());
}
