//! Where model and adapter files come from: URIs, their parsing, and object-store credentials.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// CEL rule shared by every URI field: the schemes the operator can fetch from. Checked by the API
/// server so that a typo is refused at `kubectl apply`, never half-created.
pub const URI_SCHEME_RULE: &str = "self.matches('^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/.+|file:///.+|s3://[^/]+/.+|gs://[^/]+/.+|https://.+)$')";
/// Message of [`URI_SCHEME_RULE`].
pub const URI_SCHEME_MESSAGE: &str =
    "uri must be pvc://<claim>/<path>, file:///<path>, s3://<bucket>/<key>, gs://<bucket>/<object> or https://<url>";

/// A Secret in the same namespace holding object-store credentials.
///
/// For `s3://` the keys `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (and optionally
/// `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL`); for `gs://` the key
/// `GOOGLE_APPLICATION_CREDENTIALS_JSON`; for `https://` optionally `HF_TOKEN` or `AUTHORIZATION`.
/// Every key is exposed to the fetch step as an environment variable.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretReference {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// On-disk format of the model weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ModelFormat {
    /// Decide from the files: a `.gguf` file, else a Hugging Face folder.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// A single GGUF file.
    #[serde(rename = "gguf")]
    Gguf,
    /// A Hugging Face folder: `config.json`, tokenizer files and `*.safetensors` shards.
    #[serde(rename = "safetensors")]
    Safetensors,
}

impl ModelFormat {
    /// The value of the agent's `--load-format` flag.
    pub fn as_flag(self) -> &'static str {
        match self {
            ModelFormat::Auto => "auto",
            ModelFormat::Gguf => "gguf",
            ModelFormat::Safetensors => "safetensors",
        }
    }
}

/// What the model is served for. It decides how the operator checks and measures it: the
/// regression cases it accepts (prompts for `generate`; an `input` for the encoder tasks, with
/// `documents` for `rerank`) and the autoscaling SLO (TTFT/TPOT for `generate`; the whole request's
/// p95 latency for the encoder tasks, which answer in one step). The agent itself reads the task
/// from the model folder (a `*ForSequenceClassification` head, a Sentence-Transformers chain).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ModelTask {
    /// Text generation (`/v1/completions`, `/v1/chat/completions`).
    #[default]
    #[serde(rename = "generate")]
    Generate,
    /// Sentence embeddings (`/v1/embeddings`).
    #[serde(rename = "embed")]
    Embed,
    /// A cross-encoder scoring (query, document) pairs (`/v1/rerank`).
    #[serde(rename = "rerank")]
    Rerank,
    /// Sequence classification: labels and probabilities (`/classify`).
    #[serde(rename = "classify")]
    Classify,
}

impl ModelTask {
    /// Encoders answer a request in one forward: no first token, no time per output token.
    pub fn is_encoder(self) -> bool {
        !self.is_generate()
    }

    pub fn is_generate(&self) -> bool {
        matches!(self, ModelTask::Generate)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ModelTask::Generate => "generate",
            ModelTask::Embed => "embed",
            ModelTask::Rerank => "rerank",
            ModelTask::Classify => "classify",
        }
    }
}

/// The base model to serve.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// Where the weights are: `pvc://<claim>/<path>` (mounted read-only), `file:///<path>` (already in
    /// the image or on the node), or `s3://`, `gs://`, `https://` (fetched into an `emptyDir` by an
    /// init container before the agent starts).
    #[x_kube(validation = kube::core::Rule::new(URI_SCHEME_RULE).message(URI_SCHEME_MESSAGE))]
    #[schemars(length(max = 2048))]
    pub uri: String,
    /// Weight format; `auto` by default.
    #[serde(default)]
    pub format: ModelFormat,
    /// Credentials for `s3://`, `gs://` or private `https://` sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretReference>,
    /// What the model is served for: `generate` (the default when unset), `embed`, `rerank` or
    /// `classify`.
    #[serde(default, skip_serializing_if = "ModelTask::is_generate")]
    pub task: ModelTask,
    /// The model id clients send as `model` (and the `parent` of adapters in `/v1/models`); defaults
    /// to the ModelDeployment's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub served_model_name: Option<String>,
}

/// Where adapter files come from (a PEFT folder: `adapter_config.json` + `adapter_model.safetensors`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterSource {
    /// Same URI forms as the model: `pvc://<claim>/<path>` (the claim must be the model's claim or
    /// listed in the deployment's `adapterVolumes`), `file:///<path>`, `s3://`, `gs://`, `https://`.
    #[x_kube(validation = kube::core::Rule::new(URI_SCHEME_RULE).message(URI_SCHEME_MESSAGE))]
    #[schemars(length(max = 2048))]
    pub uri: String,
    /// Credentials for object-store sources; the operator checks that the Secret exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretReference>,
}

/// A parsed source URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceUri {
    /// `pvc://claim/path`: a PersistentVolumeClaim in the same namespace and a path inside it.
    Pvc { claim: String, path: String },
    /// `file:///path`: an absolute path inside the agent container.
    File { path: String },
    /// `s3://`, `gs://` or `https://`: fetched over the network.
    Remote { scheme: RemoteScheme, uri: String },
}

/// Network schemes the fetch step understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteScheme {
    S3,
    Gs,
    Https,
}

/// Why a URI was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UriError {
    #[error("unknown URI scheme in {0:?}: expected pvc://, file://, s3://, gs:// or https://")]
    UnknownScheme(String),
    #[error("{0:?} has no path after the scheme")]
    MissingPath(String),
    #[error("{0:?}: the PVC claim name must be a DNS-1123 label")]
    BadClaim(String),
}

impl SourceUri {
    /// Parses a model or adapter URI. The API server's CEL rule refuses most bad URIs; this is the
    /// operator's own check, for objects written before the rule existed or with validation off.
    pub fn parse(uri: &str) -> Result<SourceUri, UriError> {
        let (scheme, rest) = uri.split_once("://").ok_or_else(|| UriError::UnknownScheme(uri.to_string()))?;
        match scheme {
            "pvc" => {
                let (claim, path) = rest.split_once('/').ok_or_else(|| UriError::MissingPath(uri.to_string()))?;
                if path.is_empty() {
                    return Err(UriError::MissingPath(uri.to_string()));
                }
                if !is_dns1123_label(claim) {
                    return Err(UriError::BadClaim(uri.to_string()));
                }
                Ok(SourceUri::Pvc { claim: claim.to_string(), path: path.trim_start_matches('/').to_string() })
            }
            "file" => {
                // file:///abs/path: `rest` is "/abs/path".
                if rest.len() <= 1 || !rest.starts_with('/') {
                    return Err(UriError::MissingPath(uri.to_string()));
                }
                Ok(SourceUri::File { path: rest.to_string() })
            }
            "s3" | "gs" | "https" => {
                let scheme = match scheme {
                    "s3" => RemoteScheme::S3,
                    "gs" => RemoteScheme::Gs,
                    _ => RemoteScheme::Https,
                };
                let has_path = match scheme {
                    RemoteScheme::Https => !rest.is_empty(),
                    _ => rest.split_once('/').is_some_and(|(bucket, key)| !bucket.is_empty() && !key.is_empty()),
                };
                if !has_path {
                    return Err(UriError::MissingPath(uri.to_string()));
                }
                Ok(SourceUri::Remote { scheme, uri: uri.to_string() })
            }
            _ => Err(UriError::UnknownScheme(uri.to_string())),
        }
    }
}

fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_scheme() {
        let cases: &[(&str, Result<SourceUri, UriError>)] = &[
            ("pvc://models/llama/model.gguf", Ok(SourceUri::Pvc { claim: "models".into(), path: "llama/model.gguf".into() })),
            ("file:///models/m.gguf", Ok(SourceUri::File { path: "/models/m.gguf".into() })),
            ("s3://bucket/key/m.gguf", Ok(SourceUri::Remote { scheme: RemoteScheme::S3, uri: "s3://bucket/key/m.gguf".into() })),
            ("gs://bucket/m", Ok(SourceUri::Remote { scheme: RemoteScheme::Gs, uri: "gs://bucket/m".into() })),
            ("https://h/x", Ok(SourceUri::Remote { scheme: RemoteScheme::Https, uri: "https://h/x".into() })),
            ("ftp://h/x", Err(UriError::UnknownScheme("ftp://h/x".into()))),
            ("models/m.gguf", Err(UriError::UnknownScheme("models/m.gguf".into()))),
            ("pvc://models", Err(UriError::MissingPath("pvc://models".into()))),
            ("pvc://models/", Err(UriError::MissingPath("pvc://models/".into()))),
            ("pvc://Models/x", Err(UriError::BadClaim("pvc://Models/x".into()))),
            ("file://relative", Err(UriError::MissingPath("file://relative".into()))),
            ("s3://bucket", Err(UriError::MissingPath("s3://bucket".into()))),
            ("https://", Err(UriError::MissingPath("https://".into()))),
        ];
        for (uri, want) in cases {
            assert_eq!(&SourceUri::parse(uri), want, "{uri}");
        }
    }
}
