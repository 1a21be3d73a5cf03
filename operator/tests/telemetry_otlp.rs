//! Trace export: with an OTLP endpoint configured, a reconcile's span reaches a collector over
//! OTLP/HTTP (here a fake one on loopback that keeps every POST /v1/traces body), flushed at shutdown.

mod common;

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::routing::post;
use common::*;
use peregrine_crds::ModelDeployment;
use peregrine_operator::{model_deployment, telemetry};
use serde_json::json;

type Received = Arc<Mutex<Vec<Bytes>>>;

/// A collector that accepts every export (an empty protobuf body is a valid success response).
async fn fake_collector() -> (String, Received) {
    let received: Received = Arc::default();
    let sink = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push(body);
                ([("content-type", "application/x-protobuf")], Bytes::new())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), received)
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

// Multi-threaded: the exporter's requests run on the runtime while shutdown waits for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_span_is_exported_to_the_otlp_endpoint() {
    let (endpoint, received) = fake_collector().await;
    let guard = telemetry::init(Some(&endpoint), false).unwrap();
    assert!(guard.exporting());

    let h = harness();
    let object = json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": "traced-model", "namespace": NS, "uid": "md-uid", "generation": 1, "resourceVersion": "1"},
        "spec": {"model": {"uri": "pvc://models/smol.gguf"}, "resources": {"gpus": 0}, "replicas": 1},
    });
    h.api.insert(&md_path("traced-model"), object.clone());
    let md: ModelDeployment = serde_json::from_value(object).unwrap();
    model_deployment::reconcile(Arc::new(md), h.ctx.clone()).await.unwrap();
    assert!(received.lock().unwrap().is_empty(), "spans are batched, not sent one by one");

    // Shutdown flushes the batch.
    drop(guard);
    let bodies = received.lock().unwrap().clone();
    assert!(!bodies.is_empty(), "no export reached the collector");
    let all: Vec<u8> = bodies.concat();
    // Protobuf carries strings verbatim: the span name, its object attributes and the service.
    for expected in ["reconcile_model_deployment", "traced-model", NS, "peregrine-operator"] {
        assert!(contains(&all, expected), "{expected:?} not in the exported traces");
    }
}
