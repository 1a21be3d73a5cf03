//! Renders the Helm chart with Helm's own library (helm-python-sdk, which binds Helm's Go SDK) and
//! parses every rendered object into its k8s-openapi type. An object that loses fields on the way
//! through its type has a misspelt or misplaced field, and fails the test.

use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> String {
    std::env::var("PEREGRINE_PYTHON").unwrap_or_else(|_| {
        panic!("PEREGRINE_PYTHON is not set: run `make python-deps` (or `make test`), which installs helm-python-sdk and prints the python to use")
    })
}

/// Renders the chart; returns every object and fails on `helm lint --strict` findings.
fn render(values: Value) -> Vec<Value> {
    try_render(values).unwrap_or_else(|e| panic!("{e}"))
}

/// Renders the chart, or says why Helm refused (lint findings, among them values that break
/// `values.schema.json`, or a failed render).
fn try_render(values: Value) -> Result<Vec<Value>, String> {
    run_renderer(values, None)
}

/// Renders the chart as `helm install --dry-run=server` does against a cluster whose API
/// discovery offers the built-in kinds plus `apis` ("group/version/Kind"): the renderer's mock API
/// server answers Helm's discovery, so `.Capabilities.APIVersions` is what such a cluster reports.
fn render_in_cluster(values: Value, apis: &[&str]) -> Vec<Value> {
    run_renderer(values, Some(apis)).unwrap_or_else(|e| panic!("{e}"))
}

fn run_renderer(values: Value, apis: Option<&[&str]>) -> Result<Vec<Value>, String> {
    let mut command = Command::new(python());
    command
        .arg(repo_root().join("scripts/render-chart.py"))
        .arg(repo_root().join("charts/peregrine"))
        .args(["peregrine", "peregrine-system", &values.to_string()]);
    if let Some(apis) = apis {
        command.arg(json!(apis).to_string());
    }
    let out = command.output().expect("running the chart renderer");
    if !out.status.success() {
        return Err(format!("render failed (is helm-python-sdk installed? run `make python-deps`): {}", String::from_utf8_lossy(&out.stderr)));
    }
    let result: Value = serde_json::from_slice(&out.stdout).unwrap();
    if result["lint"] != json!([]) {
        return Err(format!("helm lint --strict findings: {}", result["lint"]));
    }
    let mut objects = Vec::new();
    for (template, text) in result["manifests"].as_object().unwrap() {
        for doc in serde_yaml::Deserializer::from_str(text.as_str().unwrap()) {
            let value: Value = serde::Deserialize::deserialize(doc).unwrap_or_else(|e| panic!("{template}: {e}"));
            if !value.is_null() {
                objects.push(value);
            }
        }
    }
    Ok(objects)
}

/// Parses `value` as `T` and checks nothing was dropped or changed on the way back.
fn typed<T: DeserializeOwned + Serialize>(value: &Value) -> T {
    let name = format!("{} {}", value["kind"], value["metadata"]["name"]);
    let object: T = serde_json::from_value(value.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let back = serde_json::to_value(&object).unwrap();
    assert_eq!(&back, value, "{name}: fields lost through the typed object (misspelt or misplaced?)");
    object
}

fn check_all(objects: &[Value]) {
    for value in objects {
        match value["kind"].as_str().unwrap_or_default() {
            "Deployment" => drop(typed::<Deployment>(value)),
            "Service" => drop(typed::<Service>(value)),
            "ServiceAccount" => drop(typed::<ServiceAccount>(value)),
            "ClusterRole" => drop(typed::<ClusterRole>(value)),
            "ClusterRoleBinding" => drop(typed::<ClusterRoleBinding>(value)),
            "Role" => drop(typed::<Role>(value)),
            "RoleBinding" => drop(typed::<RoleBinding>(value)),
            "PodDisruptionBudget" => drop(typed::<PodDisruptionBudget>(value)),
            // prometheus-operator's type is not in k8s-openapi: check the fields we rely on.
            "ServiceMonitor" => {
                assert_eq!(value["apiVersion"], "monitoring.coreos.com/v1");
                assert_eq!(value["spec"]["endpoints"][0]["port"], "metrics");
            }
            "PodMonitor" => {
                assert_eq!(value["apiVersion"], "monitoring.coreos.com/v1");
                // The agent container's port is named `http` (operator/src/desired/deployment.rs).
                assert_eq!(value["spec"]["podMetricsEndpoints"][0]["port"], "http");
                assert_eq!(value["spec"]["podMetricsEndpoints"][0]["path"], "/metrics");
            }
            "ConfigMap" => drop(typed::<k8s_openapi::api::core::v1::ConfigMap>(value)),
            other => panic!("unexpected kind {other:?} rendered"),
        }
    }
}

fn find<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

#[test]
fn default_values_render_valid_objects() {
    let objects = render(json!({}));
    check_all(&objects);
    let kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
    for kind in ["Deployment", "Service", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"] {
        assert!(kinds.contains(&kind), "{kind} missing from {kinds:?}");
    }
    assert!(!kinds.contains(&"ServiceMonitor"));

    let deployment: Deployment = typed(find(&objects, "Deployment")[0]);
    let pod = deployment.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("peregrine"));
    let container = &pod.containers[0];
    let args = container.args.clone().unwrap();
    assert!(args.contains(&"--agent-image=ghcr.io/peregrine-serving/peregrine-agent:0.1.0".to_string()), "{args:?}");
    assert!(args.contains(&"--log-json=true".to_string()));
    assert!(!args.iter().any(|a| a.starts_with("--watch-namespace")));
    assert!(!args.iter().any(|a| a.starts_with("--otlp-endpoint")), "no trace export unless configured");
    assert_eq!(container.image.as_deref(), Some("ghcr.io/peregrine-serving/peregrine-operator:0.1.0"));

    // runAsNonRoot is enforced by the kubelet only against a numeric user: the pod and the image say one.
    let security = pod.security_context.clone().unwrap();
    assert_eq!(security.run_as_non_root, Some(true));
    assert_eq!((security.run_as_user, security.run_as_group), (Some(65532), Some(65532)));

    // The metrics Service reaches the container port by name.
    let service: Service = typed(find(&objects, "Service")[0]);
    let port = &service.spec.unwrap().ports.unwrap()[0];
    assert_eq!(port.target_port, Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("metrics".into())));
    assert_eq!(container.ports.as_ref().unwrap()[0].name.as_deref(), Some("metrics"));
}

#[test]
fn rbac_is_least_privilege() {
    let objects = render(json!({}));
    let role: ClusterRole = typed(find(&objects, "ClusterRole")[0]);
    let rules = role.rules.unwrap();
    // The autoscaler writes replicas through /scale.
    assert!(rules.iter().any(|r| r.resources.as_ref().is_some_and(|res| res.contains(&"modeldeployments/scale".to_string()))
        && r.verbs.contains(&"patch".to_string())));
    for rule in rules {
        let verbs = rule.verbs;
        let resources = rule.resources.unwrap_or_default();
        assert!(!verbs.iter().any(|v| v == "*" || v == "deletecollection"), "{verbs:?}");
        if verbs.iter().any(|v| v == "delete") {
            // Only rollouts' canary Deployments, and the Inference Extension objects the operator
            // made for a deployment whose spec.gateway no longer asks for them, are deleted.
            assert!(
                [&["deployments"][..], &["inferencepools"], &["inferenceobjectives"]].contains(&resources.iter().map(String::as_str).collect::<Vec<_>>().as_slice()),
                "delete on {resources:?}"
            );
        }
        if resources.contains(&"configmaps".to_string()) {
            assert_eq!(verbs, ["get"], "configmaps: regression suites are read only");
        }
        if resources.contains(&"secrets".to_string()) {
            assert_eq!(verbs, ["get"], "secrets: existence checks only without an admin key");
        }
        if resources.contains(&"pods".to_string()) {
            assert!(!verbs.iter().any(|v| v == "patch" || v == "update"), "pods are read-only; only pods/status is patched");
        }
    }
    // The Lease is reachable in the release namespace only.
    let leader: Role = typed(find(&objects, "Role")[0]);
    assert_eq!(leader.metadata.namespace.as_deref(), Some("peregrine-system"));
    assert_eq!(leader.rules.unwrap()[0].resources.as_deref(), Some(&["leases".to_string()][..]));
}

#[test]
fn namespaced_install_with_service_monitor() {
    let objects = render(json!({
        "operator": {"watchNamespaces": ["models", "team-b"], "replicas": 2, "otlpEndpoint": "http://otel-collector:4318"},
        "metrics": {"serviceMonitor": {"enabled": true, "labels": {"release": "prom"}}},
        "serviceAccount": {"create": false, "name": "existing"}
    }));
    check_all(&objects);
    assert!(find(&objects, "ClusterRole").is_empty(), "watching listed namespaces needs no cluster-wide role");
    assert!(find(&objects, "ClusterRoleBinding").is_empty());
    assert!(find(&objects, "ServiceAccount").is_empty());
    let roles: Vec<Role> = find(&objects, "Role").into_iter().map(typed).collect();
    // One Role per watched namespace holds every controller rule (Secrets among them), and no
    // other namespace gets one: the leader-election Role in the release namespace is leases only.
    for ns in ["models", "team-b"] {
        let role = roles.iter().find(|r| r.metadata.namespace.as_deref() == Some(ns)).unwrap_or_else(|| panic!("no Role in {ns}"));
        let rules = role.rules.clone().unwrap();
        assert!(rules.iter().any(|r| r.resources.as_ref().is_some_and(|res| res.contains(&"secrets".to_string()))), "{ns}: {rules:?}");
    }
    for role in &roles {
        let ns = role.metadata.namespace.as_deref().unwrap();
        let reads_secrets = role.rules.iter().flatten().any(|r| r.resources.iter().flatten().any(|res| res == "secrets"));
        assert_eq!(reads_secrets, ["models", "team-b"].contains(&ns), "Secret access in {ns}");
    }
    assert_eq!(roles.len(), 3, "one per watched namespace and the leader-election Role");
    let bindings: Vec<RoleBinding> = find(&objects, "RoleBinding").into_iter().map(typed).collect();
    assert_eq!(bindings.len(), 3);
    assert!(bindings.iter().all(|b| b.subjects.as_ref().unwrap()[0].name == "existing"));
    assert!(bindings.iter().all(|b| b.subjects.as_ref().unwrap()[0].namespace.as_deref() == Some("peregrine-system")));
    let deployment: Deployment = typed(find(&objects, "Deployment")[0]);
    let spec = deployment.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    let args = spec.template.spec.unwrap().containers[0].args.clone().unwrap();
    let watched: Vec<&String> = args.iter().filter(|a| a.starts_with("--watch-namespace")).collect();
    assert_eq!(watched, ["--watch-namespace=models", "--watch-namespace=team-b"], "{args:?}");
    assert!(args.contains(&"--otlp-endpoint=http://otel-collector:4318".to_string()), "{args:?}");
    assert_eq!(find(&objects, "ServiceMonitor")[0]["metadata"]["labels"]["release"], "prom");
}

#[test]
fn an_empty_namespace_list_watches_everything_through_one_cluster_role() {
    let objects = render(json!({"operator": {"watchNamespaces": []}}));
    check_all(&objects);
    assert_eq!(find(&objects, "ClusterRole").len(), 1);
    assert_eq!(find(&objects, "ClusterRoleBinding").len(), 1);
    let roles: Vec<Role> = find(&objects, "Role").into_iter().map(typed).collect();
    assert_eq!(roles.len(), 1, "only the leader-election Role");
    assert_eq!(roles[0].metadata.name.as_deref(), Some("peregrine-leader-election"));
}

#[test]
fn chart_crds_parse_as_crds() {
    let text = std::fs::read_to_string(repo_root().join("charts/peregrine/crds/peregrine-crds.yaml")).unwrap();
    let mut names = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(doc).unwrap();
        let crd: CustomResourceDefinition = typed(&value);
        names.push(crd.metadata.name.unwrap());
    }
    assert_eq!(names, ["modeldeployments.serving.peregrine.dev", "loraadapters.serving.peregrine.dev"]);
}

#[test]
fn images_run_as_a_numeric_non_root_user() {
    for dockerfile in ["operator/Dockerfile", "agent/Dockerfile"] {
        let text = std::fs::read_to_string(repo_root().join(dockerfile)).unwrap();
        let user = text.lines().filter_map(|l| l.trim().strip_prefix("USER ")).last().unwrap_or_else(|| panic!("{dockerfile}: no USER"));
        for id in user.trim().split(':') {
            let id: u32 = id.parse().unwrap_or_else(|_| panic!("{dockerfile}: USER {user} is not numeric (runAsNonRoot refuses names)"));
            assert_ne!(id, 0, "{dockerfile}: USER {user} is root");
        }
    }
}

#[test]
fn values_are_checked_against_the_schema() {
    // values.yaml itself passes (lint --strict validates it against values.schema.json) ...
    assert!(try_render(json!({})).is_ok());
    // ... and what a new team gets wrong is refused by Helm, naming the key.
    for (values, key) in [
        (json!({"operator": {"replicas": "two"}}), "replicas"),
        // The old single-namespace key is gone: refused by name rather than silently ignored.
        (json!({"operator": {"watchNamespace": "models"}}), "watchNamespace"),
        (json!({"operator": {"watchNamespaces": "models"}}), "watchNamespaces"),
        (json!({"agent": {"port": 70000}}), "port"),
        (json!({"operator": {"watchNamespaces": ["models", "Models_Prod"]}}), "watchNamespaces"),
        (json!({"metrics": {"serviceMonitor": {"interval": "soon"}}}), "interval"),
    ] {
        let err = try_render(values.clone()).expect_err(&values.to_string());
        assert!(err.contains(key), "{values}: {err}");
    }
}

#[test]
fn operator_pods_have_a_disruption_budget_that_never_blocks_a_drain() {
    let objects = render(json!({}));
    check_all(&objects);
    let pdb: PodDisruptionBudget = typed(find(&objects, "PodDisruptionBudget")[0]);
    let spec = pdb.spec.unwrap();
    assert_eq!(spec.max_unavailable, Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1)));
    assert!(spec.min_available.is_none(), "minAvailable 1 with one replica would block node drains");
    let deployment: Deployment = typed(find(&objects, "Deployment")[0]);
    let pod_labels = deployment.spec.unwrap().template.metadata.unwrap().labels.unwrap();
    for (k, v) in spec.selector.unwrap().match_labels.unwrap() {
        assert_eq!(pod_labels.get(&k), Some(&v), "the budget selects the operator pods");
    }
    assert!(find(&render(json!({"podDisruptionBudget": {"enabled": false}})), "PodDisruptionBudget").is_empty());
}

#[test]
fn agent_pod_monitor_is_skipped_where_prometheus_operator_is_not_installed() {
    // Offline (Helm's default capabilities) and on a cluster whose discovery has no
    // monitoring.coreos.com/v1: enabling the PodMonitor must not render an object the API server
    // would refuse.
    let values = json!({"metrics": {"agentPodMonitor": {"enabled": true}}});
    assert!(find(&render(values.clone()), "PodMonitor").is_empty());
    let objects = render_in_cluster(values, &[]);
    check_all(&objects);
    assert!(find(&objects, "PodMonitor").is_empty());
    assert_eq!(find(&objects, "Deployment").len(), 1, "the rest of the chart renders");
}

#[test]
fn agent_pod_monitor_is_rendered_where_the_pod_monitor_crd_is_installed() {
    let pod_monitor = ["monitoring.coreos.com/v1/PodMonitor"];
    let objects = render_in_cluster(json!({"metrics": {"agentPodMonitor": {"enabled": true, "labels": {"release": "prom"}}}}), &pod_monitor);
    check_all(&objects);
    let monitors = find(&objects, "PodMonitor");
    assert_eq!(monitors.len(), 1);
    let monitor = monitors[0];
    assert_eq!(monitor["metadata"]["namespace"], "peregrine-system");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prom");
    assert_eq!(monitor["spec"]["namespaceSelector"], json!({"any": true}), "every namespace when the list is empty");
    // It selects the pods the operator creates, by the labels it puts on them.
    let md: peregrine_crds::ModelDeployment = serde_json::from_value(json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment",
        "metadata": {"name": "smol", "namespace": "models"},
        "spec": {"model": {"uri": "pvc://models/smol.gguf"}}
    })).unwrap();
    let pod_labels = peregrine_operator::desired::labels(&md);
    for (k, v) in monitor["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(pod_labels.get(k).map(String::as_str), v.as_str(), "{k}");
    }

    // Watching a list of namespaces, it scrapes exactly those.
    let objects = render_in_cluster(json!({"metrics": {"agentPodMonitor": {"enabled": true}}, "operator": {"watchNamespaces": ["models", "team-b"]}}), &pod_monitor);
    assert_eq!(find(&objects, "PodMonitor")[0]["spec"]["namespaceSelector"], json!({"matchNames": ["models", "team-b"]}));

    // Installed but not asked for: nothing.
    assert!(find(&render_in_cluster(json!({}), &pod_monitor), "PodMonitor").is_empty());
}

#[test]
fn dashboards_are_opt_in_config_maps_for_the_grafana_sidecar() {
    assert!(find(&render(json!({})), "ConfigMap").is_empty(), "off by default");
    let objects = render(json!({"dashboards": {"enabled": true, "namespace": "monitoring", "annotations": {"grafana_folder": "Peregrine"}}}));
    check_all(&objects);
    let maps: Vec<k8s_openapi::api::core::v1::ConfigMap> = find(&objects, "ConfigMap").into_iter().map(typed).collect();
    let mut files = Vec::new();
    for map in &maps {
        assert_eq!(map.metadata.namespace.as_deref(), Some("monitoring"));
        assert_eq!(map.metadata.labels.as_ref().unwrap().get("grafana_dashboard").map(String::as_str), Some("1"));
        assert_eq!(map.metadata.annotations.as_ref().unwrap().get("grafana_folder").map(String::as_str), Some("Peregrine"));
        for (file, text) in map.data.as_ref().unwrap() {
            // The dashboard as docs/dashboards has it, byte for byte.
            let source = std::fs::read_to_string(repo_root().join("docs/dashboards").join(file)).unwrap();
            assert_eq!(text.trim_end(), source.trim_end(), "{file}");
            files.push(file.clone());
        }
    }
    files.sort();
    assert_eq!(files, ["peregrine-agent.json", "peregrine-operator.json"]);
}

/// `agent.adminApiKeySecret` gives the operator its admin key from that Secret and lets it apply
/// the per-deployment agent Secrets (create/patch, still no list/watch).
#[test]
fn admin_key_secret_reaches_the_operator() {
    let objects = render(json!({"agent": {"adminApiKeySecret": "peregrine-admin"}}));
    check_all(&objects);
    let deployment: Deployment = typed(find(&objects, "Deployment")[0]);
    let container = &deployment.spec.unwrap().template.spec.unwrap().containers[0];
    let env = container.env.clone().unwrap();
    let key = env.iter().find(|e| e.name == "PEREGRINE_ADMIN_API_KEY").expect("PEREGRINE_ADMIN_API_KEY");
    let from = key.value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
    assert_eq!((from.name.as_str(), from.key.as_str()), ("peregrine-admin", "admin-api-key"));

    let role: ClusterRole = typed(find(&objects, "ClusterRole")[0]);
    let secret_verbs: Vec<String> = role
        .rules
        .unwrap()
        .into_iter()
        .filter(|r| r.resources.as_ref().is_some_and(|res| res.contains(&"secrets".to_string())))
        .flat_map(|r| r.verbs)
        .collect();
    assert_eq!(secret_verbs, ["get", "create", "patch"]);

    // Not set: no key variable.
    let objects = render(json!({}));
    let deployment: Deployment = typed(find(&objects, "Deployment")[0]);
    let env = deployment.spec.unwrap().template.spec.unwrap().containers[0].env.clone().unwrap();
    assert!(!env.iter().any(|e| e.name == "PEREGRINE_ADMIN_API_KEY"));
}
