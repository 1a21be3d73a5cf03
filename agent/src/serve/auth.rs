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
        Ok(KeyStore { keys })
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
}
