//! The autoscaler against real agents: two `peregrine-agent serve` processes on SmolLM2 (CPU, one
//! thread, two sequences each) under a load generator. The operator's real scraper reads their
//! `/metrics`, the real window turns the scrapes into a fleet snapshot, and the real decision
//! function must order a scale-up for the overload, no scale-up once the load is gone, and hold on
//! a ready pod it cannot read instead of taking it for idle.
//!
//! Needs the agent binary (`cargo test --workspace` builds it, as `make test` does; or `PEREGRINE_AGENT_BIN`)
//! and the test model (`make model`). Loopback only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use peregrine_crds::AutoscalingSpec;
use peregrine_e2e_operator::{Agent, MODEL};
use peregrine_operator::autoscaler::scraper::Scraper;
use peregrine_operator::autoscaler::{decide, DecisionInput, DecisionState, FleetSnapshot, PodObservation, PodState, Reason, ScrapeWindow};
use serde_json::json;

const CLIENTS: usize = 16;
const LOAD: Duration = Duration::from_secs(6);

/// Scrapes every `(pod, base_url)` the way the controller does for ready pods.
async fn observe(scraper: &Scraper, pods: &[(&str, &str)]) -> Vec<PodObservation> {
    let mut out = Vec::new();
    for (pod, url) in pods {
        let state = match scraper.scrape(url).await {
            Ok(metrics) => PodState::Scraped(metrics),
            Err(e) => PodState::Unreachable(e.to_string()),
        };
        out.push(PodObservation { pod: pod.to_string(), state });
    }
    out
}

/// One client: completions back to back, alternating agents, until told to stop.
async fn client(urls: [String; 2], stop: Arc<AtomicBool>, id: usize) -> usize {
    let http = reqwest::Client::new();
    let mut done = 0;
    while !stop.load(Ordering::Relaxed) {
        let url = &urls[(id + done) % 2];
        let body = json!({"model": MODEL, "prompt": format!("Client {id} asks: tell me a story about"), "max_tokens": 16, "temperature": 0});
        let response = http.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
        assert!(response.status().is_success(), "{}", response.text().await.unwrap());
        done += 1;
    }
    done
}

fn spec() -> AutoscalingSpec {
    // The overload must breach the TTFT SLO or the queue target; scale-ups act at once (no
    // stabilization) so that one decision shows the response.
    serde_json::from_value(json!({
        "minReplicas": 1, "maxReplicas": 8,
        "slo": {"ttftP95Seconds": 0.2, "tpotP95Seconds": 1.0},
        "maxQueueDepthPerReplica": 2,
        "scaleUpStabilizationSeconds": 0,
        "evaluationWindowSeconds": 60
    }))
    .unwrap()
}

fn decide_once(spec: &AutoscalingSpec, now: f64, replicas: i32, snapshot: &FleetSnapshot) -> peregrine_operator::autoscaler::Decision {
    let input = DecisionInput { now, current_replicas: replicas, snapshot, capacity: None, wake_requested: false, gpus_per_replica: 1 };
    decide(spec, &mut DecisionState::default(), &input)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraper_and_decision_respond_to_a_real_overload() {
    let started = Instant::now();
    let clock = || started.elapsed().as_secs_f64();
    let a = Agent::start(&["--max-num-seqs", "2"]).await;
    let b = Agent::start(&["--max-num-seqs", "2"]).await;
    let pods = [("agent-0", a.url.as_str()), ("agent-1", b.url.as_str())];
    let scraper = Scraper::new(Duration::from_secs(3)).unwrap();
    let spec = spec();

    // Baseline, then the load, then a scrape while the queues are still full.
    let mut window = ScrapeWindow::new(60.0);
    let baseline = window.observe(clock(), &observe(&scraper, &pods).await);
    assert_eq!((baseline.ready, baseline.unreachable.len()), (2, 0), "{baseline:?}");
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = tokio::task::JoinSet::new();
    for id in 0..CLIENTS {
        load.spawn(client([a.url.clone(), b.url.clone()], stop.clone(), id));
    }
    tokio::time::sleep(LOAD).await;
    let overloaded = window.observe(clock(), &observe(&scraper, &pods).await);
    stop.store(true, Ordering::Relaxed);
    let mut completed = 0;
    while let Some(done) = load.join_next().await {
        completed += done.unwrap();
    }
    eprintln!("overload: {completed} completions; snapshot {overloaded:?}");

    assert!(overloaded.requests_in_window > 0.0, "the agents' TTFT histograms saw the load: {overloaded:?}");
    let ttft = overloaded.ttft_p95.unwrap();
    assert!(ttft > 0.2, "16 clients on 4 sequence slots queue: p95 TTFT {ttft}");
    assert!(overloaded.queue_depth_per_replica.unwrap() > 0.0, "{overloaded:?}");
    let up = decide_once(&spec, clock(), 2, &overloaded);
    assert!(up.to_replicas > 2, "{up:?}");
    assert!(matches!(up.reason, Reason::TtftAboveSlo | Reason::QueueDepth), "{up:?}");

    // The load is gone (every client finished its last request): a fresh window sees idle agents.
    let mut window = ScrapeWindow::new(60.0);
    window.observe(clock(), &observe(&scraper, &pods).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let quiet = window.observe(clock(), &observe(&scraper, &pods).await);
    assert!(quiet.complete() && quiet.idle(), "{quiet:?}");
    let calm = decide_once(&spec, clock(), 2, &quiet);
    assert!(calm.to_replicas <= 2, "{calm:?}");
    assert!(!matches!(calm.reason, Reason::TtftAboveSlo | Reason::TpotAboveSlo | Reason::QueueDepth), "{calm:?}");

    // A third ready pod that does not answer is reported and holds the size: never read as idle.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let three = [pods[0], pods[1], ("agent-2", closed.as_str())];
    let missing = window.observe(clock(), &observe(&scraper, &three).await);
    assert_eq!(missing.ready, 3);
    assert_eq!(missing.unreachable.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(), ["agent-2"]);
    let held = decide_once(&spec, clock(), 3, &missing);
    assert_eq!((held.to_replicas, held.reason), (3, Reason::MissingMetrics), "{held:?}");
    assert!(held.message.contains("agent-2"), "{}", held.message);
    assert!(started.elapsed() < Duration::from_secs(90), "took {:?}", started.elapsed());
}
