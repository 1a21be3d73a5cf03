//! API keys: `Authorization: Bearer KEY`, compared in constant time, each with its own rate limits.

use std::path::Path;

use subtle::ConstantTimeEq;

use super::tenant::{Limits, TenantId};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    key: Vec<u8>,
    pub limits: Limits,
}

#[derive(Debug, Clone, Default)]
pub struct KeyStore {
    keys: Vec<ApiKey>,
    /// Keys for the adapter admin endpoints only (`--admin-api-key`); never a tenant.
    admin_keys: Vec<Vec<u8>>,
}

/// Who is calling an admin endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminAccess {
    /// An admin key, or a server with no keys at all.
    Allowed,
    /// A valid tenant key: authenticated, but not allowed to manage adapters.
    Forbidden,
    /// No key or an unknown one.
    Unauthenticated,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("cannot read API keys file {path}: {source}")]
    Io { path: String, #[source] source: std::io::Error },
    #[error("API keys file line {line}: {message}")]
    Syntax { line: usize, message: String },
}

impl KeyStore {
    /// Keys from flags/env (with the default limits) plus those of a keys file.
    pub fn new(flag_keys: &[String], file: Option<&Path>, default_limits: Limits) -> Result<Self, KeyFileError> {
        let mut keys: Vec<ApiKey> = flag_keys
            .iter()
            .map(|k| k.trim())
            .filter(|k| !k.is_empty())
            .map(|k| ApiKey { key: k.as_bytes().to_vec(), limits: default_limits })
            .collect();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|source| KeyFileError::Io { path: path.display().to_string(), source })?;
            keys.extend(parse_keys_file(&text, default_limits)?);
        }
        Ok(KeyStore { keys, admin_keys: Vec::new() })
    }

    /// Adds the admin keys (`--admin-api-key`).
    pub fn with_admin_keys(mut self, admin_keys: &[String]) -> Self {
        self.admin_keys =
            admin_keys.iter().map(|k| k.trim()).filter(|k| !k.is_empty()).map(|k| k.as_bytes().to_vec()).collect();
        self
    }

    /// Whether `presented` may load, unload and list adapters. With tenant keys but no admin key,
    /// nobody may: adapter admin is never open to tenants.
    pub fn admin_access(&self, presented: Option<&[u8]>) -> AdminAccess {
        if self.keys.is_empty() && self.admin_keys.is_empty() {
            return AdminAccess::Allowed;
        }
        let Some(presented) = presented else { return AdminAccess::Unauthenticated };
        // Every key is compared, admin and tenant, so timing does not tell which kind matched.
        let mut admin = false;
        for k in &self.admin_keys {
            admin |= bool::from(k.as_slice().ct_eq(presented));
        }
        let tenant = self.authenticate(presented).is_some();
        match (admin, tenant) {
            (true, _) => AdminAccess::Allowed,
            (false, true) => AdminAccess::Forbidden,
            (false, false) => AdminAccess::Unauthenticated,
        }
    }

    /// No keys configured: every request is allowed, as one anonymous tenant.
    pub fn is_open(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn limits(&self, tenant: TenantId) -> Limits {
        self.keys.get(tenant.0).map(|k| k.limits).unwrap_or_default()
    }

    /// The tenant whose key matches. Every configured key is compared, with no early exit, so the
    /// time taken does not reveal which key (or how much of one) matched.
    pub fn authenticate(&self, presented: &[u8]) -> Option<TenantId> {
        let mut found: Option<TenantId> = None;
        for (i, k) in self.keys.iter().enumerate() {
            let equal: bool = k.key.as_slice().ct_eq(presented).into();
            if equal && found.is_none() {
                found = Some(TenantId(i));
            }
        }
        found
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

fn parse_keys_file(text: &str, default_limits: Limits) -> Result<Vec<ApiKey>, KeyFileError> {
    let mut keys = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let Some(key) = fields.next() else { continue };
        let mut limits = default_limits;
        for field in fields {
            let (name, value) = field
                .split_once('=')
                .ok_or_else(|| KeyFileError::Syntax { line: n + 1, message: format!("expected name=value, got `{field}`") })?;
            let value: u64 = value
                .parse()
                .map_err(|_| KeyFileError::Syntax { line: n + 1, message: format!("`{value}` is not a whole number") })?;
            match name {
                "rpm" => limits.requests_per_minute = value,
                "tpm" => limits.tokens_per_minute = value,
                other => {
                    return Err(KeyFileError::Syntax { line: n + 1, message: format!("unknown setting `{other}` (rpm, tpm)") })
                }
            }
        }
        keys.push(ApiKey { key: key.as_bytes().to_vec(), limits });
    }
    Ok(keys)
}

/// The key in an `Authorization: Bearer KEY` header value.
pub fn bearer_token(header: &[u8]) -> Option<&[u8]> {
    let prefix = b"Bearer ";
    if header.len() > prefix.len() && header[..prefix.len()].eq_ignore_ascii_case(prefix) {
        Some(header[prefix.len()..].trim_ascii())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_file_with_limits_and_comments() {
        let defaults = Limits { requests_per_minute: 5, tokens_per_minute: 0 };
        let ks = parse_keys_file("# tenants\nalpha rpm=10 tpm=2000\n\nbeta  # default limits\n", defaults).unwrap();
        assert_eq!(ks.len(), 2);
        assert_eq!(ks[0].limits, Limits { requests_per_minute: 10, tokens_per_minute: 2000 });
        assert_eq!(ks[1].limits, defaults);
        assert!(parse_keys_file("gamma rpm=ten\n", defaults).is_err());
        assert!(parse_keys_file("gamma burst=3\n", defaults).is_err());
    }

    #[test]
    fn authenticate_matches_exact_keys_only() {
        let store = KeyStore::new(&["sk-one".into(), "sk-two".into()], None, Limits::default()).unwrap();
        assert_eq!(store.authenticate(b"sk-two"), Some(TenantId(1)));
        assert_eq!(store.authenticate(b"sk-one"), Some(TenantId(0)));
        assert_eq!(store.authenticate(b"sk-on"), None);
        assert_eq!(store.authenticate(b"sk-one "), None);
        assert_eq!(store.authenticate(b""), None);
        assert_eq!(bearer_token(b"Bearer sk-one"), Some(&b"sk-one"[..]));
        assert_eq!(bearer_token(b"bearer sk-one"), Some(&b"sk-one"[..]));
        assert_eq!(bearer_token(b"Basic abc"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
    }

    #[test]
    fn admin_keys_are_distinct_from_tenant_keys() {
        let open = KeyStore::default();
        assert_eq!(open.admin_access(None), AdminAccess::Allowed, "no keys at all: a local dev server");
        let tenants_only = KeyStore::new(&["sk-tenant".into()], None, Limits::default()).unwrap();
        assert_eq!(tenants_only.admin_access(Some(b"sk-tenant")), AdminAccess::Forbidden);
        assert_eq!(tenants_only.admin_access(None), AdminAccess::Unauthenticated);
        let both = tenants_only.with_admin_keys(&["sk-admin".into(), " ".into()]);
        assert_eq!(both.admin_access(Some(b"sk-admin")), AdminAccess::Allowed);
        assert_eq!(both.admin_access(Some(b"sk-tenant")), AdminAccess::Forbidden);
        assert_eq!(both.admin_access(Some(b"sk-other")), AdminAccess::Unauthenticated);
        assert_eq!(both.admin_access(Some(b"")), AdminAccess::Unauthenticated);
        // The admin key is not a tenant: it does not open the inference endpoints.
        assert_eq!(both.authenticate(b"sk-admin"), None);
        let admin_only = KeyStore::default().with_admin_keys(&["sk-admin".into()]);
        assert!(admin_only.is_open(), "no tenant keys: inference stays open");
        assert_eq!(admin_only.admin_access(None), AdminAccess::Unauthenticated);
    }
}
