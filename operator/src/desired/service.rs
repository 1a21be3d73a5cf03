//! ModelDeployment → the Service in front of its ready agent pods.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Resource;
use peregrine_crds::ModelDeployment;

use super::{labels, selector_labels};

/// A ClusterIP Service named like `md`, on the agent's port. Only ready pods (model and adapters
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
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port,
                target_port: Some(IntOrString::String("http".into())),
                protocol: Some("TCP".into()),
                app_protocol: Some("http".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}
