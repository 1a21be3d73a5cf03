//! Operator-wide settings (flags of the `peregrine-operator` binary, set by the chart).

/// Settings that shape every agent pod.
#[derive(Clone, Debug)]
pub struct OperatorConfig {
    /// Agent image used when a ModelDeployment names none.
    pub agent_image: String,
    /// Port the agent listens on.
    pub agent_port: i32,
    /// Seconds the agent takes to drain in-flight requests after SIGTERM; the pod's termination
    /// grace period is this plus a margin.
    pub drain_seconds: i64,
    /// Longest time a model may take to load before the startup probe gives up.
    pub startup_seconds: i32,
    /// Images of the init container that fetches remote models.
    pub fetch_images: FetchImages,
    /// The key the operator sends on adapter pushes; agent pods get it through a Secret
    /// ([`crate::desired::admin_key`]). None: pushes carry no key and agents get none.
    pub admin_api_key: Option<crate::desired::admin_key::AdminKey>,
}

/// One image per remote scheme; each is the tool's official image.
#[derive(Clone, Debug)]
pub struct FetchImages {
    pub s3: String,
    pub gs: String,
    pub https: String,
}

impl Default for OperatorConfig {
    fn default() -> Self {
        OperatorConfig {
            agent_image: "ghcr.io/peregrine-serving/peregrine-agent:latest".to_string(),
            agent_port: 8000,
            drain_seconds: 30,
            startup_seconds: 1800,
            fetch_images: FetchImages {
                s3: "amazon/aws-cli:2.22.0".to_string(),
                gs: "gcr.io/google.com/cloudsdktool/google-cloud-cli:502.0.0-slim".to_string(),
                https: "curlimages/curl:8.11.0".to_string(),
            },
            admin_api_key: None,
        }
    }
}
