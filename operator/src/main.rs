//! `peregrine-operator`: runs the ModelDeployment and LoraAdapter controllers and the autoscaler
//! behind a leader Lease.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use peregrine_operator::agent_client::HttpAgentClient;
use peregrine_operator::desired::admin_key::AdminKey;
use peregrine_operator::autoscaler::controller::{Autoscaler, AutoscalerConfig};
use peregrine_operator::config::{OperatorConfig, WatchScope};
use peregrine_operator::leader::{self, LeaseLock};
use peregrine_operator::metrics::Metrics;
use peregrine_operator::regression::OpenAiClient;
use peregrine_operator::rollout::HttpSuiteRunner;
use peregrine_operator::server::{router, ServerState};
use peregrine_operator::{lora_adapter, model_deployment, telemetry, Context};
use tracing::{error, info};

#[derive(Parser, Debug)]
#[command(name = "peregrine-operator", version, about)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "PEREGRINE_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Watch only these namespaces: repeat the flag, or separate with commas (default: all
    /// namespaces).
    #[arg(long = "watch-namespace", env = "PEREGRINE_WATCH_NAMESPACE", value_delimiter = ',')]
    watch_namespaces: Vec<String>,
    /// Agent image for ModelDeployments that name none.
    #[arg(long, env = "PEREGRINE_AGENT_IMAGE")]
    agent_image: Option<String>,
    /// Port the agent listens on.
    #[arg(long, env = "PEREGRINE_AGENT_PORT", default_value_t = 8000)]
    agent_port: i32,
    /// Seconds the agent drains in-flight requests after SIGTERM.
    #[arg(long, env = "PEREGRINE_AGENT_DRAIN_SECONDS", default_value_t = 30)]
    agent_drain_seconds: i64,
    /// Longest model load the startup probe allows.
    #[arg(long, env = "PEREGRINE_AGENT_STARTUP_SECONDS", default_value_t = 1800)]
    agent_startup_seconds: i32,
    /// Timeout of one call to an agent's admin API.
    #[arg(long, env = "PEREGRINE_AGENT_TIMEOUT_SECONDS", default_value_t = 120)]
    agent_timeout_seconds: u64,
    /// Timeout of one regression-suite request to an agent (generation included).
    #[arg(long, env = "PEREGRINE_REGRESSION_TIMEOUT_SECONDS", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    regression_timeout_seconds: u64,
    /// Leader election: off runs the controllers at once (a single replica only).
    #[arg(long, env = "PEREGRINE_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the leader Lease (the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "peregrine-system")]
    lease_namespace: String,
    #[arg(long, env = "PEREGRINE_LEASE_NAME", default_value = "peregrine-operator-leader")]
    lease_name: String,
    /// Autoscaler: seconds between rounds (scrape every autoscaled deployment's pods, decide, scale).
    #[arg(long, env = "PEREGRINE_AUTOSCALER_INTERVAL_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    autoscaler_interval_seconds: u64,
    /// Autoscaler: timeout of one pod's /metrics scrape.
    #[arg(long, env = "PEREGRINE_AUTOSCALER_SCRAPE_TIMEOUT_SECONDS", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    autoscaler_scrape_timeout_seconds: u64,
    /// Turn the autoscaler off (spec.replicas is then used as written).
    #[arg(long, env = "PEREGRINE_AUTOSCALER_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    autoscaler_enabled: bool,
    /// OTLP/HTTP endpoint for traces, one span per reconcile (e.g. http://otel-collector:4318);
    /// no export when unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// The agents' admin key: sent as `Authorization: Bearer` on adapter loads/unloads, and given
    /// to every agent pod the operator creates through a Secret `<deployment>-agent-admin`, so the
    /// agents accept the operator's pushes and refuse tenants (403). Set it from a Secret (the
    /// chart's `agent.adminApiKeySecret`); unset, pushes carry no key.
    #[arg(long, env = "PEREGRINE_ADMIN_API_KEY", hide_env_values = true)]
    admin_api_key: Option<String>,
    /// Log JSON lines instead of text.
    #[arg(long, env = "PEREGRINE_LOG_JSON", default_value_t = false, action = clap::ArgAction::Set)]
    log_json: bool,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Run a regression suite against a server (as rollouts do), for CI; exits 0 passed, 1 failed, 2 error.
    Regress(peregrine_operator::regression::cli::RegressArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if let Some(Command::Regress(regress)) = args.command.take() {
        std::process::exit(peregrine_operator::regression::cli::main(regress).await);
    }
    let telemetry = telemetry::init(args.otlp_endpoint.as_deref(), args.log_json).context("setting up logs and tracing")?;

    let scope = WatchScope::from_flags(&args.watch_namespaces).map_err(anyhow::Error::msg)?;
    info!(?scope, "watching");
    let client = Client::try_default().await.context("building Kubernetes client (in-cluster or KUBECONFIG)")?;
    let mut config = OperatorConfig {
        agent_port: args.agent_port,
        drain_seconds: args.agent_drain_seconds,
        startup_seconds: args.agent_startup_seconds,
        admin_api_key: args.admin_api_key.as_deref().and_then(AdminKey::new),
        ..OperatorConfig::default()
    };
    if let Some(image) = args.agent_image {
        config.agent_image = image;
    }
    let agent = HttpAgentClient::new(Duration::from_secs(args.agent_timeout_seconds))
        .context("building agent client")?
        .with_admin_key(config.admin_api_key.clone());
    let metrics = Metrics::default();
    let suite_client = OpenAiClient::new(Duration::from_secs(args.regression_timeout_seconds)).context("building regression client")?;
    let runner = Arc::new(HttpSuiteRunner { client: suite_client });
    let ctx = Context::new(client.clone(), config, Arc::new(agent), metrics.clone(), runner);

    let server_metrics = metrics.clone();
    let ready = Arc::new(AtomicBool::new(true));
    let listener = tokio::net::TcpListener::bind(args.metrics_addr).await.with_context(|| format!("binding {}", args.metrics_addr))?;
    info!(addr = %args.metrics_addr, "serving /metrics, /healthz, /readyz");
    let server = tokio::spawn(async move { axum::serve(listener, router(ServerState { metrics: server_metrics, ready })).await });

    let autoscaler = if args.autoscaler_enabled {
        let config = AutoscalerConfig {
            interval: Duration::from_secs(args.autoscaler_interval_seconds),
            scrape_timeout: Duration::from_secs(args.autoscaler_scrape_timeout_seconds),
            scope: scope.clone(),
        };
        Some(Autoscaler::new(client.clone(), config, metrics.autoscaler.clone()).context("building autoscaler")?)
    } else {
        None
    };

    let controllers = async {
        // The autoscaler loops forever; the controllers end on a shutdown signal, which ends this.
        let autoscale = async {
            match autoscaler {
                Some(a) => a.run().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            // One pair of controllers per watched namespace (or one cluster-wide pair): a
            // namespaced install may not list anything outside its namespaces.
            _ = futures::future::join_all(scope.watches().into_iter().flat_map(|namespace| {
                let md: futures::future::LocalBoxFuture<'static, ()> = Box::pin(model_deployment::run(ctx.clone(), namespace.clone()));
                let lora: futures::future::LocalBoxFuture<'static, ()> = Box::pin(lora_adapter::run(ctx.clone(), namespace));
                [md, lora]
            })) => {}
            () = autoscale => {}
        }
    };

    if args.leader_election {
        let identity = std::env::var("POD_NAME").unwrap_or_else(|_| format!("peregrine-operator-{}", std::process::id()));
        let lock = LeaseLock::new(Api::<Lease>::namespaced(client, &args.lease_namespace), args.lease_name, identity, Duration::from_secs(15));
        info!("waiting for leadership");
        leader::acquire(&lock).await;
        info!("leading: starting controllers");
        tokio::select! {
            _ = controllers => info!("controllers stopped"),
            _ = leader::hold(&lock) => {
                // Exiting is the only safe way to stop acting at once; the Deployment restarts us
                // as a standby.
                error!("lost leadership; exiting");
                // exit() skips destructors: flush the last spans first.
                drop(telemetry);
                std::process::exit(1);
            }
        }
    } else {
        controllers.await;
    }
    server.abort();
    drop(telemetry);
    Ok(())
}
