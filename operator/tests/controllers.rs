//! Controller behaviour against kube's mock API service: what each reconciliation writes, and
//! what it calls on the agents.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kube::runtime::controller::Action;
use peregrine_crds::{LoraAdapter, ModelDeployment};
use peregrine_operator::{lora_adapter, model_deployment};
use serde_json::{json, Value};

fn md_json(spec: Value) -> Value {
    json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": "smol", "namespace": NS, "uid": "md-uid", "generation": 3, "resourceVersion": "7"},
        "spec": spec,
    })
}

fn base_spec() -> Value {
    json!({"model": {"uri": "pvc://models/smol.gguf"}, "resources": {"gpus": 0}, "replicas": 2})
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == type_).unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

async fn reconcile_md(h: &Harness, object: Value) -> Result<Action, peregrine_operator::Error> {
    h.api.insert(&md_path("smol"), object.clone());
    let md: ModelDeployment = serde_json::from_value(object).unwrap();
    model_deployment::reconcile(Arc::new(md), h.ctx.clone()).await
}

#[tokio::test]
async fn model_deployment_create_applies_deployment_service_and_status() {
    let h = harness();
    let action = reconcile_md(&h, md_json(base_spec())).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(15)), "not ready yet: look again soon");

    let deploy_path = format!("/apis/apps/v1/namespaces/{NS}/deployments/smol");
    let service_path = format!("/api/v1/namespaces/{NS}/services/smol");
    assert_eq!(
        h.api.calls(),
        [
            // The rollout controller reads the stable and canary Deployments, applies the stable
            // one and writes status.rollout under its own field manager.
            format!("GET {deploy_path}"),
            format!("GET {deploy_path}-canary"),
            format!("PATCH {deploy_path}"),
            format!("PATCH {}/status", md_path("smol")),
            format!("PATCH {service_path}"),
            format!("GET /api/v1/namespaces/{NS}/pods"),
            format!("PATCH {}/status", md_path("smol")),
        ]
    );
    let rollout_status = h.api.request("PATCH", &format!("{}/status", md_path("smol"))).unwrap();
    assert!(rollout_status.query.contains("fieldManager=peregrine-operator-rollout"), "{}", rollout_status.query);
    // One field manager, server-side apply, forced.
    let apply = h.api.request("PATCH", &deploy_path).unwrap();
    assert!(apply.content_type.starts_with("application/apply-patch"), "{}", apply.content_type);
    assert!(apply.query.contains("fieldManager=peregrine-operator") && apply.query.contains("force=true"), "{}", apply.query);
    assert_eq!(apply.body["metadata"]["ownerReferences"][0]["uid"], "md-uid");
    assert_eq!(apply.body["metadata"]["ownerReferences"][0]["controller"], true);
    assert_eq!(apply.body["spec"]["replicas"], 2);
    let service = h.api.request("PATCH", &service_path).unwrap();
    assert_eq!(service.body["metadata"]["ownerReferences"][0]["kind"], "ModelDeployment");

    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    assert_eq!(status["observedGeneration"], 3);
    assert_eq!(status["endpoint"], format!("http://smol.{NS}.svc:8000/v1"));
    assert_eq!(status["selector"], "serving.peregrine.dev/model-deployment=smol");
    assert_eq!(condition(status, "Ready")["status"], "False");
    assert_eq!(condition(status, "Progressing")["status"], "True");
    assert_eq!(condition(status, "Degraded")["status"], "False");
    // The first status is a transition: an Event says so.
    let events = h.api.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["reason"], "ReplicasNotReady");
    assert_eq!(events[0]["regarding"]["name"], "smol");
}

#[tokio::test]
async fn model_deployment_ready_when_the_deployment_reports_it() {
    let h = harness();
    let deploy_path = format!("/apis/apps/v1/namespaces/{NS}/deployments/smol");
    h.api.insert(&deploy_path, json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "smol", "namespace": NS, "generation": 4},
        "status": {"observedGeneration": 4, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}
    }));
    let action = reconcile_md(&h, md_json(base_spec())).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(300)));
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    assert_eq!((status["replicas"].clone(), status["readyReplicas"].clone()), (json!(2), json!(2)));
    assert_eq!(condition(status, "Ready")["status"], "True");
    assert_eq!(condition(status, "Ready")["reason"], "AllReplicasReady");
    assert_eq!(condition(status, "Progressing")["status"], "False");

    // Reconciling again with the written status: no transition, no new Event.
    let again = h.api.get(&md_path("smol")).unwrap();
    reconcile_md(&h, again).await.unwrap();
    assert_eq!(h.api.events().len(), 1);
}

#[tokio::test]
async fn invalid_spec_is_reported_and_nothing_is_created() {
    let h = harness();
    // Objects written before the CEL rules (or with validation off) reach the operator anyway.
    let mut spec = base_spec();
    spec["engine"] = json!({"dtype": "bfloat16"});
    let action = reconcile_md(&h, md_json(spec)).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.api.calls(), [format!("PATCH {}/status", md_path("smol"))], "only the status is written");
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    let degraded = condition(status, "Degraded");
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "NoGpusForDtype");
    assert!(degraded["message"].as_str().unwrap().contains("bfloat16"));
    assert!(status.get("endpoint").is_none());
    assert_eq!(h.api.events()[0]["type"], "Warning");

    let h = harness();
    let mut spec = base_spec();
    spec["model"]["uri"] = json!("hf://org/model");
    reconcile_md(&h, md_json(spec)).await.unwrap();
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    assert_eq!(condition(status, "Degraded")["reason"], "UnsupportedUri");
    assert!(condition(status, "Degraded")["message"].as_str().unwrap().contains("unknown URI scheme"));
}

#[tokio::test]
async fn a_gpu_count_that_is_not_a_tensor_parallel_size_is_refused() {
    let h = harness();
    let mut spec = base_spec();
    spec["resources"] = json!({"gpus": 3});
    let action = reconcile_md(&h, md_json(spec)).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.api.calls(), [format!("PATCH {}/status", md_path("smol"))], "no Deployment reserving three GPUs");
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    let degraded = condition(status, "Degraded");
    assert_eq!((degraded["status"].as_str(), degraded["reason"].as_str()), (Some("True"), Some("TooManyGpus")));
    assert!(degraded["message"].as_str().unwrap().contains("0 (CPU), 1, 2, 4 or 8"), "{degraded}");
    let events = h.api.events();
    assert_eq!((events[0]["type"].as_str(), events[0]["reason"].as_str()), (Some("Warning"), Some("TooManyGpus")));
}

#[tokio::test]
async fn a_name_that_cannot_name_a_service_is_refused_before_anything_is_created() {
    let h = harness();
    let mut object = md_json(base_spec());
    object["metadata"]["name"] = json!("llama-3.1-8b");
    h.api.insert(&md_path("llama-3.1-8b"), object.clone());
    let md: ModelDeployment = serde_json::from_value(object).unwrap();
    let action = model_deployment::reconcile(Arc::new(md), h.ctx.clone()).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.api.calls(), [format!("PATCH {}/status", md_path("llama-3.1-8b"))], "no Deployment without its Service");
    let status = &h.api.get(&md_path("llama-3.1-8b")).unwrap()["status"];
    assert_eq!(condition(status, "Degraded")["reason"], "InvalidName");
    assert!(condition(status, "Degraded")["message"].as_str().unwrap().contains("DNS-1035"));
    assert_eq!(h.api.events()[0]["type"], "Warning");
}

#[tokio::test]
async fn an_apply_the_api_server_refuses_is_degraded_with_a_warning_event() {
    let h = harness();
    let deploy_path = format!("/apis/apps/v1/namespaces/{NS}/deployments/smol");
    // What the API server answers for `memory: 32GB` on a Deployment written with validation off.
    h.api.refuse(&deploy_path, 422, "Deployment.apps \"smol\" is invalid: spec.template.spec.containers[0].resources.limits[memory]: Invalid value: \"32GB\": quantities must match the regular expression");
    let result = reconcile_md(&h, md_json(base_spec())).await;
    assert!(result.is_err(), "the error policy retries it with backoff: {result:?}");
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    let degraded = condition(status, "Degraded");
    assert_eq!((degraded["status"].as_str(), degraded["reason"].as_str()), (Some("True"), Some("ApplyFailed")));
    assert!(degraded["message"].as_str().unwrap().contains("32GB"), "{degraded}");
    assert_eq!(condition(status, "Ready")["status"], "False");
    let events = h.api.events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0]["type"].as_str(), events[0]["reason"].as_str()), (Some("Warning"), Some("ApplyFailed")));

    // The Service is refused the same way (a Deployment applied, then the Service fails).
    let h = harness();
    h.api.refuse(&format!("/api/v1/namespaces/{NS}/services/smol"), 422, "Service \"smol\" is invalid: metadata.name: Invalid value");
    assert!(reconcile_md(&h, md_json(base_spec())).await.is_err());
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    assert_eq!(condition(status, "Degraded")["reason"], "ApplyFailed");
    assert!(condition(status, "Degraded")["message"].as_str().unwrap().contains("Service"));
}

#[tokio::test]
async fn missing_model_secret_is_reported_and_retried() {
    let h = harness();
    let mut spec = base_spec();
    spec["model"] = json!({"uri": "s3://bucket/smol.gguf", "secretRef": {"name": "creds"}});
    let action = reconcile_md(&h, md_json(spec.clone())).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(60)));
    assert_eq!(
        h.api.calls(),
        [format!("GET /api/v1/namespaces/{NS}/secrets/creds"), format!("PATCH {}/status", md_path("smol"))]
    );
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    assert_eq!(condition(status, "Degraded")["reason"], "SecretNotFound");

    // Once the Secret exists the Deployment is created, with the fetch init container using it.
    h.api.insert(&format!("/api/v1/namespaces/{NS}/secrets/creds"), json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"}}));
    reconcile_md(&h, md_json(spec)).await.unwrap();
    let deployment = h.api.get(&format!("/apis/apps/v1/namespaces/{NS}/deployments/smol")).unwrap();
    let init = &deployment["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["envFrom"][0]["secretRef"]["name"], "creds");
}

fn adapter_json(name: &str, status: Value) -> Value {
    json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "LoraAdapter",
        "metadata": {"name": name, "namespace": NS, "uid": format!("{name}-uid"), "generation": 1,
                     "finalizers": [lora_adapter::FINALIZER]},
        "spec": {"deploymentRef": {"name": "smol"}, "source": {"uri": format!("pvc://models/adapters/{name}")}},
        "status": status,
    })
}

#[tokio::test]
async fn readiness_gate_opens_once_every_adapter_is_loaded_in_the_pod() {
    let h = harness();
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.api.insert(&pod_path("smol-b"), pod("smol-b", "smol", "10.0.0.2", true));
    // `one` is loaded in both pods, `two` only in smol-a; `broken` fails everywhere and must not
    // hold pods back forever.
    h.api.insert(&lora_path("one"), adapter_json("one", json!({"phase": "Ready", "pods": [
        {"name": "smol-a", "state": "Loaded"}, {"name": "smol-b", "state": "Loaded"}]})));
    h.api.insert(&lora_path("two"), adapter_json("two", json!({"phase": "Loading", "pods": [
        {"name": "smol-a", "state": "Loaded"}, {"name": "smol-b", "state": "Pending"}]})));
    h.api.insert(&lora_path("broken"), adapter_json("broken", json!({"phase": "Failed", "pods": [
        {"name": "smol-a", "state": "Failed", "message": "no such file"}]})));

    reconcile_md(&h, md_json(base_spec())).await.unwrap();
    let patched: Vec<String> = h.api.calls().into_iter().filter(|c| c.contains("/pods/")).collect();
    assert_eq!(patched, [format!("PATCH {}/status", pod_path("smol-a"))]);
    let gate = h.api.request("PATCH", &format!("{}/status", pod_path("smol-a"))).unwrap();
    assert!(gate.content_type.starts_with("application/strategic-merge-patch"));
    let conditions = h.api.get(&pod_path("smol-a")).unwrap()["status"]["conditions"].clone();
    let gate = conditions.as_array().unwrap().iter().find(|c| c["type"] == "serving.peregrine.dev/adapters-loaded").unwrap();
    assert_eq!(gate["status"], "True");
    assert_eq!(gate["message"], "2 adapter(s) loaded");

    // A second pass does not patch the open gate again.
    let before = h.api.calls().len();
    reconcile_md(&h, h.api.get(&md_path("smol")).unwrap()).await.unwrap();
    assert!(!h.api.calls()[before..].iter().any(|c| c.contains("/pods/smol-a/status")));
}

#[tokio::test]
async fn pods_of_a_deployment_without_adapters_are_gated_open_at_once() {
    let h = harness();
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    reconcile_md(&h, md_json(base_spec())).await.unwrap();
    assert!(h.api.calls().contains(&format!("PATCH {}/status", pod_path("smol-a"))));
}

async fn reconcile_lora(h: &Harness, object: Value) -> Result<Action, peregrine_operator::Error> {
    let name = object["metadata"]["name"].as_str().unwrap().to_string();
    h.api.insert(&lora_path(&name), object.clone());
    let adapter: LoraAdapter = serde_json::from_value(object).unwrap();
    lora_adapter::reconcile(Arc::new(adapter), h.ctx.clone()).await
}

fn with_deployment(h: &Harness) {
    h.api.insert(&md_path("smol"), md_json(base_spec()));
}

#[tokio::test]
async fn adapter_gets_a_finalizer_first() {
    let h = harness();
    let mut object = adapter_json("one", Value::Null);
    object["metadata"].as_object_mut().unwrap().remove("finalizers");
    object.as_object_mut().unwrap().remove("status");
    let action = reconcile_lora(&h, object).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.api.calls(), [format!("PATCH {}", lora_path("one"))]);
    assert_eq!(h.api.get(&lora_path("one")).unwrap()["metadata"]["finalizers"], json!([lora_adapter::FINALIZER]));
    assert!(h.agent.calls().is_empty(), "nothing is loaded before the finalizer is in place");
}

#[tokio::test]
async fn adapter_loads_into_every_agent_ready_pod_and_tracks_each() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.api.insert(&pod_path("smol-b"), pod("smol-b", "smol", "10.0.0.2", false)); // model still loading
    h.api.insert(&pod_path("smol-c"), pod("smol-c", "smol", "10.0.0.3", true));
    h.api.insert(&pod_path("other"), pod("other", "another-md", "10.0.0.9", true));
    h.agent.script("http://10.0.0.3:8000", AgentScript { load_error: Some((400, "rank 64 > max_lora_rank 16".into())), ..Default::default() });

    let action = reconcile_lora(&h, adapter_json("one", Value::Null)).await.unwrap();
    assert_eq!(
        h.agent.calls(),
        [
            "list http://10.0.0.1:8000",
            "load http://10.0.0.1:8000 one /mnt/pvc/models/adapters/one",
            "list http://10.0.0.3:8000",
            "load http://10.0.0.3:8000 one /mnt/pvc/models/adapters/one",
        ]
    );
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert_eq!(status["phase"], "Loading");
    assert_eq!((status["loadedReplicas"].clone(), status["targetReplicas"].clone()), (json!(1), json!(2)));
    let pods = status["pods"].as_array().unwrap();
    assert_eq!(pods[0]["name"], "smol-a");
    assert_eq!(pods[0]["state"], "Loaded");
    assert!(pods[0]["loadedAt"].is_string());
    assert_eq!(pods[1]["name"], "smol-c");
    assert_eq!(pods[1]["state"], "Failed");
    assert_eq!(pods[1]["failures"], 1);
    assert!(pods[1]["message"].as_str().unwrap().contains("rank 64"));
    let loaded = condition(status, "Loaded");
    assert_eq!(loaded["status"], "False");
    assert_eq!(loaded["reason"], "PartiallyLoaded");
    // The failed pod is retried after its backoff (5 s for the first failure).
    assert!(
        action == Action::requeue(Duration::from_secs(5)) || action == Action::requeue(Duration::from_secs(4)),
        "{action:?}"
    );
}

#[tokio::test]
async fn failed_pods_are_retried_after_their_backoff_only() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    let future = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(60)).to_string();
    let waiting = json!({"phase": "Failed", "pods": [{"name": "smol-a", "state": "Failed", "failures": 2, "message": "x", "nextRetryAt": future}]});
    reconcile_lora(&h, adapter_json("one", waiting)).await.unwrap();
    assert!(h.agent.calls().is_empty(), "still backing off: {:?}", h.agent.calls());

    let past = (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(1)).to_string();
    let due = json!({"phase": "Failed", "pods": [{"name": "smol-a", "state": "Failed", "failures": 2, "message": "x", "nextRetryAt": past}]});
    reconcile_lora(&h, adapter_json("one", due)).await.unwrap();
    assert_eq!(h.agent.calls(), ["list http://10.0.0.1:8000", "load http://10.0.0.1:8000 one /mnt/pvc/models/adapters/one"]);
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert_eq!(status["phase"], "Ready");
    assert_eq!(status["pods"][0]["failures"], 0);
    assert_eq!(condition(status, "Loaded")["status"], "True");
}

#[tokio::test]
async fn adapter_already_in_the_agent_from_the_same_source_is_not_loaded_twice() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.agent.script("http://10.0.0.1:8000", AgentScript { loaded: vec!["one".into()], ..Default::default() });
    let recorded = json!({"phase": "Ready", "pods": [{"name": "smol-a", "state": "Loaded", "source": "/mnt/pvc/models/adapters/one"}]});
    reconcile_lora(&h, adapter_json("one", recorded)).await.unwrap();
    assert_eq!(h.agent.calls(), ["list http://10.0.0.1:8000"]);
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert_eq!(status["phase"], "Ready");
    assert_eq!(condition(status, "Ready")["status"], "True");
    assert_eq!(condition(status, "Conflict")["status"], "False");
}

#[tokio::test]
async fn editing_the_source_reloads_every_pod_under_the_same_name() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.api.insert(&pod_path("smol-b"), pod("smol-b", "smol", "10.0.0.2", true));
    for ip in ["10.0.0.1", "10.0.0.2"] {
        h.agent.script(&format!("http://{ip}:8000"), AgentScript { loaded: vec!["one".into()], ..Default::default() });
    }
    // Both pods loaded v1; the spec now points at v2.
    let v1 = json!({"phase": "Ready", "pods": [
        {"name": "smol-a", "state": "Loaded", "source": "/mnt/pvc/models/adapters/one-v1"},
        {"name": "smol-b", "state": "Loaded", "source": "/mnt/pvc/models/adapters/one-v1"}]});
    let mut object = adapter_json("one", v1);
    object["spec"]["source"]["uri"] = json!("pvc://models/adapters/one-v2");
    reconcile_lora(&h, object).await.unwrap();
    // A load under the same name, never an unload first: the agent swaps versions with no gap.
    assert_eq!(
        h.agent.calls(),
        [
            "list http://10.0.0.1:8000",
            "load http://10.0.0.1:8000 one /mnt/pvc/models/adapters/one-v2",
            "list http://10.0.0.2:8000",
            "load http://10.0.0.2:8000 one /mnt/pvc/models/adapters/one-v2",
        ]
    );
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    for pod in status["pods"].as_array().unwrap() {
        assert_eq!(pod["source"], "/mnt/pvc/models/adapters/one-v2", "{pod}");
        assert_eq!(pod["state"], "Loaded");
    }
    assert_eq!(condition(status, "Ready")["status"], "True");
}

#[tokio::test]
async fn each_pod_records_the_digest_it_loaded_and_is_reloaded_when_it_reports_another() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.api.insert(&pod_path("smol-b"), pod("smol-b", "smol", "10.0.0.2", true));
    for ip in ["10.0.0.1", "10.0.0.2"] {
        h.agent.script(&format!("http://{ip}:8000"), AgentScript { digest: Some("sha256:v1".into()), ..Default::default() });
    }
    reconcile_lora(&h, adapter_json("one", Value::Null)).await.unwrap();
    let status = h.api.get(&lora_path("one")).unwrap()["status"].clone();
    for pod in status["pods"].as_array().unwrap() {
        assert_eq!((pod["source"].as_str(), pod["digest"].as_str()), (Some("/mnt/pvc/models/adapters/one"), Some("sha256:v1")), "{pod}");
    }

    // Nothing changed: asked, not loaded again.
    h.agent.calls.lock().unwrap().clear();
    let mut object = adapter_json("one", status.clone());
    reconcile_lora(&h, object.clone()).await.unwrap();
    assert_eq!(h.agent.calls(), ["list http://10.0.0.1:8000", "list http://10.0.0.2:8000"]);

    // The folder's files were replaced in place and smol-b re-read them (e.g. after evicting the
    // adapter from host memory): it reports other content than recorded, so it is loaded again
    // and the digest it answers with is recorded. smol-a still has v1 and is left alone.
    h.agent.script("http://10.0.0.2:8000", AgentScript { loaded: vec!["one".into()], digest: Some("sha256:v2".into()), ..Default::default() });
    h.agent.calls.lock().unwrap().clear();
    object["status"] = h.api.get(&lora_path("one")).unwrap()["status"].clone();
    reconcile_lora(&h, object).await.unwrap();
    assert_eq!(
        h.agent.calls(),
        ["list http://10.0.0.1:8000", "list http://10.0.0.2:8000", "load http://10.0.0.2:8000 one /mnt/pvc/models/adapters/one"]
    );
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    let digests: Vec<(&str, &str)> = status["pods"].as_array().unwrap().iter().map(|p| (p["name"].as_str().unwrap(), p["digest"].as_str().unwrap())).collect();
    assert_eq!(digests, [("smol-a", "sha256:v1"), ("smol-b", "sha256:v2")]);
    assert_eq!(condition(status, "Ready")["status"], "True");
}

#[tokio::test]
async fn a_status_without_digests_takes_the_reported_one_without_reloading() {
    // Written by an operator (or against an agent) from before digests: nothing to compare, so the
    // pod is current and what it reports is recorded.
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.agent.script("http://10.0.0.1:8000", AgentScript { loaded: vec!["one".into()], digest: Some("sha256:v1".into()), ..Default::default() });
    let recorded = json!({"phase": "Ready", "pods": [{"name": "smol-a", "state": "Loaded", "source": "/mnt/pvc/models/adapters/one"}]});
    reconcile_lora(&h, adapter_json("one", recorded)).await.unwrap();
    assert_eq!(h.agent.calls(), ["list http://10.0.0.1:8000"]);
    assert_eq!(h.api.get(&lora_path("one")).unwrap()["status"]["pods"][0]["digest"], "sha256:v1");
}

fn served_as(name: &str, served: &str) -> Value {
    let mut object = adapter_json(name, Value::Null);
    object["spec"]["servedName"] = json!(served);
    object
}

#[tokio::test]
async fn two_adapters_with_one_served_name_the_younger_is_a_conflict_and_not_loaded() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    let mut older = served_as("alpha", "sql");
    older["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    let mut younger = served_as("beta", "sql");
    younger["metadata"]["creationTimestamp"] = json!("2026-02-01T00:00:00Z");
    h.api.insert(&lora_path("alpha"), older.clone());
    let action = reconcile_lora(&h, younger.clone()).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(60)));
    assert!(h.agent.calls().is_empty(), "{:?}", h.agent.calls());
    let status = &h.api.get(&lora_path("beta")).unwrap()["status"];
    assert_eq!(status["phase"], "Failed");
    let conflict = condition(status, "Conflict");
    assert_eq!((conflict["status"].as_str(), conflict["reason"].as_str()), (Some("True"), Some("ServedNameConflict")));
    assert!(conflict["message"].as_str().unwrap().contains("LoraAdapter \"alpha\""), "{conflict}");
    assert_eq!(condition(status, "Ready")["status"], "False");

    // The older one keeps the name and loads.
    reconcile_lora(&h, older).await.unwrap();
    assert_eq!(h.agent.calls(), ["list http://10.0.0.1:8000", "load http://10.0.0.1:8000 sql /mnt/pvc/models/adapters/alpha"]);
    assert_eq!(condition(&h.api.get(&lora_path("alpha")).unwrap()["status"], "Conflict")["status"], "False");

    // Deleting the loser must not unload the winner's name.
    let mut deleting = h.api.get(&lora_path("beta")).unwrap();
    deleting["metadata"]["deletionTimestamp"] = json!("2026-03-01T00:00:00Z");
    reconcile_lora(&h, deleting).await.unwrap();
    assert!(!h.agent.calls().iter().any(|c| c.starts_with("unload")), "{:?}", h.agent.calls());
}

#[tokio::test]
async fn an_adapter_named_like_the_base_model_is_a_conflict() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    reconcile_lora(&h, served_as("one", "smol")).await.unwrap();
    assert!(h.agent.calls().is_empty());
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert!(condition(status, "Conflict")["message"].as_str().unwrap().contains("base model"));
}

#[tokio::test]
async fn a_rank_above_max_lora_rank_is_refused_before_calling_the_agent() {
    let h = harness();
    let mut spec = base_spec();
    spec["engine"] = json!({"maxLoras": 2, "maxLoraRank": 16});
    h.api.insert(&md_path("smol"), md_json(spec));
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    let mut object = adapter_json("one", Value::Null);
    object["spec"]["rank"] = json!(64);
    let action = reconcile_lora(&h, object).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert!(h.agent.calls().is_empty());
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert_eq!(status["phase"], "Failed");
    let loaded = condition(status, "Loaded");
    assert_eq!(loaded["reason"], "RankTooHigh");
    assert!(loaded["message"].as_str().unwrap().contains("maxLoraRank 16"), "{loaded}");
}

#[tokio::test]
async fn load_failing_everywhere_is_a_clear_condition_not_an_error() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.api.insert(&pod_path("smol-b"), pod("smol-b", "smol", "10.0.0.2", true));
    h.agent.script("http://10.0.0.1:8000", AgentScript { load_error: Some((404, "adapter_config.json not found".into())), ..Default::default() });
    h.agent.script("http://10.0.0.2:8000", AgentScript { down: true, ..Default::default() });
    let action = reconcile_lora(&h, adapter_json("one", Value::Null)).await;
    assert!(action.is_ok(), "a failing load is status, not a reconcile error: {action:?}");
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert_eq!(status["phase"], "Failed");
    let loaded = condition(status, "Loaded");
    assert_eq!(loaded["reason"], "LoadFailed");
    assert!(loaded["message"].as_str().unwrap().contains("adapter_config.json not found"), "{loaded}");
}

#[tokio::test]
async fn adapter_of_a_missing_deployment_waits_with_a_condition() {
    let h = harness();
    let action = reconcile_lora(&h, adapter_json("one", Value::Null)).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(300)));
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert_eq!(status["phase"], "Pending");
    assert_eq!(condition(status, "Loaded")["reason"], "DeploymentNotFound");
    assert!(h.agent.calls().is_empty());
}

#[tokio::test]
async fn adapter_on_an_unmounted_claim_is_refused_with_advice() {
    let h = harness();
    with_deployment(&h);
    let mut object = adapter_json("one", Value::Null);
    object["spec"]["source"]["uri"] = json!("pvc://other-claim/one");
    reconcile_lora(&h, object).await.unwrap();
    let status = &h.api.get(&lora_path("one")).unwrap()["status"];
    assert_eq!(status["phase"], "Failed");
    assert!(condition(status, "Loaded")["message"].as_str().unwrap().contains("spec.adapterVolumes"));
}

#[tokio::test]
async fn deleting_an_adapter_unloads_it_then_removes_the_finalizer() {
    let h = harness();
    with_deployment(&h);
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", true));
    h.api.insert(&pod_path("smol-b"), pod("smol-b", "smol", "10.0.0.2", true));
    h.agent.script("http://10.0.0.1:8000", AgentScript { loaded: vec!["one".into()], ..Default::default() });
    h.agent.script("http://10.0.0.2:8000", AgentScript { down: true, ..Default::default() });
    let mut object = adapter_json("one", json!({"phase": "Ready"}));
    object["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let action = reconcile_lora(&h, object).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.agent.calls(), ["unload http://10.0.0.1:8000 one", "unload http://10.0.0.2:8000 one"]);
    assert!(h.agent.scripts.lock().unwrap()["http://10.0.0.1:8000"].loaded.is_empty());
    assert_eq!(h.api.get(&lora_path("one")).unwrap()["metadata"]["finalizers"], json!([]));
}

#[tokio::test]
async fn reconcile_metrics_count_runs_and_failures() {
    let h = harness();
    reconcile_md(&h, md_json(base_spec())).await.unwrap();
    let text = h.ctx.metrics.encode();
    assert!(text.contains("peregrine_operator_reconciliations_total{controller=\"modeldeployment\"} 1"), "{text}");
    assert!(text.contains("peregrine_operator_reconcile_duration_seconds_count{controller=\"modeldeployment\"} 1"), "{text}");
    let err = peregrine_operator::Error::MissingField("x");
    h.ctx.metrics.reconcile_failed("modeldeployment", &err);
    assert!(h.ctx.metrics.encode().contains("peregrine_operator_reconcile_failures_total{controller=\"modeldeployment\",error=\"missing_field\"} 1"));
}

/// While pods load their weights, `Progressing` says how far each has come (read from the agents'
/// `peregrine_load_progress` gauge), so `kubectl get` shows a slow load moving; ready pods and pods
/// that report nothing are left out.
#[tokio::test]
async fn progressing_shows_the_agents_load_progress() {
    let h = harness();
    h.api.insert(&pod_path("smol-a"), pod("smol-a", "smol", "10.0.0.1", false));
    h.api.insert(&pod_path("smol-b"), pod("smol-b", "smol", "10.0.0.2", false));
    h.agent.script("http://10.0.0.1:8000", AgentScript { load_progress: Some(0.42), ..Default::default() });
    h.agent.script("http://10.0.0.2:8000", AgentScript { down: true, ..Default::default() });
    reconcile_md(&h, md_json(base_spec())).await.unwrap();
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    let progressing = condition(status, "Progressing");
    assert_eq!(progressing["status"], "True");
    let message = progressing["message"].as_str().unwrap();
    assert!(message.ends_with("; weights loading: smol-a 42%"), "{message}");
    assert!(h.agent.calls().contains(&"progress http://10.0.0.1:8000".to_string()), "{:?}", h.agent.calls());

    // Loaded (the gauge reads 1, warming up): no note.
    h.agent.script("http://10.0.0.1:8000", AgentScript { load_progress: Some(1.0), ..Default::default() });
    let again = h.api.get(&md_path("smol")).unwrap();
    reconcile_md(&h, again).await.unwrap();
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    let message = condition(status, "Progressing")["message"].as_str().unwrap().to_string();
    assert!(!message.contains("weights loading"), "{message}");
}

const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/models/inferencepools";
const OBJECTIVES: &str = "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/models/inferenceobjectives";

fn install_inference_extension(h: &Harness, objectives: bool) {
    install_api(&h.api, "inference.networking.k8s.io/v1", "InferencePool", "inferencepools");
    if objectives {
        install_api(&h.api, "inference.networking.x-k8s.io/v1alpha2", "InferenceObjective", "inferenceobjectives");
    }
}

fn gateway_spec() -> Value {
    let mut spec = base_spec();
    spec["gateway"] = json!({"inferencePool": {}});
    spec
}

/// The deployment's `InferencePoolReady` condition as (status, reason, message).
fn pool_ready(h: &Harness) -> (String, String, String) {
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    let c = condition(status, "InferencePoolReady");
    let text = |k: &str| c[k].as_str().unwrap().to_string();
    (text("status"), text("reason"), text("message"))
}

fn with_priority(name: &str, md: &str, priority: Option<i32>) -> Value {
    let mut object = adapter_json(name, Value::Null);
    object["spec"]["deploymentRef"]["name"] = json!(md);
    if let Some(p) = priority {
        object["spec"]["gateway"] = json!({"priority": p});
    }
    object
}

#[tokio::test]
async fn inference_pool_without_its_crd_is_a_condition_and_one_warning_not_a_failure() {
    let h = harness();
    let action = reconcile_md(&h, md_json(gateway_spec())).await;
    assert!(action.is_ok(), "a missing CRD is not a reconcile error (no backoff loop): {action:?}");
    assert!(!h.api.calls().iter().any(|c| c.contains("inferencepools")), "nothing is written to an API that is not there");
    let (status, reason, message) = pool_ready(&h);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InferencePoolCRDMissing"));
    assert!(message.contains("inference.networking.k8s.io/v1"), "{message}");
    // The deployment itself is created as usual.
    assert!(h.api.get(&format!("/apis/apps/v1/namespaces/{NS}/deployments/smol")).is_some());
    let warnings: Vec<Value> = h.api.events().into_iter().filter(|e| e["reason"] == "InferencePoolCRDMissing").collect();
    assert_eq!(warnings.len(), 1);
    assert_eq!(warnings[0]["type"], "Warning");

    // Again, unchanged: no second event.
    reconcile_md(&h, h.api.get(&md_path("smol")).unwrap()).await.unwrap();
    assert_eq!(h.api.events().iter().filter(|e| e["reason"] == "InferencePoolCRDMissing").count(), 1);

    // The CRDs get installed: the next reconcile creates the pool.
    install_inference_extension(&h, true);
    reconcile_md(&h, h.api.get(&md_path("smol")).unwrap()).await.unwrap();
    assert!(h.api.get(&format!("{POOLS}/smol")).is_some());
    assert_eq!(pool_ready(&h).0, "True");
}

#[tokio::test]
async fn inference_pool_and_objectives_are_created_where_the_crds_exist() {
    let h = harness();
    install_inference_extension(&h, true);
    for adapter in [with_priority("sql", "smol", Some(10)), with_priority("chat", "smol", None), with_priority("elsewhere", "other", Some(5))] {
        h.api.insert(&lora_path(adapter["metadata"]["name"].as_str().unwrap()), adapter);
    }
    // Left from when "chat" had a priority.
    h.api.insert(&format!("{OBJECTIVES}/chat"), json!({
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
        "metadata": {"name": "chat", "namespace": NS, "labels": {"serving.peregrine.dev/model-deployment": "smol"}},
        "spec": {"priority": 1, "poolRef": {"name": "smol"}}
    }));
    let mut spec = gateway_spec();
    spec["gateway"]["inferencePool"] = json!({"endpointPickerService": "vllm-epp", "endpointPickerPort": 9003, "failureMode": "FailOpen"});
    reconcile_md(&h, md_json(spec)).await.unwrap();

    let apply = h.api.request("PATCH", &format!("{POOLS}/smol")).expect("the pool is applied");
    assert!(apply.content_type.starts_with("application/apply-patch"), "{}", apply.content_type);
    assert!(apply.query.contains("fieldManager=peregrine-operator"), "{}", apply.query);
    let pool = apply.body;
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    assert_eq!(pool["kind"], "InferencePool");
    // The pool selects exactly the pods the Service selects, on the agent port.
    let service = h.api.get(&format!("/api/v1/namespaces/{NS}/services/smol")).unwrap();
    assert_eq!(pool["spec"]["selector"]["matchLabels"], service["spec"]["selector"]);
    assert_eq!(pool["spec"]["targetPorts"], json!([{"number": 8000}]));
    assert_eq!(pool["spec"]["endpointPickerRef"], json!({"group": "", "kind": "Service", "name": "vllm-epp", "port": {"number": 9003}, "failureMode": "FailOpen"}));
    let owner = &pool["metadata"]["ownerReferences"][0];
    assert_eq!((owner["kind"].as_str(), owner["uid"].as_str(), owner["controller"].as_bool()), (Some("ModelDeployment"), Some("md-uid"), Some(true)));

    let objective = h.api.request("PATCH", &format!("{OBJECTIVES}/sql")).expect("an objective for the adapter with a priority").body;
    assert_eq!(objective["apiVersion"], "inference.networking.x-k8s.io/v1alpha2");
    assert_eq!(objective["spec"], json!({"priority": 10, "poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "smol"}}));
    let owner = &objective["metadata"]["ownerReferences"][0];
    assert_eq!((owner["kind"].as_str(), owner["uid"].as_str()), (Some("LoraAdapter"), Some("sql-uid")), "garbage-collected with its adapter");
    assert!(h.api.request("PATCH", &format!("{OBJECTIVES}/elsewhere")).is_none(), "another deployment's adapter");
    assert!(h.api.get(&format!("{OBJECTIVES}/chat")).is_none(), "the objective of an adapter without a priority is deleted");

    let (status, reason, message) = pool_ready(&h);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "InferencePoolApplied"));
    assert!(message.contains("vllm-epp:9003"), "{message}");
}

#[tokio::test]
async fn priorities_without_the_objective_crd_are_reported() {
    let h = harness();
    install_inference_extension(&h, false);
    h.api.insert(&lora_path("sql"), with_priority("sql", "smol", Some(10)));
    reconcile_md(&h, md_json(gateway_spec())).await.unwrap();
    assert!(h.api.get(&format!("{POOLS}/smol")).is_some(), "the pool works without objectives");
    let (status, reason, message) = pool_ready(&h);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "InferencePoolCRDMissing"));
    assert!(message.contains("priorities of 1 LoraAdapter"), "{message}");
}

#[tokio::test]
async fn turning_the_pool_off_deletes_what_was_made() {
    let h = harness();
    install_inference_extension(&h, true);
    h.api.insert(&lora_path("sql"), with_priority("sql", "smol", Some(10)));
    reconcile_md(&h, md_json(gateway_spec())).await.unwrap();
    assert!(h.api.get(&format!("{POOLS}/smol")).is_some() && h.api.get(&format!("{OBJECTIVES}/sql")).is_some());

    let mut object = h.api.get(&md_path("smol")).unwrap();
    object["spec"]["gateway"]["inferencePool"]["enabled"] = json!(false);
    reconcile_md(&h, object).await.unwrap();
    assert!(h.api.get(&format!("{POOLS}/smol")).is_none());
    assert!(h.api.get(&format!("{OBJECTIVES}/sql")).is_none());
    let status = &h.api.get(&md_path("smol")).unwrap()["status"];
    assert!(!status["conditions"].as_array().unwrap().iter().any(|c| c["type"] == "InferencePoolReady"), "{status}");

    // Nothing asked, nothing made: no gateway calls at all.
    let before = h.api.calls().len();
    reconcile_md(&h, h.api.get(&md_path("smol")).unwrap()).await.unwrap();
    assert!(!h.api.calls()[before..].iter().any(|c| c.contains("inference.networking")), "{:?}", &h.api.calls()[before..]);
}
