//! Reads an agent pod's `/metrics` over HTTP.

use std::time::Duration;

use super::sample::{self, PodMetrics, SampleError};

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("GET {url}: {source}")]
    Http { url: String, source: reqwest::Error },
    #[error("GET {url}: HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("{url}: {source}")]
    Parse { url: String, source: SampleError },
}

/// An HTTP client for agents' `/metrics`, with a per-request timeout so that one hung pod cannot
/// stall a round.
#[derive(Clone, Debug)]
pub struct Scraper {
    http: reqwest::Client,
}

impl Scraper {
    pub fn new(timeout: Duration) -> Result<Self, reqwest::Error> {
        Ok(Scraper { http: reqwest::Client::builder().timeout(timeout).build()? })
    }

    /// Fetches and parses `base_url/metrics` (`base_url` like `http://10.0.0.7:8000`).
    pub async fn scrape(&self, base_url: &str) -> Result<PodMetrics, ScrapeError> {
        let url = format!("{}/metrics", base_url.trim_end_matches('/'));
        let response = self.http.get(&url).send().await.map_err(|source| ScrapeError::Http { url: url.clone(), source })?;
        let status = response.status();
        if !status.is_success() {
            return Err(ScrapeError::Status { url, status: status.as_u16() });
        }
        let text = response.text().await.map_err(|source| ScrapeError::Http { url: url.clone(), source })?;
        sample::parse(&text).map_err(|source| ScrapeError::Parse { url, source })
    }
}
