//! Logging and tracing setup.

use tracing_subscriber::{fmt, EnvFilter};

/// Installs the global subscriber: `RUST_LOG`-style filtering (default `info`), JSON or text lines.
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,kube=warn"));
    let builder = fmt().with_env_filter(filter);
    // A second init (tests) keeps the first subscriber.
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}
