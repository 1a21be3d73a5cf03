//! The OTLP exporter's HTTP client, run on the application's tokio runtime.
//!
//! The SDK's batch span processor exports from its own plain thread, but the hyper client needs a
//! tokio reactor to drive its connections. Each request is therefore spawned onto the runtime that
//! was current at setup, and the processor thread only waits for the result.

use std::time::Duration;

use opentelemetry_http::hyper::HyperClient;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use tokio::runtime::Handle;

#[derive(Debug, Clone)]
pub(crate) struct RuntimeHttpClient {
    runtime: Handle,
    inner: HyperClient,
}

impl RuntimeHttpClient {
    pub(crate) fn new(runtime: Handle, timeout: Duration) -> Self {
        Self { runtime, inner: HyperClient::with_default_connector(timeout, None) }
    }
}

#[async_trait::async_trait]
impl HttpClient for RuntimeHttpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let inner = self.inner.clone();
        self.runtime.spawn(async move { inner.send_bytes(request).await }).await?
    }
}
