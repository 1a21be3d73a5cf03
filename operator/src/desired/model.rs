//! Getting the model (and adapter volumes) into the pod: volumes, mounts, and the fetch init container.

use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvFromSource, PersistentVolumeClaimVolumeSource, SecretEnvSource, Volume,
    VolumeMount,
};
use peregrine_crds::{ModelDeploymentSpec, ModelFormat, RemoteScheme, SourceUri};

use crate::config::FetchImages;

/// Where fetched models land (an `emptyDir`).
pub const MODEL_CACHE_DIR: &str = "/models";
/// Where PVCs are mounted: `/mnt/pvc/<claim>`.
pub const PVC_ROOT: &str = "/mnt/pvc";

/// What the pod needs for its model and adapter sources.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelPlan {
    /// Path of the model inside the agent container.
    pub model_path: String,
    pub volumes: Vec<Volume>,
    /// Mounts of the agent container.
    pub mounts: Vec<VolumeMount>,
    /// The fetch step for remote models.
    pub init_container: Option<Container>,
}

/// Plans the model volume for `uri` (already validated) plus the `adapterVolumes` claims.
pub fn plan(spec: &ModelDeploymentSpec, uri: &SourceUri, images: &FetchImages) -> ModelPlan {
    let mut plan = ModelPlan::default();
    let mut claims: Vec<String> = Vec::new();
    match uri {
        SourceUri::Pvc { claim, path } => {
            plan.model_path = format!("{PVC_ROOT}/{claim}/{path}");
            claims.push(claim.clone());
        }
        SourceUri::File { path } => plan.model_path = path.clone(),
        SourceUri::Remote { scheme, uri } => {
            let name = basename(uri);
            plan.model_path = format!("{MODEL_CACHE_DIR}/{name}");
            plan.volumes.push(Volume {
                name: "model-cache".into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            });
            let mount = VolumeMount { name: "model-cache".into(), mount_path: MODEL_CACHE_DIR.into(), ..Default::default() };
            plan.mounts.push(VolumeMount { read_only: Some(true), ..mount.clone() });
            plan.init_container = Some(fetch_container(*scheme, uri, &plan.model_path, is_folder(spec, uri), spec, images, mount));
        }
    }
    for claim in &spec.adapter_volumes {
        if !claims.contains(claim) {
            claims.push(claim.clone());
        }
    }
    for claim in claims {
        let volume = format!("pvc-{claim}");
        plan.volumes.push(Volume {
            name: volume.clone(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource { claim_name: claim.clone(), read_only: Some(true) }),
            ..Default::default()
        });
        plan.mounts.push(VolumeMount {
            name: volume,
            mount_path: format!("{PVC_ROOT}/{claim}"),
            read_only: Some(true),
            ..Default::default()
        });
    }
    plan
}

/// The last path segment of a URI (without query), the name the model gets in the cache.
fn basename(uri: &str) -> String {
    let without_query = uri.split(['?', '#']).next().unwrap_or(uri);
    without_query.trim_end_matches('/').rsplit('/').next().filter(|s| !s.is_empty()).unwrap_or("model").to_string()
}

/// A safetensors model is a folder; a GGUF model one file. `auto` decides by the extension.
fn is_folder(spec: &ModelDeploymentSpec, uri: &str) -> bool {
    match spec.model.format {
        ModelFormat::Gguf => false,
        ModelFormat::Safetensors => true,
        ModelFormat::Auto => !uri.split(['?', '#']).next().unwrap_or(uri).ends_with(".gguf"),
    }
}

fn fetch_container(
    scheme: RemoteScheme,
    uri: &str,
    dest: &str,
    folder: bool,
    spec: &ModelDeploymentSpec,
    images: &FetchImages,
    mount: VolumeMount,
) -> Container {
    let (image, command): (&str, Vec<String>) = match scheme {
        RemoteScheme::S3 => {
            let verb = if folder { "sync" } else { "cp" };
            (&images.s3, vec!["aws".into(), "s3".into(), verb.into(), uri.into(), dest.into()])
        }
        RemoteScheme::Gs => {
            let mut cmd = vec!["gcloud".to_string(), "storage".into(), "cp".into()];
            if folder {
                cmd.push("--recursive".into());
            }
            cmd.extend([uri.to_string(), MODEL_CACHE_DIR.to_string() + "/"]);
            (&images.gs, cmd)
        }
        // Single files only (validated); `-f` fails the init container on HTTP errors instead of
        // saving an error page as the model.
        RemoteScheme::Https => (&images.https, vec!["curl".into(), "-fSL".into(), "--retry".into(), "5".into(), "-o".into(), dest.into(), uri.into()]),
    };
    Container {
        name: "fetch-model".into(),
        image: Some(image.to_string()),
        command: Some(command),
        env_from: spec.model.secret_ref.as_ref().map(|s| {
            vec![EnvFromSource { secret_ref: Some(SecretEnvSource { name: s.name.clone(), optional: Some(false) }), ..Default::default() }]
        }),
        volume_mounts: Some(vec![mount]),
        ..Default::default()
    }
}
