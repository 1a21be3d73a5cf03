//! The rollout controller against a mock Kubernetes API service (tower-test) that keeps Deployments,
//! pods and the ModelDeployment's status in memory, with a "kubelet" step the test runs to make
//! applied Deployments ready. The regression suite is a scripted fake here (the runner itself is
//! tested against HTTP servers in `rollout_regression.rs`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use http::{Request, Response, StatusCode};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStatus};
use k8s_openapi::api::core::v1::{Container, Pod, PodCondition, PodSpec, PodStatus, PodTemplateSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, Time};
use kube::client::Body;
use kube::Client;
use peregrine_crds::{
    Expectation, ExpectationKind, LatencyComparison, ModelDeployment, ModelDeploymentSpec, ModelSource, RegressionCase, RegressionSpec,
    RegressionSuite, RegressionThresholds, RolloutSpec, RolloutStep, RolloutStrategy, CONDITION_ROLLOUT_FAILED,
    CONDITION_ROLLOUT_PAUSED, CONDITION_ROLLOUT_PROGRESSING, DEPLOYMENT_LABEL,
};
use peregrine_operator::regression::judge::Verdict;
use peregrine_operator::regression::runner::{report, CaseOutcome, RunError, SuiteReport, SuiteTarget};
use peregrine_operator::rollout::objects::{canary_name, TRACK_LABEL};
use peregrine_operator::rollout::revision::REVISION_ANNOTATION;
use peregrine_operator::rollout::{reconcile, RolloutContext, SuiteRunner};
use serde_json::{json, Value};

const NS: &str = "serving";
const NAME: &str = "llm";

/// The in-memory cluster behind the mock API.
#[derive(Default)]
struct Cluster {
    deployments: BTreeMap<String, Deployment>,
    pods: Vec<Pod>,
    md_status: Value,
    /// LoraAdapter objects (JSON) the API lists.
    adapters: Vec<Value>,
    /// "VERB resource/name" of every write, in order.
    writes: Vec<String>,
}

type Shared = Arc<Mutex<Cluster>>;

fn ok(body: &Value) -> Response<Body> {
    Response::builder().status(200).body(Body::from(serde_json::to_vec(body).unwrap())).unwrap()
}

fn not_found(what: &str) -> Response<Body> {
    let status = json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404, "message": format!("{what} not found")});
    Response::builder().status(StatusCode::NOT_FOUND).body(Body::from(serde_json::to_vec(&status).unwrap())).unwrap()
}

/// `k=v` and `!k` terms, comma-separated.
fn matches(selector: &str, labels: &BTreeMap<String, String>) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| match term.strip_prefix('!') {
        Some(key) => !labels.contains_key(key),
        None => {
            let (k, v) = term.split_once('=').unwrap();
            labels.get(k).map(String::as_str) == Some(v)
        }
    })
}

fn query(req: &Request<Body>, key: &str) -> Option<String> {
    req.uri().query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.replace("%3D", "=").replace("%2C", ",").replace("%21", "!").replace("%2F", "/"))
    })
}

async fn serve(cluster: Shared, mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>) {
    while let Some((req, send)) = handle.next_request().await {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let selector = query(&req, "labelSelector").unwrap_or_default();
        let body = req.into_body().collect_bytes().await.unwrap();
        let mut c = cluster.lock().unwrap();
        let deployments = format!("/apis/apps/v1/namespaces/{NS}/deployments/");
        let md_status = format!("/apis/serving.peregrine.dev/v1alpha1/namespaces/{NS}/modeldeployments/{NAME}/status");
        let response = if let Some(name) = path.strip_prefix(&deployments) {
            match method.as_str() {
                "GET" => match c.deployments.get(name) {
                    Some(d) => ok(&serde_json::to_value(d).unwrap()),
                    None => not_found(name),
                },
                "PATCH" => {
                    let mut applied: Deployment = serde_json::from_slice(&body).unwrap();
                    let previous = c.deployments.get(name).cloned();
                    let generation = previous.as_ref().and_then(|p| p.metadata.generation).unwrap_or(0);
                    let changed = previous.as_ref().map(|p| p.spec != applied.spec).unwrap_or(true);
                    applied.metadata.generation = Some(if changed { generation + 1 } else { generation });
                    applied.status = previous.and_then(|p| p.status);
                    c.writes.push(format!("apply {name}"));
                    c.deployments.insert(name.to_string(), applied.clone());
                    ok(&serde_json::to_value(&applied).unwrap())
                }
                "DELETE" => {
                    c.writes.push(format!("delete {name}"));
                    c.pods.retain(|p| !p.metadata.name.as_deref().unwrap_or_default().starts_with(&format!("{name}-pod")));
                    match c.deployments.remove(name) {
                        Some(_) => ok(&json!({"apiVersion": "v1", "kind": "Status", "status": "Success", "details": {"name": name}})),
                        None => not_found(name),
                    }
                }
                m => panic!("unexpected {m} {path}"),
            }
        } else if path == format!("/api/v1/namespaces/{NS}/pods") {
            let items: Vec<&Pod> = c.pods.iter().filter(|p| matches(&selector, p.metadata.labels.as_ref().unwrap())).collect();
            ok(&json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}))
        } else if path == format!("/apis/serving.peregrine.dev/v1alpha1/namespaces/{NS}/loraadapters") {
            ok(&json!({"apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "LoraAdapterList", "metadata": {}, "items": c.adapters}))
        } else if path == md_status {
            let patch: Value = serde_json::from_slice(&body).unwrap();
            c.writes.push("status".into());
            c.md_status = patch["status"].clone();
            ok(&json!({"apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": NAME, "namespace": NS},
                "spec": {"model": {"uri": "file:///m.gguf"}}, "status": patch["status"]}))
        } else {
            panic!("unexpected {method} {path}")
        };
        drop(c);
        send.send_response(response);
    }
}

/// The kubelet and the Deployment controller in one: every Deployment is rolled out and ready, with
/// one pod per replica carrying its template's labels.
fn settle(cluster: &Shared) {
    let mut c = cluster.lock().unwrap();
    let mut pods = Vec::new();
    for (i, (name, d)) in c.deployments.iter_mut().enumerate() {
        let replicas = d.spec.as_ref().unwrap().replicas.unwrap();
        d.status = Some(DeploymentStatus {
            observed_generation: d.metadata.generation,
            replicas: Some(replicas),
            updated_replicas: Some(replicas),
            available_replicas: Some(replicas),
            ready_replicas: Some(replicas),
            ..Default::default()
        });
        let labels = d.spec.as_ref().unwrap().template.metadata.as_ref().unwrap().labels.clone();
        for j in 0..replicas {
            pods.push(Pod {
                metadata: ObjectMeta { name: Some(format!("{name}-pod-{j}")), labels: labels.clone(), ..Default::default() },
                spec: Some(PodSpec::default()),
                status: Some(PodStatus {
                    pod_ip: Some(format!("10.0.{i}.{j}")),
                    conditions: Some(vec![PodCondition { type_: "Ready".into(), status: "True".into(), ..Default::default() }]),
                    ..Default::default()
                }),
            });
        }
    }
    c.pods = pods;
}

/// Scripted suite results; records where each run was sent.
#[derive(Default)]
struct ScriptedRunner {
    results: Mutex<VecDeque<bool>>,
    targets: Mutex<Vec<SuiteTarget>>,
}

impl SuiteRunner for ScriptedRunner {
    fn run<'a>(&'a self, target: SuiteTarget, cases: Vec<RegressionCase>, thresholds: RegressionThresholds) -> BoxFuture<'a, Result<SuiteReport, RunError>> {
        Box::pin(async move {
            self.targets.lock().unwrap().push(target);
            let passed = self.results.lock().unwrap().pop_front().expect("an unscripted regression run");
            let outcomes = cases
                .iter()
                .map(|c| CaseOutcome {
                    name: c.name.clone(),
                    verdict: Verdict {
                        passed,
                        reason: if passed { String::new() } else { "agreement with stable 0.20 is below 1.00".into() },
                        expected: "stable text".into(),
                        got: "canary text".into(),
                        agreement: Some(if passed { 1.0 } else { 0.2 }),
                    },
                    error: false,
                })
                .collect();
            Ok(report(outcomes, LatencyComparison { latency_factor: Some(1.0), ..Default::default() }, &thresholds))
        })
    }
}

fn model_deployment(image: &str) -> ModelDeployment {
    let mut md = ModelDeployment::new(
        NAME,
        ModelDeploymentSpec {
            model: ModelSource { uri: "file:///m.gguf".into(), ..Default::default() },
            image: Some(image.into()),
            replicas: 2,
            rollout: Some(RolloutSpec {
                strategy: RolloutStrategy::Canary,
                steps: vec![
                    RolloutStep { canary_replicas: Some(1), canary_percent: None, pause_seconds: 0, run_regression: true },
                    RolloutStep { canary_replicas: None, canary_percent: Some(100), pause_seconds: 0, run_regression: false },
                ],
                regression: Some(RegressionSpec {
                    suite: RegressionSuite {
                        cases: vec![RegressionCase {
                            name: "same".into(),
                            prompt: Some("hello".into()),
                            expect: Expectation { kind: ExpectationKind::SameAsStable, ..Default::default() },
                            ..Default::default()
                        }],
                        config_map_ref: None,
                    },
                    thresholds: RegressionThresholds::default(),
                }),
                max_failures: 0,
                progress_deadline_seconds: 600,
                auto_promote: true,
            }),
            ..Default::default()
        },
    );
    md.metadata.namespace = Some(NS.into());
    md.metadata.generation = Some(1);
    md
}

/// What the ModelDeployment controller would build from the spec (only the image matters here).
fn desired(md: &ModelDeployment) -> Deployment {
    let labels = BTreeMap::from([(DEPLOYMENT_LABEL.to_string(), NAME.to_string())]);
    Deployment {
        metadata: ObjectMeta { name: Some(NAME.into()), namespace: Some(NS.into()), labels: Some(labels.clone()), ..Default::default() },
        spec: Some(DeploymentSpec {
            replicas: Some(md.spec.replicas),
            selector: LabelSelector { match_labels: Some(labels.clone()), ..Default::default() },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels), ..Default::default() }),
                spec: Some(PodSpec {
                    containers: vec![Container { name: "agent".into(), image: md.spec.image.clone(), ..Default::default() }],
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        status: None,
    }
}

struct Harness {
    cluster: Shared,
    runner: Arc<ScriptedRunner>,
    ctx: RolloutContext,
    md: ModelDeployment,
}

impl Harness {
    fn new(image: &str) -> Self {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let cluster: Shared = Arc::default();
        tokio::spawn(serve(cluster.clone(), handle));
        let runner = Arc::new(ScriptedRunner::default());
        let ctx = RolloutContext {
            client: Client::new(service, NS),
            runner: runner.clone(),
            agent_port: 8000,
            recorder: None,
        };
        Harness { cluster, runner, ctx, md: model_deployment(image) }
    }

    /// One reconciliation; the status it wrote is read back into the object, as a watch would.
    async fn reconcile(&mut self) -> peregrine_operator::rollout::Reconciled {
        let out = reconcile(&self.md, desired(&self.md), &self.ctx).await.unwrap();
        let status = self.cluster.lock().unwrap().md_status.clone();
        let mut merged = serde_json::to_value(self.md.status.clone().unwrap_or_default()).unwrap();
        merged["rollout"] = status["rollout"].clone();
        merged["conditions"] = status["conditions"].clone();
        self.md.status = Some(serde_json::from_value(merged).unwrap());
        out
    }

    fn deployment(&self, name: &str) -> Option<Deployment> {
        self.cluster.lock().unwrap().deployments.get(name).cloned()
    }

    fn image(&self, name: &str) -> Option<String> {
        self.deployment(name)?.spec?.template.spec?.containers[0].image.clone()
    }

    fn condition(&self, type_: &str) -> (String, String, String) {
        let status = self.md.status.as_ref().unwrap();
        let c = status.conditions.iter().find(|c| c.type_ == type_).unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    fn step(&self) -> Option<i32> {
        self.md.status.as_ref()?.rollout.as_ref()?.current_step
    }

    fn writes(&self) -> Vec<String> {
        std::mem::take(&mut self.cluster.lock().unwrap().writes)
    }

    /// Deploys `v1` and lets it settle, then changes the image to `v2`.
    async fn deployed_then_changed(&mut self) {
        self.reconcile().await;
        settle(&self.cluster);
        self.reconcile().await;
        assert_eq!(self.image(NAME).as_deref(), Some("agent:v1"));
        assert!(self.deployment(&canary_name(NAME)).is_none(), "the first deployment has no canary");
        self.writes();
        self.md.spec.image = Some("agent:v2".into());
        self.md.metadata.generation = Some(2);
    }
}

#[tokio::test]
async fn canary_steps_advance_and_promotion_patches_stable() {
    let mut h = Harness::new("agent:v1");
    h.deployed_then_changed().await;
    let v1_revision = h.deployment(NAME).unwrap().metadata.annotations.unwrap()[REVISION_ANNOTATION].clone();

    // Step 1: a canary Deployment of the new revision next to the untouched stable one.
    h.reconcile().await;
    let canary = h.deployment(&canary_name(NAME)).expect("canary created");
    let revision = canary.metadata.annotations.as_ref().unwrap()[REVISION_ANNOTATION].clone();
    assert_ne!(revision, v1_revision);
    let spec = canary.spec.as_ref().unwrap();
    assert_eq!(spec.replicas, Some(1));
    assert_eq!(spec.selector.match_labels.as_ref().unwrap()[TRACK_LABEL], "canary");
    let pod_labels = spec.template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
    assert_eq!(pod_labels[DEPLOYMENT_LABEL], NAME, "canary pods are behind the deployment's Service");
    assert_eq!(h.image(&canary_name(NAME)).as_deref(), Some("agent:v2"));
    assert_eq!(h.image(NAME).as_deref(), Some("agent:v1"), "stable keeps serving the old revision");
    assert_eq!(h.deployment(NAME).unwrap().spec.unwrap().replicas, Some(2), "stable capacity kept");
    assert_eq!(h.step(), Some(0));
    assert_eq!(h.condition(CONDITION_ROLLOUT_PROGRESSING).1, "CanaryStarting");

    // Canary ready: the suite runs against a canary pod with a stable pod as reference, and passes.
    settle(&h.cluster);
    h.runner.results.lock().unwrap().push_back(true);
    h.reconcile().await;
    let targets = h.runner.targets.lock().unwrap().clone();
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0].canary, "http://10.0.1.0:8000", "the canary pod");
    assert_eq!(targets[0].stable.as_deref(), Some("http://10.0.0.0:8000"), "a stable pod");
    assert_eq!(targets[0].model, NAME);
    assert_eq!(h.step(), Some(1));
    let results = &h.md.status.as_ref().unwrap().rollout.as_ref().unwrap().step_results;
    assert!(results[0].passed && results[0].cases == 1);

    // Step 2 (100%): the canary grows to 2; once ready the step (no regression) passes and stable is
    // patched with the new template while the canary still serves.
    h.reconcile().await;
    assert_eq!(h.deployment(&canary_name(NAME)).unwrap().spec.unwrap().replicas, Some(2));
    assert_eq!(h.condition(CONDITION_ROLLOUT_PROGRESSING).1, "CanaryStarting", "the grown canary is not ready yet");
    settle(&h.cluster);
    h.writes();
    h.reconcile().await;
    assert_eq!(h.image(NAME).as_deref(), Some("agent:v2"), "promotion patches the stable Deployment");
    assert_eq!(h.deployment(NAME).unwrap().metadata.annotations.unwrap()[REVISION_ANNOTATION], revision);
    assert!(h.deployment(&canary_name(NAME)).is_some(), "canary serves until stable has rolled out");
    assert_eq!(h.condition(CONDITION_ROLLOUT_PROGRESSING).1, "Promoting");

    // Stable rolled out: the canary goes, the new revision is current.
    settle(&h.cluster);
    h.reconcile().await;
    assert!(h.deployment(&canary_name(NAME)).is_none(), "canary removed after promotion");
    assert!(h.writes().contains(&format!("delete {}", canary_name(NAME))));
    let status = h.md.status.as_ref().unwrap().rollout.clone().unwrap();
    assert_eq!(status.current_revision.as_deref(), Some(revision.as_str()));
    assert_eq!(status.update_revision.as_deref(), Some(revision.as_str()));
    assert_eq!(h.condition(CONDITION_ROLLOUT_PROGRESSING).0, "False");
    assert_eq!(h.runner.targets.lock().unwrap().len(), 1, "one regression run in all");
}

#[tokio::test]
async fn failed_regression_deletes_the_canary_and_leaves_stable_alone() {
    let mut h = Harness::new("agent:v1");
    h.deployed_then_changed().await;
    h.reconcile().await;
    settle(&h.cluster);
    h.runner.results.lock().unwrap().push_back(false);
    h.writes();
    h.reconcile().await;

    assert!(h.deployment(&canary_name(NAME)).is_none(), "rollback deletes the canary");
    let writes = h.writes();
    assert!(writes.contains(&format!("delete {}", canary_name(NAME))), "{writes:?}");
    assert_eq!(h.image(NAME).as_deref(), Some("agent:v1"), "stable untouched");
    let (status, reason, message) = h.condition(CONDITION_ROLLOUT_FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "RegressionFailed"));
    assert!(message.contains("same") && message.contains("0.20"), "failing cases named: {message}");
    let results = &h.md.status.as_ref().unwrap().rollout.as_ref().unwrap().step_results;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].mismatches[0].case, "same");

    // No retry until the spec changes.
    h.reconcile().await;
    h.reconcile().await;
    assert!(h.deployment(&canary_name(NAME)).is_none());
    assert_eq!(h.runner.targets.lock().unwrap().len(), 1);
    assert_eq!(h.condition(CONDITION_ROLLOUT_FAILED).0, "True");

    // A new spec is rolled out again.
    h.md.spec.image = Some("agent:v3".into());
    h.reconcile().await;
    assert_eq!(h.image(&canary_name(NAME)).as_deref(), Some("agent:v3"));
    assert_eq!(h.condition(CONDITION_ROLLOUT_FAILED).0, "False");
}

#[tokio::test]
async fn edit_mid_rollout_moves_the_canary_to_the_new_revision() {
    let mut h = Harness::new("agent:v1");
    h.deployed_then_changed().await;
    h.reconcile().await;
    let first = h.deployment(&canary_name(NAME)).unwrap().metadata.annotations.unwrap()[REVISION_ANNOTATION].clone();
    h.md.spec.image = Some("agent:v3".into());
    h.reconcile().await;
    let canary = h.deployment(&canary_name(NAME)).unwrap();
    assert_ne!(canary.metadata.annotations.unwrap()[REVISION_ANNOTATION], first);
    assert_eq!(h.image(&canary_name(NAME)).as_deref(), Some("agent:v3"));
    assert_eq!(h.image(NAME).as_deref(), Some("agent:v1"));
    assert_eq!(h.step(), Some(0));
}

/// Moves a recorded rollout time `secs` into the past, as if that long had gone by.
fn backdate(h: &mut Harness, field: fn(&mut peregrine_crds::RolloutStatus) -> &mut Option<Time>, secs: i64) {
    let status = h.md.status.as_mut().unwrap().rollout.as_mut().unwrap();
    let when = field(status).as_mut().expect("the time is recorded");
    when.0 = when.0 - jiff::SignedDuration::from_secs(secs);
}

#[tokio::test]
async fn never_ready_canary_is_rolled_back_after_the_progress_deadline_whatever_max_failures() {
    let mut h = Harness::new("agent:v1");
    h.md.spec.rollout.as_mut().unwrap().max_failures = 5;
    h.deployed_then_changed().await;
    h.reconcile().await;
    assert!(h.deployment(&canary_name(NAME)).is_some());
    // The canary never becomes ready (no settle); 599 s in, it is still waited for.
    backdate(&mut h, |s| &mut s.current_step_started_at, 599);
    h.reconcile().await;
    assert!(h.deployment(&canary_name(NAME)).is_some());
    assert_eq!(h.condition(CONDITION_ROLLOUT_PROGRESSING).1, "CanaryStarting");

    backdate(&mut h, |s| &mut s.current_step_started_at, 2);
    h.writes();
    h.reconcile().await;
    assert!(h.deployment(&canary_name(NAME)).is_none(), "rollback deletes the canary");
    assert!(h.writes().contains(&format!("delete {}", canary_name(NAME))));
    assert_eq!(h.image(NAME).as_deref(), Some("agent:v1"), "stable untouched");
    let (status, reason, message) = h.condition(CONDITION_ROLLOUT_FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "CanaryNotReady"));
    assert!(message.contains("progressDeadlineSeconds"), "{message}");
    let rollout = h.md.status.as_ref().unwrap().rollout.clone().unwrap();
    assert_eq!(rollout.failures, 0, "not a failed regression run");
    assert!(h.runner.targets.lock().unwrap().is_empty(), "no suite against a canary that never was ready");
}

#[tokio::test]
async fn pause_and_regression_wait_for_the_canary_to_be_ready() {
    let mut h = Harness::new("agent:v1");
    h.md.spec.rollout.as_mut().unwrap().steps[0].pause_seconds = 300;
    h.deployed_then_changed().await;
    h.reconcile().await;
    assert_eq!(h.md.status.as_ref().unwrap().rollout.as_ref().unwrap().canary_ready_at, None);
    // A slow canary: ready only 400 s after the step started, longer than the pause.
    backdate(&mut h, |s| &mut s.current_step_started_at, 400);
    settle(&h.cluster);
    h.reconcile().await;
    let rollout = h.md.status.as_ref().unwrap().rollout.clone().unwrap();
    assert!(rollout.canary_ready_at.is_some(), "readiness recorded");
    assert!(h.runner.targets.lock().unwrap().is_empty(), "the pause starts at readiness, so no run yet");
    let (status, reason, _) = h.condition(CONDITION_ROLLOUT_PAUSED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "StepPause"));

    // The pause over, counted from readiness: the suite runs and the step passes.
    backdate(&mut h, |s| &mut s.canary_ready_at, 300);
    h.runner.results.lock().unwrap().push_back(true);
    h.reconcile().await;
    assert_eq!(h.runner.targets.lock().unwrap().len(), 1);
    assert_eq!(h.step(), Some(1));
    assert_eq!(h.md.status.as_ref().unwrap().rollout.as_ref().unwrap().canary_ready_at, None, "the next step's canary is not ready yet");
}

fn adapter(name: &str, deployment: &str, served_name: Option<&str>, deleting: bool) -> Value {
    let mut a = json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "LoraAdapter",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"deploymentRef": {"name": deployment}, "source": {"uri": "file:///a"}},
    });
    if let Some(served) = served_name {
        a["spec"]["servedName"] = json!(served);
    }
    if deleting {
        a["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        a["metadata"]["finalizers"] = json!(["serving.peregrine.dev/unload-adapter"]);
    }
    a
}

#[tokio::test]
async fn the_suite_runs_through_every_adapter_of_the_deployment() {
    let mut h = Harness::new("agent:v1");
    h.cluster.lock().unwrap().adapters = vec![
        adapter("sql", NAME, None, false),
        adapter("chat-v2", NAME, Some("chat"), false),
        adapter("theirs", "another-deployment", None, false),
        adapter("going", NAME, None, true),
    ];
    h.deployed_then_changed().await;
    h.reconcile().await;
    settle(&h.cluster);
    h.runner.results.lock().unwrap().push_back(true);
    h.reconcile().await;
    let targets = h.runner.targets.lock().unwrap().clone();
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0].adapters, vec!["sql".to_string(), "chat".to_string()], "served names of this deployment's live adapters");
}
