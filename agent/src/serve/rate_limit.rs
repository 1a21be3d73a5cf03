//! Per-tenant requests- and tokens-per-minute limits (token buckets refilled continuously), so one
//! tenant cannot take a shared endpoint's capacity from the others.
//!
//! Tokens are reserved when a request is admitted (prompt + `max_tokens`) and the unused part is
//! given back when it finishes, so a burst of long requests is stopped before it runs, not after.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::tenant::{Limits, TenantId};

#[derive(Debug)]
struct Bucket {
    /// Capacity and refill per minute.
    per_minute: f64,
    level: f64,
    updated: Instant,
}

impl Bucket {
    fn new(per_minute: u64, now: Instant) -> Self {
        Bucket { per_minute: per_minute as f64, level: per_minute as f64, updated: now }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + elapsed * self.per_minute / 60.0).min(self.per_minute);
        self.updated = now;
    }

    /// Time until `amount` is available (zero if it is now).
    fn wait_for(&self, amount: f64) -> Duration {
        if self.level >= amount {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((amount - self.level) * 60.0 / self.per_minute)
        }
    }
}

#[derive(Debug, Default)]
struct TenantBuckets {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

#[derive(Debug, Default)]
pub struct RateLimiter {
    tenants: Mutex<HashMap<TenantId, TenantBuckets>>,
}

/// Why a request was refused and when to come back.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub what: &'static str,
    pub retry_after: Duration,
}

impl RateLimiter {
    /// Takes one request from the tenant's request bucket.
    pub fn check_request(&self, tenant: TenantId, limits: Limits, now: Instant) -> Result<(), Refused> {
        if limits.requests_per_minute == 0 {
            return Ok(());
        }
        let mut tenants = self.tenants.lock();
        let b = tenants.entry(tenant).or_default().requests.get_or_insert_with(|| Bucket::new(limits.requests_per_minute, now));
        b.refill(now);
        let wait = b.wait_for(1.0);
        if wait.is_zero() {
            b.level -= 1.0;
            Ok(())
        } else {
            Err(Refused { what: "requests", retry_after: wait })
        }
    }

    /// Reserves `tokens` (prompt + max_tokens). A request larger than the whole per-minute budget
    /// is admitted once the bucket is full, so it is not refused forever.
    pub fn reserve_tokens(&self, tenant: TenantId, limits: Limits, tokens: u64, now: Instant) -> Result<(), Refused> {
        if limits.tokens_per_minute == 0 {
            return Ok(());
        }
        let mut tenants = self.tenants.lock();
        let b = tenants.entry(tenant).or_default().tokens.get_or_insert_with(|| Bucket::new(limits.tokens_per_minute, now));
        b.refill(now);
        let need = (tokens as f64).min(b.per_minute);
        let wait = b.wait_for(need);
        if wait.is_zero() {
            b.level -= tokens as f64;
            Ok(())
        } else {
            Err(Refused { what: "tokens", retry_after: wait })
        }
    }

    /// Gives back the part of a reservation that was not used.
    pub fn refund_tokens(&self, tenant: TenantId, tokens: u64) {
        let mut tenants = self.tenants.lock();
        if let Some(b) = tenants.get_mut(&tenant).and_then(|t| t.tokens.as_mut()) {
            b.level = (b.level + tokens as f64).min(b.per_minute);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_per_minute_refuse_then_refill() {
        let rl = RateLimiter::default();
        let limits = Limits { requests_per_minute: 2, tokens_per_minute: 0 };
        let t0 = Instant::now();
        let a = TenantId(0);
        assert!(rl.check_request(a, limits, t0).is_ok());
        assert!(rl.check_request(a, limits, t0).is_ok());
        let refused = rl.check_request(a, limits, t0).unwrap_err();
        // One request refills every 30 s at 2 per minute.
        assert!((refused.retry_after.as_secs_f64() - 30.0).abs() < 1e-6, "{refused:?}");
        // Another tenant is unaffected.
        assert!(rl.check_request(TenantId(1), limits, t0).is_ok());
        assert!(rl.check_request(a, limits, t0 + Duration::from_secs(31)).is_ok());
    }

    #[test]
    fn tokens_reserved_and_refunded() {
        let rl = RateLimiter::default();
        let limits = Limits { requests_per_minute: 0, tokens_per_minute: 600 };
        let t0 = Instant::now();
        let a = TenantId(3);
        assert!(rl.reserve_tokens(a, limits, 500, t0).is_ok());
        let refused = rl.reserve_tokens(a, limits, 200, t0).unwrap_err();
        // 100 tokens missing at 10 tokens/s.
        assert!((refused.retry_after.as_secs_f64() - 10.0).abs() < 1e-6, "{refused:?}");
        rl.refund_tokens(a, 400);
        assert!(rl.reserve_tokens(a, limits, 200, t0).is_ok());
        // Larger than the whole budget: allowed when full, not refused forever.
        assert!(rl.reserve_tokens(TenantId(4), limits, 5000, t0).is_ok());
    }
}
