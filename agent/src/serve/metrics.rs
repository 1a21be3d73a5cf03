//! Prometheus metrics (text exposition), labelled by `model` (base model or adapter name): what
//! the operator's autoscaler and dashboards read. Labels come only from models the server has
//! ([`served_label`]), an adapter's series go when it is unloaded ([`Metrics::forget_model`]), and
//! unlabelled server-wide totals sit beside them (`peregrine_server_*`), so `/metrics` stays
//! bounded by what is loaded, not by what clients send.

use std::sync::Arc;
use std::time::Duration;

use peregrine_api::metric_names as names;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::backend::{BackendStats, EngineShape, InferenceBackend};
use super::connections::ConnectionMetrics;
use super::vllm::VllmMetrics;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabels {
    pub model: String,
    pub finished_reason: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub code: String,
}

type HistogramFamily = Family<ModelLabel, Histogram, fn() -> Histogram>;

/// The label for `model` if the server serves it (the base model or a loaded adapter), else None.
/// Every label derived from a request's `model` goes through here, so a client cannot mint series.
pub fn served_label<B: InferenceBackend>(backend: &B, model: &str) -> Option<ModelLabel> {
    (model == backend.model_name() || backend.has_adapter(model)).then(|| ModelLabel { model: model.to_string() })
}

/// Every finish reason a request can end with (the `finished_reason` label's whole range).
const FINISH_REASONS: [&str; 3] = ["stop", "length", "abort"];

/// Unlabelled server-wide totals: they keep counting across adapter loads and unloads.
#[derive(Debug, Clone, Default)]
pub struct ServerTotals {
    pub running: Gauge,
    pub waiting: Gauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub requests_finished: Counter,
}

/// One model's series, looked up once per request: a request keeps updating its own handles even
/// if its adapter is unloaded meanwhile, without re-creating the dropped series.
#[derive(Debug, Clone)]
pub struct ModelSeries {
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
    pub e2e_latency: Histogram,
    pub queue_time: Histogram,
    pub running: Gauge,
    pub waiting: Gauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub prefix_cache_hit_tokens: Counter,
    /// Indexed like [`FINISH_REASONS`].
    finished: [Counter; 3],
    pub totals: ServerTotals,
}

impl ModelSeries {
    pub fn finished(&self, reason: &str) -> &Counter {
        let i = FINISH_REASONS.iter().position(|r| *r == reason).unwrap_or(FINISH_REASONS.len() - 1);
        &self.finished[i]
    }
}

fn latency_histogram() -> Histogram {
    // vLLM's TTFT/e2e buckets: 1 ms to several minutes.
    Histogram::new([
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0,
    ])
}

fn per_token_histogram() -> Histogram {
    // vLLM's TPOT buckets: 10 ms to 80 s per token (CPU decode sits at the low end).
    Histogram::new([
        0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0,
    ])
}

/// Everything `/metrics` reports. Cheap to clone (shared handles).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub time_to_first_token: HistogramFamily,
    pub time_per_output_token: HistogramFamily,
    pub e2e_latency: HistogramFamily,
    pub queue_time: HistogramFamily,
    pub running: Family<ModelLabel, Gauge>,
    pub waiting: Family<ModelLabel, Gauge>,
    pub prompt_tokens: Family<ModelLabel, Counter>,
    pub generation_tokens: Family<ModelLabel, Counter>,
    pub prefix_cache_hit_tokens: Family<ModelLabel, Counter>,
    pub requests_finished: Family<FinishLabels, Counter>,
    pub request_errors: Family<ErrorLabels, Counter>,
    /// vLLM's names for the gateways, beside ours.
    pub vllm: VllmMetrics,
    pub connections: ConnectionMetrics,
    pub totals: ServerTotals,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// Engine-wide figures read at scrape time from the backend.
struct EngineCollector<F> {
    model: String,
    stats: F,
}

impl<F> std::fmt::Debug for EngineCollector<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineCollector")
    }
}

impl<F: Fn() -> BackendStats + Send + Sync + 'static> prometheus_client::collector::Collector for EngineCollector<F> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = (self.stats)();
        let labels = ModelLabel { model: self.model.clone() };
        let kv = ConstGauge::<f64>::new(s.kv_cache_usage_ratio);
        kv.encode(encoder.encode_descriptor(
            names::KV_CACHE_USAGE_RATIO,
            "Fraction of KV cache blocks in use (1 means full).",
            None,
            MetricType::Gauge,
        )?.encode_family(&labels)?)?;
        ConstCounter::new(s.num_preemptions).encode(encoder.encode_descriptor(
            names::NUM_PREEMPTIONS,
            "Sequences preempted (recomputed later) because the KV cache ran out.",
            None,
            MetricType::Counter,
        )?.encode_family(&labels)?)?;
        if let Some(bytes) = s.kv_cache_bytes {
            ConstGauge::new(bytes as i64).encode(encoder.encode_descriptor(
                names::KV_CACHE_BYTES,
                "Bytes of the KV-cache pool (CPU backend: host memory, resident from the start).",
                None,
                MetricType::Gauge,
            )?)?;
        }
        ConstGauge::new(peregrine_engine::progress::weights().snapshot().fraction()).encode(encoder.encode_descriptor(
            names::LOAD_PROGRESS,
            super::loading::LOAD_PROGRESS_HELP,
            None,
            MetricType::Gauge,
        )?)?;
        if let Some(cache) = &s.adapter_cache {
            encode_adapter_cache(&mut encoder, cache)?;
        }
        if let Some(rss) = resident_memory_bytes() {
            ConstGauge::new(rss as i64).encode(encoder.encode_descriptor(
                names::PROCESS_RESIDENT_MEMORY_BYTES,
                "Resident memory of the process.",
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

/// The adapter cache's size beside the KV pool and process memory, so a pod's memory can be
/// accounted for; failed adapters by name (bounded by the adapters loaded).
fn encode_adapter_cache(encoder: &mut DescriptorEncoder, cache: &super::backend::AdapterCache) -> Result<(), std::fmt::Error> {
    let gauges: [(&str, &str, i64); 4] = [
        (names::LORA_CACHE_BYTES, "Bytes of LoRA adapter weights held in host memory.", cache.host_bytes as i64),
        (names::LORA_CACHE_ADAPTERS, "LoRA adapters whose weights are in host memory.", cache.host_adapters as i64),
        (names::LORA_SLOTS_USED, "Backend LoRA slots holding an adapter.", cache.slots_used as i64),
        (names::LORA_SLOTS, "Backend LoRA slots in all (--max-loras).", cache.slots as i64),
    ];
    for (name, help, value) in gauges {
        ConstGauge::new(value).encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
    }
    let mut family = encoder.encode_descriptor(
        names::LORA_ADAPTER_FAILED,
        "1 for each loaded LoRA adapter whose files can no longer be read (refused until loaded again).",
        None,
        MetricType::Gauge,
    )?;
    for name in &cache.failed {
        ConstGauge::new(1i64).encode(family.encode_family(&ModelLabel { model: name.clone() })?)?;
    }
    Ok(())
}

/// The process's resident set size (Linux: /proc/self/statm, in pages); None elsewhere.
pub fn resident_memory_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // 4 KiB pages: what x86-64 and the usual arm64 kernels use; reading sysconf would need libc.
    Some(pages.saturating_mul(4096))
}

impl Metrics {
    /// `stats` is called on every scrape for the engine-wide gauges.
    pub fn new(base_model: &str, shape: EngineShape, stats: impl Fn() -> BackendStats + Send + Sync + 'static) -> Self {
        let mut r = Registry::default();
        let stats = Arc::new(stats);
        let vllm_stats = stats.clone();
        let vllm = VllmMetrics::register(&mut r, base_model, shape, move || vllm_stats());
        let stats = move || stats();
        let time_to_first_token = HistogramFamily::new_with_constructor(latency_histogram);
        let time_per_output_token = HistogramFamily::new_with_constructor(per_token_histogram);
        let e2e_latency = HistogramFamily::new_with_constructor(latency_histogram);
        let queue_time = HistogramFamily::new_with_constructor(latency_histogram);
        let running = Family::<ModelLabel, Gauge>::default();
        let waiting = Family::<ModelLabel, Gauge>::default();
        let prompt_tokens = Family::<ModelLabel, Counter>::default();
        let generation_tokens = Family::<ModelLabel, Counter>::default();
        let prefix_cache_hit_tokens = Family::<ModelLabel, Counter>::default();
        let requests_finished = Family::<FinishLabels, Counter>::default();
        let request_errors = Family::<ErrorLabels, Counter>::default();
        r.register(names::TIME_TO_FIRST_TOKEN_SECONDS, "Time from arrival to the first token.", time_to_first_token.clone());
        r.register(names::TIME_PER_OUTPUT_TOKEN_SECONDS, "Time between consecutive output tokens.", time_per_output_token.clone());
        r.register(names::E2E_REQUEST_LATENCY_SECONDS, "Time from arrival to the last token.", e2e_latency.clone());
        r.register(names::QUEUE_TIME_SECONDS, "Time from arrival until first scheduled.", queue_time.clone());
        r.register(names::NUM_REQUESTS_RUNNING, "Requests being generated.", running.clone());
        r.register(names::NUM_REQUESTS_WAITING, "Requests admitted but not yet scheduled.", waiting.clone());
        r.register(names::PROMPT_TOKENS, "Prompt tokens of finished requests.", prompt_tokens.clone());
        r.register(names::GENERATION_TOKENS, "Generated tokens.", generation_tokens.clone());
        r.register(names::PREFIX_CACHE_HIT_TOKENS, "Prompt tokens whose KV came from the prefix cache.", prefix_cache_hit_tokens.clone());
        r.register(names::REQUEST_SUCCESS, "Finished requests by finish reason.", requests_finished.clone());
        r.register(names::REQUEST_ERRORS, "Requests refused or failed, by error code.", request_errors.clone());
        let totals = ServerTotals::default();
        r.register(names::SERVER_NUM_REQUESTS_RUNNING, "Requests being generated, all models.", totals.running.clone());
        r.register(names::SERVER_NUM_REQUESTS_WAITING, "Requests admitted but not yet scheduled, all models.", totals.waiting.clone());
        r.register(names::SERVER_PROMPT_TOKENS, "Prompt tokens of finished requests, all models.", totals.prompt_tokens.clone());
        r.register(names::SERVER_GENERATION_TOKENS, "Generated tokens, all models.", totals.generation_tokens.clone());
        r.register(names::SERVER_REQUESTS_FINISHED, "Finished requests (any reason), all models.", totals.requests_finished.clone());
        let connections = ConnectionMetrics::default();
        r.register(names::HTTP_CONNECTIONS_OPEN, "HTTP connections being served.", connections.open.clone());
        r.register(names::HTTP_CONNECTIONS_REFUSED, "Connections refused at --max-connections.", connections.refused.clone());
        r.register_collector(Box::new(EngineCollector { model: base_model.to_string(), stats }));
        // Make the base model's series visible (at zero) before the first request, so dashboards and
        // the autoscaler see a value rather than no data.
        let base = ModelLabel { model: base_model.to_string() };
        for fam in [&time_to_first_token, &time_per_output_token, &e2e_latency, &queue_time] {
            let _ = fam.get_or_create(&base);
        }
        for fam in [&running, &waiting] {
            let _ = fam.get_or_create(&base);
        }
        for fam in [&prompt_tokens, &generation_tokens, &prefix_cache_hit_tokens] {
            let _ = fam.get_or_create(&base);
        }
        Metrics {
            registry: Arc::new(r),
            time_to_first_token,
            time_per_output_token,
            e2e_latency,
            queue_time,
            running,
            waiting,
            prompt_tokens,
            generation_tokens,
            prefix_cache_hit_tokens,
            requests_finished,
            request_errors,
            vllm,
            connections,
            totals,
        }
    }

    pub fn render(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// The handles of one served model's series (see [`served_label`]).
    pub fn series(&self, label: &ModelLabel) -> ModelSeries {
        let finished = FINISH_REASONS.map(|reason| {
            self.requests_finished
                .get_or_create(&FinishLabels { model: label.model.clone(), finished_reason: reason.to_string() })
                .clone()
        });
        ModelSeries {
            time_to_first_token: self.time_to_first_token.get_or_create(label).clone(),
            time_per_output_token: self.time_per_output_token.get_or_create(label).clone(),
            e2e_latency: self.e2e_latency.get_or_create(label).clone(),
            queue_time: self.queue_time.get_or_create(label).clone(),
            running: self.running.get_or_create(label).clone(),
            waiting: self.waiting.get_or_create(label).clone(),
            prompt_tokens: self.prompt_tokens.get_or_create(label).clone(),
            generation_tokens: self.generation_tokens.get_or_create(label).clone(),
            prefix_cache_hit_tokens: self.prefix_cache_hit_tokens.get_or_create(label).clone(),
            finished,
            totals: self.totals.clone(),
        }
    }

    /// Drops every series labelled with `model` (an unloaded adapter); the server totals keep its
    /// counts.
    pub fn forget_model(&self, model: &str) {
        let label = ModelLabel { model: model.to_string() };
        for fam in [&self.time_to_first_token, &self.time_per_output_token, &self.e2e_latency, &self.queue_time] {
            fam.remove(&label);
        }
        for fam in [&self.running, &self.waiting] {
            fam.remove(&label);
        }
        for fam in [&self.prompt_tokens, &self.generation_tokens, &self.prefix_cache_hit_tokens] {
            fam.remove(&label);
        }
        for reason in FINISH_REASONS {
            self.requests_finished.remove(&FinishLabels { model: model.to_string(), finished_reason: reason.to_string() });
        }
    }

    pub fn label(model: &str) -> ModelLabel {
        ModelLabel { model: model.to_string() }
    }

    pub fn observe(fam: &HistogramFamily, model: &ModelLabel, d: Duration) {
        fam.get_or_create(model).observe(d.as_secs_f64());
    }

    pub fn error(&self, code: &str) {
        self.request_errors.get_or_create(&ErrorLabels { code: code.to_string() }).inc();
    }
}
