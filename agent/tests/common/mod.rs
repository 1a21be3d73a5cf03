//! Spawning the built `peregrine-agent` on a free loopback port, with the test model.

#![allow(dead_code, unused_imports)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub const MODEL_NAME: &str = "smollm2";

/// The test model and the fixtures are found one way for the whole workspace (`peregrine-testkit`).
pub use peregrine_testkit::{fixtures_dir, repo_root, test_model as model_path};

/// The base model's reference outputs (transformers, float32).
pub fn fixtures_reference() -> PathBuf {
    fixtures_dir().join("smollm2/reference.json")
}

pub fn reference() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixtures_reference()).unwrap()).unwrap()
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A running server; killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        let mut args = vec!["--max-model-len", "2048", "--max-num-seqs", "8", "--num-kv-blocks", "256", "--threads", "2"];
        args.extend_from_slice(extra);
        Server::start_model(&model_path(), MODEL_NAME, &args)
    }

    /// Serves `model` (a file or folder) as `name` with exactly `args` after the common ones.
    pub fn start_model(model: &std::path::Path, name: &str, args: &[&str]) -> Server {
        // A port picked beforehand can be taken by another test's socket before the agent binds it;
        // the agent then exits at once, and we try another port rather than wait out the timeout.
        for _ in 0..3 {
            let port = free_port();
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_peregrine-agent"));
            cmd.args(["serve", "--host", "127.0.0.1", "--port", &port.to_string(), "--served-model-name", name])
                .arg("--model")
                .arg(model)
                .args(args)
                .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit());
            let child = cmd.spawn().expect("spawn peregrine-agent");
            let mut server = Server { child, addr: SocketAddr::from(([127, 0, 0, 1], port)) };
            match server.wait_ready(Duration::from_secs(180)) {
                Ok(()) => return server,
                Err(status) => eprintln!("the agent on port {port} exited before it was ready ({status}); trying another port"),
            }
        }
        panic!("the agent did not start on any of three ports (its stderr is above)");
    }

    /// Waits for `/ready`; `Err` with the exit status when the agent exits first.
    fn wait_ready(&mut self, timeout: Duration) -> Result<(), std::process::ExitStatus> {
        let t0 = Instant::now();
        let addr = self.addr;
        // Plain blocking HTTP: callers may be inside an async test's runtime.
        let ready = || -> std::io::Result<bool> {
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(b"GET /ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out.starts_with("HTTP/1.1 200"))
        };
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(status);
            }
            if ready().unwrap_or(false) {
                return Ok(());
            }
            assert!(t0.elapsed() < timeout, "server did not become ready within {timeout:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

pub type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn get(addr: SocketAddr, path: &str) -> Option<(u16, Bytes)> {
    let req = hyper::Request::get(format!("http://{addr}{path}")).body(Full::new(Bytes::new())).ok()?;
    let resp = client().request(req).await.ok()?;
    let status = resp.status().as_u16();
    Some((status, resp.into_body().collect().await.ok()?.to_bytes()))
}

pub async fn post(client: &HttpClient, addr: SocketAddr, path: &str, body: impl Into<Bytes>) -> (u16, Bytes) {
    let req = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

/// The value of one metric series, e.g. `peregrine_kv_cache_usage_ratio{model="smollm2"}`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().split(' ').next()?.parse().ok()))
}

pub async fn metrics(addr: SocketAddr) -> String {
    let (status, body) = get(addr, "/metrics").await.expect("GET /metrics");
    assert_eq!(status, 200);
    String::from_utf8(body.to_vec()).unwrap()
}

/// The Python with the test packages (the official openai client...): `PEREGRINE_PYTHON`, else the
/// cached venv `scripts/python-deps.sh` prepares.
pub fn python() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("PEREGRINE_PYTHON") {
        return std::path::PathBuf::from(p);
    }
    let out = std::process::Command::new(repo_root().join("scripts/python-deps.sh")).output().expect("run scripts/python-deps.sh");
    assert!(out.status.success(), "scripts/python-deps.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}
