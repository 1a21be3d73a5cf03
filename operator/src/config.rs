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

/// Where the controllers and the autoscaler look: every namespace, or only the listed ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchScope {
    /// Every namespace (the chart then grants a ClusterRole).
    All,
    /// Only these namespaces, sorted and without repeats (the chart grants a Role in each and
    /// nothing elsewhere, so listing any other namespace would be refused).
    Namespaces(Vec<String>),
}

/// Most namespaces one operator watches: each runs its own watches.
pub const MAX_WATCH_NAMESPACES: usize = 64;

impl WatchScope {
    /// The scope from the `--watch-namespace` values (repeated, or comma-separated as in
    /// `PEREGRINE_WATCH_NAMESPACE=a,b`). Blank entries are ignored; none left means every namespace.
    pub fn from_flags(values: &[String]) -> Result<WatchScope, String> {
        let mut namespaces: Vec<String> = values
            .iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|ns| !ns.is_empty())
            .map(str::to_string)
            .collect();
        if let Some(bad) = namespaces.iter().find(|ns| !is_dns1123_label(ns)) {
            return Err(format!("--watch-namespace {bad:?} is not a namespace name (a DNS-1123 label: lowercase letters, digits and '-', at most 63)"));
        }
        namespaces.sort();
        namespaces.dedup();
        if namespaces.len() > MAX_WATCH_NAMESPACES {
            return Err(format!("--watch-namespace lists {} namespaces; at most {MAX_WATCH_NAMESPACES} (leave it empty to watch every namespace)", namespaces.len()));
        }
        Ok(if namespaces.is_empty() { WatchScope::All } else { WatchScope::Namespaces(namespaces) })
    }

    /// One entry per watch to run: `None` is a cluster-wide watch, `Some(ns)` one namespace.
    pub fn watches(&self) -> Vec<Option<String>> {
        match self {
            WatchScope::All => vec![None],
            WatchScope::Namespaces(list) => list.iter().cloned().map(Some).collect(),
        }
    }
}

fn is_dns1123_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    let inner_ok = bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-');
    let ends_ok = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    !name.is_empty() && name.len() <= 63 && inner_ok && ends_ok(bytes.first()) && ends_ok(bytes.last())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(values: &[&str]) -> Vec<String> {
        values.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn no_namespace_watches_everything() {
        assert_eq!(WatchScope::from_flags(&[]), Ok(WatchScope::All));
        assert_eq!(WatchScope::from_flags(&strings(&["", " "])), Ok(WatchScope::All));
        assert_eq!(WatchScope::All.watches(), [None]);
    }

    #[test]
    fn listed_namespaces_are_watched_each_once() {
        let scope = WatchScope::from_flags(&strings(&["team-b", "models,team-b", " models "])).unwrap();
        assert_eq!(scope, WatchScope::Namespaces(strings(&["models", "team-b"])));
        assert_eq!(scope.watches(), [Some("models".to_string()), Some("team-b".to_string())]);
    }

    #[test]
    fn a_name_that_cannot_be_a_namespace_is_refused() {
        for bad in ["Models", "models_prod", "-models", "models-", &"a".repeat(64)] {
            let err = WatchScope::from_flags(&strings(&[bad])).unwrap_err();
            assert!(err.contains("not a namespace name"), "{bad}: {err}");
        }
        let many: Vec<String> = (0..=MAX_WATCH_NAMESPACES).map(|i| format!("ns-{i}")).collect();
        assert!(WatchScope::from_flags(&many).unwrap_err().contains("at most"));
    }
}
