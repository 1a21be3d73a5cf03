//! The operator in a real cluster: a CPU ModelDeployment of SmolLM2 becomes Ready, an adapter is
//! loaded into its pod, and deleting the adapter unloads it (the finalizer lets go).
//!
//! Runs only when `KUBECONFIG` is set, against a cluster prepared as in docs/operations.md
//! ("End-to-end test with kind"): CRDs and operator installed, agent image loaded, and a PVC
//! `models` holding the GGUF file and the fixture adapter. Otherwise it says plainly that it skipped.

use std::time::Duration;

use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client};
use peregrine_crds::{AdapterPhase, LoraAdapter, ModelDeployment, CONDITION_READY};
use serde_json::json;

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[tokio::test]
async fn model_deployment_and_adapter_in_kind() {
    if std::env::var_os("KUBECONFIG").is_none() {
        eprintln!("SKIPPED: KUBECONFIG is not set; this suite needs a cluster (docs/operations.md, \"End-to-end test with kind\")");
        return;
    }
    let client = Client::try_default().await.expect("KUBECONFIG is set but no client could be built from it");
    let ns = env("PEREGRINE_E2E_NAMESPACE", "peregrine-e2e");
    let mds: Api<ModelDeployment> = Api::namespaced(client.clone(), &ns);
    let adapters: Api<LoraAdapter> = Api::namespaced(client.clone(), &ns);
    let apply = PatchParams::apply("peregrine-e2e").force();

    let md = json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": "e2e-smollm2"},
        "spec": {
            "model": {"uri": env("PEREGRINE_E2E_MODEL_URI", "pvc://models/SmolLM2-135M-Instruct.Q4_1.gguf"), "format": "gguf"},
            "engine": {"dtype": "float32", "maxLoras": 2, "maxLoraRank": 16},
            "image": env("PEREGRINE_E2E_AGENT_IMAGE", "peregrine-agent:dev"),
            "imagePullPolicy": "IfNotPresent",
            "resources": {"gpus": 0},
            "replicas": 1
        }
    });
    mds.patch("e2e-smollm2", &apply, &Patch::Apply(&md)).await.expect("applying the ModelDeployment (CRDs installed?)");

    let adapter = json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "LoraAdapter",
        "metadata": {"name": "e2e-adapter"},
        "spec": {"deploymentRef": {"name": "e2e-smollm2"}, "source": {"uri": env("PEREGRINE_E2E_ADAPTER_URI", "pvc://models/adapters/fixture")}}
    });
    adapters.patch("e2e-adapter", &apply, &Patch::Apply(&adapter)).await.expect("applying the LoraAdapter");

    // The pod becomes Ready only after the adapter is loaded (readiness gate), so Ready covers both.
    wait_for("the ModelDeployment to be Ready", Duration::from_secs(600), || async {
        let md = mds.get("e2e-smollm2").await.ok()?;
        let status = md.status?;
        status.conditions.iter().any(|c| c.type_ == CONDITION_READY && c.status == "True").then_some(())
    })
    .await;
    let loaded = wait_for("the adapter to be loaded", Duration::from_secs(120), || async {
        let a = adapters.get("e2e-adapter").await.ok()?;
        let status = a.status?;
        (status.phase == Some(AdapterPhase::Ready)).then_some(status)
    })
    .await;
    assert_eq!((loaded.loaded_replicas, loaded.target_replicas), (1, 1));

    adapters.delete("e2e-adapter", &DeleteParams::default()).await.expect("deleting the adapter");
    wait_for("the adapter to be unloaded and deleted", Duration::from_secs(120), || async {
        adapters.get_opt("e2e-adapter").await.ok()?.is_none().then_some(())
    })
    .await;
    mds.delete("e2e-smollm2", &DeleteParams::default()).await.expect("deleting the ModelDeployment");
}
