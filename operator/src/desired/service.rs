//! ModelDeployment → the Service in front of its ready agent pods.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use peregrine_crds::ModelDeployment;

use super::{labels, selector_labels, serves_grpc, AGENT_GRPC_PORT};

/// `http` on `port`; for encoder tasks also `grpc` on [`AGENT_GRPC_PORT`] with `appProtocol: grpc`
/// (gateways and meshes then speak HTTP/2 to it).
fn service_ports(md: &ModelDeployment, port: i32) -> Vec<ServicePort> {
    let named = |name: &str, port: i32| ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::String(name.into())),
        protocol: Some("TCP".into()),
        app_protocol: Some(name.into()),
        ..Default::default()
    };
    let mut ports = vec![named("http", port)];
    if serves_grpc(md) {
        ports.push(named("grpc", AGENT_GRPC_PORT));
    }
    ports
}

/// A ClusterIP Service named like `md`, on the agent's port (and its gRPC port for encoders). Only ready pods (model and adapters
/// loaded) are endpoints.
pub fn desired_service(md: &ModelDeployment, port: i32) -> Service {
    Service {
        metadata: ObjectMeta {
            name: md.metadata.name.clone(),
            namespace: md.metadata.namespace.clone(),
            labels: Some(labels(md)),
            owner_references: md.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(selector_labels(md)),
            ports: Some(service_ports(md, port)),
            ..Default::default()
        }),
        status: None,
    }
}
