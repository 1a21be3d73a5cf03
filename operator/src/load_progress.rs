//! The agents' weight-load progress in a ModelDeployment's `Progressing` condition, so that
//! `kubectl get modeldeployment -o wide` (and Argo CD) show how far a slow model load has come:
//! while a pod is not ready its agent already serves `/metrics` with `peregrine_load_progress`
//! (0–1); the controller reads it from the not-ready pods and appends a short note.

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use peregrine_api::metric_names::LOAD_PROGRESS;
use peregrine_crds::{ModelDeploymentStatus, CONDITION_PROGRESSING};

use crate::agent_client::AgentApi;

/// Pods read per reconcile at most (the rest are summarised by count), so a large scale-up does
/// not make one reconcile wait on many scrapes.
pub const MAX_PODS: usize = 5;

/// `peregrine_load_progress` from an agent's `/metrics` text; None when absent or not a number.
pub fn parse(metrics_text: &str) -> Option<f64> {
    metrics_text.lines().find_map(|line| {
        let rest = line.strip_prefix(LOAD_PROGRESS)?;
        // The bare series (no labels), then whitespace and the value.
        let value = rest.strip_prefix(' ')?.split_whitespace().next()?;
        value.parse::<f64>().ok().filter(|v| v.is_finite()).map(|v| v.clamp(0.0, 1.0))
    })
}

/// "weights loading: smol-0 42%, smol-1 7%" (pods in the order given, then "and N more").
pub fn summary(loading: &[(String, f64)], unread: usize) -> Option<String> {
    if loading.is_empty() {
        return None;
    }
    let pods: Vec<String> = loading.iter().map(|(pod, f)| format!("{pod} {:.0}%", f * 100.0)).collect();
    let more = if unread > 0 { format!(" and {unread} more") } else { String::new() };
    Some(format!("weights loading: {}{more}", pods.join(", ")))
}

/// Appends `note` to the `Progressing` condition's message when that condition is true.
pub fn annotate(status: &mut ModelDeploymentStatus, note: &str) {
    if let Some(c) = status.conditions.iter_mut().find(|c| c.type_ == CONDITION_PROGRESSING && c.status == "True") {
        c.message = format!("{}; {note}", c.message);
    }
}

/// `http://<ip>:<port>` of a pod that has an IP, is not ready and is not being deleted.
fn loading_target(pod: &Pod, port: i32) -> Option<String> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_ref().filter(|ip| !ip.is_empty())?;
    if ready {
        return None;
    }
    Some(if ip.contains(':') { format!("http://[{ip}]:{port}") } else { format!("http://{ip}:{port}") })
}

/// The load note for `pods`: each not-ready pod's progress (the first [`MAX_PODS`] by name),
/// skipping pods that do not answer or have finished loading (warming up).
pub async fn note(pods: &[Pod], agent: &dyn AgentApi, port: i32) -> Option<String> {
    let mut targets: Vec<(String, String)> = pods.iter().filter_map(|p| Some((p.name_any(), loading_target(p, port)?))).collect();
    targets.sort();
    let unread = targets.len().saturating_sub(MAX_PODS);
    targets.truncate(MAX_PODS);
    let reads = join_all(targets.iter().map(|(_, base)| agent.load_progress(base))).await;
    let loading: Vec<(String, f64)> = targets
        .into_iter()
        .zip(reads)
        .filter_map(|((pod, _), read)| match read {
            Ok(Some(f)) if f < 1.0 => Some((pod, f)),
            _ => None,
        })
        .collect();
    summary(&loading, unread)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_bare_gauge_only() {
        let text = "# HELP peregrine_load_progress x\n# TYPE peregrine_load_progress gauge\nperegrine_load_progress 0.425\nprocess_resident_memory_bytes 9\n";
        assert_eq!(parse(text), Some(0.425));
        assert_eq!(parse("peregrine_load_progress_other 0.5\n"), None);
        assert_eq!(parse("peregrine_load_progress NaN\n"), None);
        assert_eq!(parse("peregrine_load_progress 3\n"), Some(1.0));
        assert_eq!(parse(""), None);
    }

    #[test]
    fn summary_lists_pods_and_counts_the_rest() {
        assert_eq!(summary(&[], 0), None);
        let loading = vec![("smol-a".to_string(), 0.42), ("smol-b".to_string(), 0.071)];
        assert_eq!(summary(&loading, 0).as_deref(), Some("weights loading: smol-a 42%, smol-b 7%"));
        assert_eq!(summary(&loading, 3).as_deref(), Some("weights loading: smol-a 42%, smol-b 7% and 3 more"));
    }
}
