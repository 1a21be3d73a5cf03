//! ModelDeployment → the Deployment of agent pods.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, HTTPGetAction, Lifecycle, LifecycleHandler, PodReadinessGate, PodSpec, PodTemplateSpec,
    Probe, ResourceRequirements, SleepAction,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use peregrine_crds::{ModelDeployment, SourceUri, ADAPTERS_LOADED_CONDITION};

use super::{admin_key, args::agent_args, labels, model, selector_labels};
use crate::config::OperatorConfig;

/// Seconds the pod keeps serving after SIGTERM would be sent, so that endpoints controllers and
/// load balancers stop routing to it first.
const PRE_STOP_SLEEP_SECONDS: i64 = 5;

/// `http` always; `grpc` too for encoder tasks. Probes stay on HTTP: `/ready` and gRPC health report
/// the same readiness, and the HTTP port exists for every task.
fn container_ports(md: &ModelDeployment, port: i32) -> Vec<ContainerPort> {
    let named = |name: &str, container_port: i32| ContainerPort { name: Some(name.into()), container_port, protocol: Some("TCP".into()), ..Default::default() };
    let mut ports = vec![named("http", port)];
    if super::serves_grpc(md) {
        ports.push(named("grpc", super::AGENT_GRPC_PORT));
    }
    ports
}

/// The Deployment for `md`, whose model URI parsed as `uri`. Owned by `md`, so deleting it cascades.
pub fn desired_deployment(md: &ModelDeployment, uri: &SourceUri, config: &OperatorConfig) -> Deployment {
    let spec = &md.spec;
    let plan = model::plan(spec, uri, &config.fetch_images);
    let port = config.agent_port;

    let http_probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction { path: Some(path.into()), port: IntOrString::String("http".into()), ..Default::default() }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(5),
        ..Default::default()
    };

    let container = Container {
        name: "agent".into(),
        image: Some(spec.image.clone().unwrap_or_else(|| config.agent_image.clone())),
        image_pull_policy: spec.image_pull_policy.map(|p| p.as_str().to_string()),
        args: Some(agent_args(md, &plan.model_path, port)),
        ports: Some(container_ports(md, port)),
        resources: Some(resources(md)),
        // Loading a large model takes minutes: the startup probe allows `startup_seconds`, and
        // liveness only starts once it has passed, so a slow load is never killed as a hang.
        startup_probe: Some(http_probe("/health", 10, (config.startup_seconds / 10).max(1))),
        liveness_probe: Some(http_probe("/health", 10, 3)),
        readiness_probe: Some(http_probe("/ready", 5, 3)),
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler { sleep: Some(SleepAction { seconds: PRE_STOP_SLEEP_SECONDS }), ..Default::default() }),
            ..Default::default()
        }),
        volume_mounts: non_empty(plan.mounts),
        // The operator's admin key, so its adapter pushes are accepted and tenants' are not.
        env: config.admin_api_key.as_ref().map(|_| vec![admin_key::agent_env(md)]),
        ..Default::default()
    };

    let pod = PodSpec {
        containers: vec![container],
        init_containers: plan.init_container.map(|c| vec![c]),
        volumes: non_empty(plan.volumes),
        // Pods only take traffic once the operator has loaded every adapter of the deployment.
        readiness_gates: Some(vec![PodReadinessGate { condition_type: ADAPTERS_LOADED_CONDITION.into() }]),
        termination_grace_period_seconds: Some(config.drain_seconds + PRE_STOP_SLEEP_SECONDS + 10),
        node_selector: (!spec.resources.node_selector.is_empty()).then(|| spec.resources.node_selector.clone()),
        tolerations: non_empty(spec.resources.tolerations.clone()),
        affinity: spec.resources.affinity.clone(),
        priority_class_name: spec.resources.priority_class_name.clone(),
        image_pull_secrets: non_empty(spec.image_pull_secrets.clone()),
        ..Default::default()
    };

    Deployment {
        metadata: ObjectMeta {
            name: md.metadata.name.clone(),
            namespace: md.metadata.namespace.clone(),
            labels: Some(labels(md)),
            owner_references: md.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(spec.replicas),
            selector: LabelSelector { match_labels: Some(selector_labels(md)), ..Default::default() },
            // Never drop below the current serving capacity during an update; GPUs for one extra pod
            // are the price.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            progress_deadline_seconds: Some(config.startup_seconds + 600),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels(md)), ..Default::default() }),
                spec: Some(pod),
            },
            ..Default::default()
        }),
        status: None,
    }
}

/// The container's resources: what the user wrote, plus the GPUs as both request and limit (extended
/// resources cannot be overcommitted).
fn resources(md: &ModelDeployment) -> ResourceRequirements {
    let r = &md.spec.resources;
    let mut out = r.container.clone().unwrap_or_default();
    if r.gpus > 0 {
        let gpus = Quantity(r.gpus.to_string());
        out.limits.get_or_insert_with(BTreeMap::new).insert(r.gpu_resource_name.clone(), gpus.clone());
        out.requests.get_or_insert_with(BTreeMap::new).insert(r.gpu_resource_name.clone(), gpus);
    }
    out
}

fn non_empty<T>(v: Vec<T>) -> Option<Vec<T>> {
    (!v.is_empty()).then_some(v)
}
