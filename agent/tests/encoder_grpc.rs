//! The built binary serving encoders with `--grpc-port`: a tonic client of
//! `peregrine.encoder.v1.Encoder` against the Sentence-Transformers references (MiniLM) and the
//! transformers references of the classifier fixtures, with the fixtures' tolerances; bad inputs
//! get clear statuses and the server keeps serving; keys and metrics as on HTTP.

mod common;

use std::time::Duration;

use common::{metric, metrics, Server};
use peregrine_agent::serve::grpc::proto::encoder_client::EncoderClient;
use peregrine_agent::serve::grpc::proto::{ClassifyRequest, EmbedRequest, RerankRequest, ScoreRequest};
use peregrine_agent::serve::grpc::status::ERROR_LABEL_KEY;
use serde_json::Value;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const NAME: &str = "minilm";
const KEY: &str = "grpc-test-key";
/// The fixtures README's tolerance on MiniLM embeddings and cosines.
const EMBED_TOL: f64 = 1e-5;
/// The fixtures README's tolerance on classifier logits (softmax and sigmoid keep it).
const LOGIT_TOL: f64 = 1e-4;

/// A server with `--grpc-port` and the given extra flags, and a client connected to it.
async fn start(model: &std::path::Path, extra: &[&str]) -> (Server, EncoderClient<Channel>) {
    let (server, client, _) = start_on_port(model, extra).await;
    (server, client)
}

/// [`start`], also giving the gRPC port.
async fn start_on_port(model: &std::path::Path, extra: &[&str]) -> (Server, EncoderClient<Channel>, String) {
    let port = common::free_port().to_string();
    let mut args = vec!["--threads", "2", "--max-num-batched-tokens", "1024", "--grpc-port", &port];
    args.extend_from_slice(extra);
    let server = Server::start_model(model, NAME, &args);
    let channel = Channel::from_shared(format!("http://127.0.0.1:{port}")).unwrap().connect_timeout(Duration::from_secs(10));
    let client = EncoderClient::new(channel.connect().await.expect("connect to the gRPC port"));
    (server, client, port)
}

/// A request with the API key in its metadata.
fn authed<T>(message: T) -> Request<T> {
    let mut r = Request::new(message);
    r.metadata_mut().insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    r
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn worst(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max)
}

fn unit(v: &[f64]) -> Vec<f64> {
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter().map(|x| x / n).collect()
}

/// Checks a refusal: its code, a message, the HTTP error's label, no host path.
fn refused(status: Status, want: Code, what: &str) {
    assert_eq!(status.code(), want, "{what}: {status:?}");
    assert!(!status.message().is_empty(), "{what}: empty message");
    assert!(!status.message().contains("/tmp") && !status.message().contains("/home"), "{what}: host path in {status:?}");
    if want != Code::OutOfRange {
        assert!(status.metadata().get(ERROR_LABEL_KEY).is_some(), "{what}: no {ERROR_LABEL_KEY}: {status:?}");
    }
}

fn texts(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minilm_embed_rerank_score_match_sentence_transformers_and_bad_inputs_are_refused() {
    let model = peregrine_testkit::test_encoder();
    let (server, mut client) = start(&model, &["--api-key", KEY]).await;
    let r: Value = serde_json::from_slice(&std::fs::read(common::fixtures_dir().join("minilm/reference.json")).unwrap()).unwrap();
    let sentences: Vec<&str> = r["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();

    // Embed: every sentence in one call (one ragged batch), against the references.
    let answer = client.embed(authed(EmbedRequest { inputs: texts(&sentences), ..Default::default() })).await.unwrap().into_inner();
    assert_eq!(answer.model, NAME);
    assert_eq!(answer.embeddings.len(), sentences.len());
    for (i, e) in answer.embeddings.iter().enumerate() {
        let w = worst(&e.values, &floats(&r["embeddings"][i]));
        assert!(w <= EMBED_TOL, "embedding {i}: {w}");
    }
    let usage = answer.usage.unwrap();
    assert!(usage.prompt_tokens > 0 && usage.prompt_tokens == usage.total_tokens, "{usage:?}");
    // dimensions: the leading components, unit length again; the model named explicitly.
    let answer = client
        .embed(authed(EmbedRequest { model: NAME.into(), inputs: texts(&sentences[2..3]), dimensions: Some(64), truncate: false }))
        .await
        .unwrap()
        .into_inner();
    let w = worst(&answer.embeddings[0].values, &unit(&floats(&r["embeddings"][2])[..64]));
    assert!(w <= EMBED_TOL, "dimensions 64: {w}");

    // Rerank with a bi-encoder: cosines against the reference, most relevant first.
    let request = RerankRequest {
        query: sentences[0].into(),
        documents: texts(&sentences[1..3]),
        return_documents: true,
        ..Default::default()
    };
    let answer = client.rerank(authed(request)).await.unwrap().into_inner();
    assert_eq!(answer.results.len(), 2);
    assert_eq!(answer.results[0].index, 0, "sentence 1 is closer to sentence 0");
    for result in &answer.results {
        let i = result.index as usize + 1;
        let want = r["cosine_similarity"][0][i].as_f64().unwrap();
        assert!((result.relevance_score as f64 - want).abs() <= EMBED_TOL, "rerank {i}: {result:?}");
        assert_eq!(result.document.as_deref(), Some(sentences[i]));
    }
    let answer = client
        .rerank(authed(RerankRequest { query: sentences[0].into(), documents: texts(&sentences[1..3]), top_n: Some(1), ..Default::default() }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(answer.results.len(), 1);
    assert_eq!(answer.results[0].document, None, "no documents unless asked");

    // Score, pairwise: (0, 2) and (1, 2) in input order.
    let request = ScoreRequest { text_1: texts(&sentences[0..2]), text_2: texts(&[sentences[2], sentences[2]]), ..Default::default() };
    let answer = client.score(authed(request)).await.unwrap().into_inner();
    for (k, i) in [0usize, 1].into_iter().enumerate() {
        let want = r["cosine_similarity"][i][2].as_f64().unwrap();
        assert!((answer.scores[k] as f64 - want).abs() <= EMBED_TOL, "score {i},2: {}", answer.scores[k]);
    }

    // Bad inputs: the HTTP routes' rules and statuses, each refused clearly.
    let long = "word ".repeat(400);
    let many = vec!["x".to_string(); 10_000];
    let embed_cases: Vec<(&str, EmbedRequest, Code)> = vec![
        ("empty list", EmbedRequest::default(), Code::InvalidArgument),
        ("empty string", EmbedRequest { inputs: texts(&["a", ""]), ..Default::default() }, Code::InvalidArgument),
        ("over-long", EmbedRequest { inputs: vec![long.clone()], ..Default::default() }, Code::InvalidArgument),
        ("too many", EmbedRequest { inputs: many.clone(), ..Default::default() }, Code::InvalidArgument),
        ("too wide", EmbedRequest { inputs: texts(&["a"]), dimensions: Some(385), ..Default::default() }, Code::InvalidArgument),
        ("zero wide", EmbedRequest { inputs: texts(&["a"]), dimensions: Some(0), ..Default::default() }, Code::InvalidArgument),
        ("unknown model", EmbedRequest { model: "other".into(), inputs: texts(&["a"]), ..Default::default() }, Code::NotFound),
        // Over --max-body-bytes (4 MiB): tonic refuses it from its length prefix.
        ("over the message limit", EmbedRequest { inputs: vec!["word ".repeat(1_000_000)], ..Default::default() }, Code::OutOfRange),
    ];
    for (what, request, code) in embed_cases {
        refused(client.embed(authed(request)).await.unwrap_err(), code, what);
    }
    let status = client.rerank(authed(RerankRequest { query: "q".into(), ..Default::default() })).await.unwrap_err();
    refused(status, Code::InvalidArgument, "rerank without documents");
    let status = client.rerank(authed(RerankRequest { documents: texts(&["a"]), ..Default::default() })).await.unwrap_err();
    refused(status, Code::InvalidArgument, "rerank with an empty query");
    let request = RerankRequest { query: "q".into(), documents: texts(&["a"]), top_n: Some(0), ..Default::default() };
    refused(client.rerank(authed(request)).await.unwrap_err(), Code::InvalidArgument, "top_n 0");
    let request = ScoreRequest { text_1: texts(&["a", "b"]), text_2: texts(&["c"]), ..Default::default() };
    refused(client.score(authed(request)).await.unwrap_err(), Code::InvalidArgument, "score 2 against 1");
    let request = ClassifyRequest { inputs: texts(&["a"]), ..Default::default() };
    refused(client.classify(authed(request)).await.unwrap_err(), Code::InvalidArgument, "classify on an embedding model");
    // Keys: none, or a wrong one.
    let request = Request::new(EmbedRequest { inputs: texts(&["a"]), ..Default::default() });
    refused(client.embed(request).await.unwrap_err(), Code::Unauthenticated, "no key");
    let mut request = Request::new(EmbedRequest { inputs: texts(&["a"]), ..Default::default() });
    request.metadata_mut().insert("authorization", "Bearer wrong".parse().unwrap());
    refused(client.embed(request).await.unwrap_err(), Code::Unauthenticated, "wrong key");

    // Still serving; truncate cuts the over-long input instead.
    let answer = client.embed(authed(EmbedRequest { inputs: vec![long], truncate: true, ..Default::default() })).await.unwrap().into_inner();
    assert_eq!(answer.embeddings[0].values.len(), 384);
    assert_eq!(answer.usage.unwrap().prompt_tokens, 256, "cut to MiniLM's max_seq_length");

    // The HTTP metrics count gRPC's requests and refusals.
    let text = metrics(server.addr).await;
    let finished = metric(&text, &format!("peregrine_request_success_total{{model=\"{NAME}\",finished_reason=\"stop\"}}"));
    assert!(finished.unwrap_or(0.0) >= 6.0, "finished requests: {finished:?}\n{text}");
    let tokens = metric(&text, &format!("peregrine_prompt_tokens_total{{model=\"{NAME}\"}}")).unwrap_or(0.0);
    assert!(tokens >= 256.0, "prompt tokens: {tokens}");
    let invalid = metric(&text, "peregrine_request_errors_total{code=\"invalid_value\"}").unwrap_or(0.0);
    assert!(invalid >= 10.0, "invalid_value refusals: {invalid}");
    assert_eq!(metric(&text, "peregrine_request_errors_total{code=\"invalid_api_key\"}"), Some(2.0));
    assert_eq!(metric(&text, "peregrine_request_errors_total{code=\"model_not_found\"}"), Some(1.0));
    assert_eq!(metric(&text, &format!("peregrine_num_requests_waiting{{model=\"{NAME}\"}}")), Some(0.0));
}

/// A classifier fixture (`three-labels` or `cross-encoder`) assembled in a temporary folder, served
/// with `--grpc-port`, and its transformers reference.
async fn start_classifier(head: &str) -> (Server, EncoderClient<Channel>, tempfile::TempDir, Value) {
    let dir = tempfile::tempdir().unwrap();
    let fixture = peregrine_testkit::assemble_classifier(head, dir.path());
    let reference = serde_json::from_slice(&std::fs::read(fixture.join("reference.json")).unwrap()).unwrap();
    let (server, client) = start(dir.path(), &[]).await;
    (server, client, dir, reference)
}

fn softmax64(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classify_matches_transformers() {
    let (_server, mut client, _dir, r) = start_classifier("three-labels").await;
    let labels: Vec<&str> = r["labels"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
    let cases: Vec<&Value> = r["cases"].as_array().unwrap().iter().filter(|c| c["text_pair"].is_null()).collect();
    assert!(cases.len() >= 4);
    let inputs: Vec<String> = cases.iter().map(|c| c["text"].as_str().unwrap().to_string()).collect();
    let answer = client.classify(ClassifyRequest { inputs, ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(answer.results.len(), cases.len());
    for (case, got) in cases.iter().zip(&answer.results) {
        let want = softmax64(&floats(&case["logits"]));
        assert!(worst(&got.probs, &want) <= LOGIT_TOL, "{:.40}: {:?} vs {want:?}", case["text"], got.probs);
        let best = want.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        assert_eq!(got.label, labels[best]);
    }
    let tokens: usize = cases.iter().map(|c| c["input_ids"].as_array().unwrap().len()).sum();
    assert_eq!(answer.usage.unwrap().prompt_tokens as usize, tokens);
    // Bad inputs, and a three-label head has no relevance score.
    let long = "word ".repeat(600);
    let classify_cases: Vec<(&str, ClassifyRequest)> = vec![
        ("empty list", ClassifyRequest::default()),
        ("empty string", ClassifyRequest { inputs: texts(&[""]), ..Default::default() }),
        ("over-long", ClassifyRequest { inputs: vec![long.clone()], ..Default::default() }),
        ("too many", ClassifyRequest { inputs: vec!["x".to_string(); 10_000], ..Default::default() }),
    ];
    for (what, request) in classify_cases {
        refused(client.classify(request).await.unwrap_err(), Code::InvalidArgument, what);
    }
    let request = RerankRequest { query: "q".into(), documents: texts(&["a"]), ..Default::default() };
    refused(client.rerank(request).await.unwrap_err(), Code::InvalidArgument, "rerank on three labels");
    let answer = client.classify(ClassifyRequest { inputs: vec![long], truncate: true, ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(answer.results[0].probs.len(), labels.len(), "still serving, truncated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_encoder_rerank_and_score_match_transformers() {
    let (_server, mut client, _dir, r) = start_classifier("cross-encoder").await;
    let pairs: Vec<&Value> = r["cases"].as_array().unwrap().iter().filter(|c| !c["text_pair"].is_null()).collect();
    assert!(pairs.len() >= 3);
    let query = pairs[0]["text"].as_str().unwrap();
    assert!(pairs.iter().all(|c| c["text"] == query), "the fixture's pairs share one query");
    let docs: Vec<String> = pairs.iter().map(|c| c["text_pair"].as_str().unwrap().to_string()).collect();
    let want: Vec<f64> = pairs.iter().map(|c| 1.0 / (1.0 + (-c["logits"][0].as_f64().unwrap()).exp())).collect();
    let mut order: Vec<usize> = (0..docs.len()).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    let request = RerankRequest { query: query.into(), documents: docs.clone(), ..Default::default() };
    let answer = client.rerank(request).await.unwrap().into_inner();
    assert_eq!(answer.results.len(), docs.len());
    for (rank, result) in answer.results.iter().enumerate() {
        let i = result.index as usize;
        assert_eq!(i, order[rank], "rank {rank}");
        assert!((result.relevance_score as f64 - want[i]).abs() <= LOGIT_TOL, "document {i}: {result:?} vs {}", want[i]);
    }
    let answer = client.score(ScoreRequest { text_1: vec![query.into()], text_2: docs.clone(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(answer.scores.len(), docs.len());
    for (i, got) in answer.scores.iter().enumerate() {
        assert!((*got as f64 - want[i]).abs() <= LOGIT_TOL, "score {i}: {got} vs {}", want[i]);
    }
    let request = RerankRequest { query: "q".into(), documents: vec!["x".to_string(); 1001], ..Default::default() };
    refused(client.rerank(request).await.unwrap_err(), Code::InvalidArgument, "too many documents");
    let request = ScoreRequest { text_1: texts(&["q"]), text_2: vec!["word ".repeat(600)], ..Default::default() };
    refused(client.score(request).await.unwrap_err(), Code::InvalidArgument, "over-long document");
    let answer = client.rerank(RerankRequest { query: query.into(), documents: docs[..1].to_vec(), ..Default::default() }).await.unwrap().into_inner();
    assert_eq!(answer.results.len(), 1, "still serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_and_rate_limits_are_resource_exhausted() {
    // No waiting slot at all, and one request per minute per key: the first call passes the key's
    // limit and finds the queue full, the second is over the key's limit.
    let model = peregrine_testkit::test_encoder();
    let (_server, mut client) = start(&model, &["--api-key", KEY, "--max-waiting-requests", "0", "--rate-limit-rpm", "1"]).await;
    let label = |s: &Status| s.metadata().get(ERROR_LABEL_KEY).and_then(|v| v.to_str().ok()).map(str::to_string);
    let first = client.embed(authed(EmbedRequest { inputs: texts(&["a"]), ..Default::default() })).await.unwrap_err();
    refused(first.clone(), Code::ResourceExhausted, "queue full");
    assert_eq!(label(&first).as_deref(), Some("queue_full"), "{first:?}");
    let second = client.embed(authed(EmbedRequest { inputs: texts(&["a"]), ..Default::default() })).await.unwrap_err();
    refused(second.clone(), Code::ResourceExhausted, "rate limited");
    assert_eq!(label(&second).as_deref(), Some("rate_limit_exceeded"), "{second:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_are_closed() {
    let model = peregrine_testkit::test_encoder();
    let (_server, mut first, port) = start_on_port(&model, &["--max-connections", "1"]).await;
    let request = || EmbedRequest { inputs: texts(&["a"]), ..Default::default() };
    first.embed(request()).await.expect("the first connection is served");
    // A second connection while the first is open: closed on arrival, so no call goes through on it.
    let endpoint = Channel::from_shared(format!("http://127.0.0.1:{port}")).unwrap().connect_timeout(Duration::from_secs(5));
    if let Ok(channel) = endpoint.connect().await {
        let refused = EncoderClient::new(channel).embed(request()).await;
        assert!(refused.is_err(), "a call on a connection beyond the limit: {refused:?}");
    }
    first.embed(request()).await.expect("the first connection is still served");
}

/// `grpc.health.v1.Health` for the whole server and for the Encoder, asked without an API key (as
/// probes do), polled until it reads `want` (the status follows `/ready` within a poll interval).
async fn health_reads(channel: &Channel, want: ServingStatus, within: Duration) {
    let t0 = std::time::Instant::now();
    loop {
        let mut health = HealthClient::new(channel.clone());
        let mut got = Vec::new();
        for service in ["", "peregrine.encoder.v1.Encoder"] {
            let reply = health.check(HealthCheckRequest { service: service.into() }).await.expect("health answers");
            got.push(reply.into_inner().status);
        }
        if got.iter().all(|s| *s == want as i32) {
            return;
        }
        assert!(t0.elapsed() < within, "health is {got:?}, not {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_readiness_and_drain_and_reflection_lists_the_encoder() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let model = peregrine_testkit::test_encoder();
    // A key is set, and neither health nor reflection asks for it; the drain delay keeps gRPC
    // answering after SIGTERM while /ready is 503.
    let (server, _client, port) = start_on_port(&model, &["--api-key", KEY, "--drain-delay", "6"]).await;
    let channel = Channel::from_shared(format!("http://127.0.0.1:{port}")).unwrap().connect().await.unwrap();
    health_reads(&channel, ServingStatus::Serving, Duration::from_secs(2)).await;
    let unknown = HealthClient::new(channel.clone()).check(HealthCheckRequest { service: "no.such.Service".into() }).await;
    assert_eq!(unknown.unwrap_err().code(), Code::NotFound);

    // Reflection: the service list, then the Encoder's file by symbol.
    let ask = |request: MessageRequest| {
        let channel = channel.clone();
        async move {
            let request = ServerReflectionRequest { host: String::new(), message_request: Some(request) };
            let mut replies = ServerReflectionClient::new(channel)
                .server_reflection_info(tokio_stream::iter(vec![request]))
                .await
                .expect("reflection answers")
                .into_inner();
            replies.message().await.expect("a reflection reply").expect("one reply").message_response
        }
    };
    let Some(MessageResponse::ListServicesResponse(list)) = ask(MessageRequest::ListServices(String::new())).await else {
        panic!("no service list");
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for want in ["peregrine.encoder.v1.Encoder", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    let reply = ask(MessageRequest::FileContainingSymbol("peregrine.encoder.v1.Encoder".into())).await;
    let Some(MessageResponse::FileDescriptorResponse(files)) = reply else { panic!("no descriptor: {reply:?}") };
    let file = descriptor_text(&files.file_descriptor_proto[0]);
    assert!(file.contains("peregrine/encoder/v1/encoder.proto") && file.contains("Embed"), "descriptor: {file}");

    // SIGTERM: /ready turns 503 at once and health NOT_SERVING while gRPC still answers.
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    health_reads(&channel, ServingStatus::NotServing, Duration::from_secs(3)).await;
    drop(server);
}

/// An encoded FileDescriptorProto as lossy text: its file name and symbol names are plain strings in
/// it, enough to see which file reflection sent.
fn descriptor_text(encoded: &[u8]) -> String {
    String::from_utf8_lossy(encoded).into_owned()
}
