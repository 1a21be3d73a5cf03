//! Who a request is for: the tenant identity and its limits, shared by authentication, rate
//! limiting and the handlers without any of them depending on another.

/// Index of the matched API key; tenants are told apart by it, never by the secret itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TenantId(pub usize);

/// The authenticated tenant of a request (None when the server has no keys).
#[derive(Debug, Clone, Copy)]
pub struct Tenant(pub Option<TenantId>);

/// A tenant's rate limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// 0: unlimited.
    pub requests_per_minute: u64,
    /// 0: unlimited.
    pub tokens_per_minute: u64,
}
