//! The accept loop: a bounded number of open connections, each with a deadline for its request
//! head, so sockets that connect and then stall cannot exhaust the server.
//!
//! - At most `max_connections` are served at once (a semaphore permit per connection). Beyond that
//!   a connection gets a canned `503` with `Retry-After` and is closed at once, without reading
//!   from it, and `peregrine_http_connections_refused_total` counts it.
//! - hyper's header-read timeout closes a connection whose request head is not complete in time.
//!   hyper starts that clock whenever it waits for a head, so it is also how long an idle
//!   keep-alive connection is kept.
//! - The body-read timeout and the `Content-Length` check live in [`super::body_limits`], in front
//!   of the router.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Connection-level limits (flags `--max-connections`, `--header-read-timeout`, `--body-read-timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time allowed for a complete request head (and the longest a keep-alive connection idles).
    pub header_read_timeout: Duration,
    /// Time allowed for a complete request body once its head has arrived.
    pub body_read_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
        }
    }
}

/// The connection series of `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct ConnectionMetrics {
    pub open: Gauge,
    pub refused: Counter,
}

/// Written to a connection refused at the cap: the server's usual error shape. Small enough to
/// fit any fresh socket's send buffer, so one non-blocking write sends it whole.
fn refused_response() -> Vec<u8> {
    let body = r#"{"error":{"message":"the server has too many open connections; retry later","type":"service_unavailable_error","param":null,"code":"too_many_connections"}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Accepts and serves connections until `stop_accepting` completes, then waits for the open ones
/// to finish their current request (they are told to close after it).
pub async fn serve_connections(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: ConnectionMetrics,
    stop_accepting: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let refusal_log = RateLimitedLog::default();
    let refused_response = refused_response();
    let service = TowerToHyperService::new(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    tokio::pin!(stop_accepting);
    loop {
        let (tcp, _peer) = tokio::select! {
            () = &mut stop_accepting => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.refused.inc();
            refusal_log.warn(limits.max_connections);
            refuse(tcp, &refused_response);
            continue;
        };
        // Streamed tokens are small writes: without TCP_NODELAY, Nagle holds one back until the
        // client acknowledges the previous one, which a delayed ACK can put off by up to 40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let connection = graceful.watch(http.serve_connection(TokioIo::new(tcp), service.clone()));
        let open = metrics.open.clone();
        open.inc();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                // Header timeouts, resets and malformed requests: the client's problem, not ours.
                tracing::debug!(error = %e, "connection ended with an error");
            }
            open.dec();
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

fn refuse(tcp: TcpStream, response: &[u8]) {
    // Best effort and never waits: a client that cannot take it now just sees the close.
    let _ = tcp.try_write(response);
}

/// A warning when the cap is hit, at most every few seconds however many connections are refused.
#[derive(Debug)]
struct RateLimitedLog {
    start: Instant,
    next_ms: AtomicU64,
}

impl Default for RateLimitedLog {
    fn default() -> Self {
        RateLimitedLog { start: Instant::now(), next_ms: AtomicU64::new(0) }
    }
}

impl RateLimitedLog {
    const EVERY: Duration = Duration::from_secs(10);

    fn warn(&self, max_connections: usize) {
        let now = self.start.elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self.next_ms.compare_exchange(next, now + Self::EVERY.as_millis() as u64, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            tracing::warn!(max_connections, "connection limit reached; refusing new connections with 503");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_response_declares_its_body_length() {
        let bytes = refused_response();
        let text = std::str::from_utf8(&bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }
}
