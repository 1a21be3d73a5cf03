//! Leader election through a `coordination.k8s.io/v1` Lease, so that of several operator replicas only
//! one reconciles. Optimistic concurrency (the Lease's resourceVersion) makes acquiring atomic.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{ObjectMeta, PostParams};
use kube::Api;
use tracing::info;

/// One candidate's view of the Lease.
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaseLock {
    pub fn new(api: Api<Lease>, name: impl Into<String>, identity: impl Into<String>, duration: Duration) -> Self {
        LeaseLock { api, name: name.into(), identity: identity.into(), duration }
    }

    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// Takes the Lease if it is free, expired or already ours, and renews it. `Ok(false)`: another
    /// candidate holds it (or won a race for it).
    pub async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let Some(lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(self.name.clone()), ..Default::default() },
                spec: Some(self.spec(now, now, 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => {
                    info!(lease = %self.name, "acquired leadership (new lease)");
                    Ok(true)
                }
                Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let ours = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        if !ours && !expired(&spec, now) {
            return Ok(false);
        }
        let acquired = if ours { spec.acquire_time.map(|t| t.0).unwrap_or(now) } else { now };
        let transitions = spec.lease_transitions.unwrap_or(0) + i32::from(!ours);
        let updated = Lease { metadata: lease.metadata.clone(), spec: Some(self.spec(acquired, now, transitions)) };
        // `replace` carries the resourceVersion we read: if someone else wrote in between, we get 409.
        match self.api.replace(&self.name, &PostParams::default(), &updated).await {
            Ok(_) => {
                if !ours {
                    info!(lease = %self.name, previous = ?spec.holder_identity, "acquired leadership");
                }
                Ok(true)
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn spec(&self, acquired: Timestamp, renewed: Timestamp, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration.as_secs() as i32),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(renewed)),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }
}

/// A Lease nobody renewed within its duration is free to take.
pub fn expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    let Some(renewed) = spec.renew_time.as_ref().map(|t| t.0) else { return true };
    let duration = SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(15)));
    renewed.checked_add(duration).map_or(true, |deadline| deadline < now)
}

/// Blocks until this candidate leads.
pub async fn acquire(lock: &LeaseLock) {
    loop {
        match lock.try_acquire_or_renew().await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "leader election"),
        }
        tokio::time::sleep(lock.duration() / 3).await;
    }
}

/// Renews the Lease every third of its duration; returns when leadership is lost (not renewed in
/// time), after which the caller must stop acting.
pub async fn hold(lock: &LeaseLock) {
    let mut last_renewal = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(lock.duration() / 3).await;
        match lock.try_acquire_or_renew().await {
            Ok(true) => last_renewal = tokio::time::Instant::now(),
            Ok(false) => return,
            Err(e) => tracing::warn!(error = %e, "renewing lease"),
        }
        if last_renewal.elapsed() >= lock.duration() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_expiry() {
        let now = Timestamp::from_second(1_000).unwrap();
        let spec = |renewed: i64| LeaseSpec {
            renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
            lease_duration_seconds: Some(15),
            ..Default::default()
        };
        assert!(!expired(&spec(990), now));
        assert!(!expired(&spec(985), now));
        assert!(expired(&spec(984), now));
        assert!(expired(&LeaseSpec::default(), now));
    }
}
