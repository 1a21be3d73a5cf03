//! State shared by every reconciliation.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::core::DynamicObject;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::Client;

use crate::agent_client::AgentApi;
use crate::config::OperatorConfig;
use crate::metrics::Metrics;
use crate::rollout::{RolloutContext, SuiteRunner};

pub struct Context {
    pub client: Client,
    pub config: OperatorConfig,
    pub agent: Arc<dyn AgentApi>,
    pub metrics: Metrics,
    pub recorder: Recorder,
    pub backoff: FailureBackoff,
    /// What staged rollouts need: the regression-suite runner and the recorder.
    pub rollout: RolloutContext,
}

impl Context {
    /// `runner` runs rollouts' regression suites (`rollout::HttpSuiteRunner` in the binary).
    pub fn new(
        client: Client,
        config: OperatorConfig,
        agent: Arc<dyn AgentApi>,
        metrics: Metrics,
        runner: Arc<dyn SuiteRunner>,
    ) -> Arc<Context> {
        let reporter = Reporter { controller: "peregrine-operator".into(), instance: std::env::var("POD_NAME").ok() };
        let recorder = Recorder::new(client.clone(), reporter);
        let rollout = RolloutContext {
            client: client.clone(),
            runner,
            agent_port: config.agent_port,
            recorder: Some(recorder.clone()),
        };
        Arc::new(Context { client, config, agent, metrics, recorder, backoff: FailureBackoff::default(), rollout })
    }
}

/// Consecutive reconcile failures per object, for exponential requeue delays.
#[derive(Default)]
pub struct FailureBackoff {
    failures: Mutex<HashMap<ObjectRef<DynamicObject>, u32>>,
}

impl FailureBackoff {
    /// Counts a failure of `key` and returns how long to wait: 5 s, 10 s, 20 s, … capped at 5 min.
    pub fn next(&self, key: ObjectRef<DynamicObject>) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let n = failures.entry(key).or_insert(0);
        let delay = backoff_delay(*n);
        *n = n.saturating_add(1);
        delay
    }

    pub fn reset(&self, key: &ObjectRef<DynamicObject>) {
        self.failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(key);
    }
}

/// Delay after `failures` earlier consecutive failures.
pub fn backoff_delay(failures: u32) -> Duration {
    Duration::from_secs((5u64 << failures.min(6)).min(300))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let secs: Vec<u64> = (0..9).map(|n| backoff_delay(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
    }
}
