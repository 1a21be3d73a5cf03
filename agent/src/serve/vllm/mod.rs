//! vLLM's metric contract, beside the `peregrine_*` series: the names, types, labels and buckets
//! that inference gateways (Gateway API Inference Extension's endpoint picker, llm-d, AIBrix) read
//! from a vLLM pod, so they route to an agent unchanged. Names in
//! [`peregrine_api::metric_names::vllm`] (vLLM v0.10 series, v1 engine).
//!
//! As in vLLM, every series is labelled with the served model name (the base model, never an
//! adapter: adapters appear only in `vllm:lora_requests_info`), so these series never grow with the
//! number of adapters or with what clients send.

pub mod activity;

use std::sync::Arc;

use peregrine_api::metric_names::vllm as names;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use activity::{ActivityGuard, RequestActivity};

use super::backend::{BackendStats, EngineShape};

/// Label pairs; the names come from `metric_names::vllm`.
type Labels = Vec<(&'static str, String)>;

/// vLLM runs one engine core per process without data parallelism; its index is this label.
const ENGINE_INDEX: &str = "0";

/// `{model_name, engine}`: the one label set of every per-model series. The single place the
/// `model_name` value is decided.
fn model_labels(served_model: &str) -> Labels {
    vec![(names::LABEL_MODEL_NAME, served_model.to_string()), (names::LABEL_ENGINE, ENGINE_INDEX.to_string())]
}

/// The series updated per request. Single series each (one label set), so the handles are held
/// directly: no family lookup per token.
#[derive(Clone)]
pub struct VllmMetrics {
    activity: Arc<RequestActivity>,
    pub time_to_first_token: Histogram,
    pub time_per_output_token: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
}

impl std::fmt::Debug for VllmMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VllmMetrics")
    }
}

fn histogram(registry: &mut Registry, name: &str, help: &str, labels: &Labels, buckets: &[f64]) -> Histogram {
    let h = Histogram::new(buckets.iter().copied());
    registry.register(name, help, SingleSeries { labels: labels.clone(), metric: h.clone() });
    h
}

fn counter(registry: &mut Registry, name: &str, help: &str, labels: &Labels) -> Counter {
    let c = Counter::default();
    registry.register(name, help, SingleSeries { labels: labels.clone(), metric: c.clone() });
    c
}

impl VllmMetrics {
    /// Registers vLLM's series. `stats` is read on every scrape for the engine-wide gauges.
    pub fn register(
        registry: &mut Registry,
        served_model: &str,
        shape: EngineShape,
        stats: impl Fn() -> BackendStats + Send + Sync + 'static,
    ) -> Self {
        let labels = model_labels(served_model);
        let activity = Arc::new(RequestActivity::default());
        let metrics = VllmMetrics {
            activity: activity.clone(),
            time_to_first_token: histogram(
                registry,
                names::TIME_TO_FIRST_TOKEN_SECONDS,
                "Histogram of time to first token in seconds.",
                &labels,
                names::TIME_TO_FIRST_TOKEN_BUCKETS,
            ),
            time_per_output_token: histogram(
                registry,
                names::TIME_PER_OUTPUT_TOKEN_SECONDS,
                "Histogram of time per output token in seconds.",
                &labels,
                names::TIME_PER_OUTPUT_TOKEN_BUCKETS,
            ),
            e2e_request_latency: histogram(
                registry,
                names::E2E_REQUEST_LATENCY_SECONDS,
                "Histogram of e2e request latency in seconds.",
                &labels,
                names::REQUEST_LATENCY_BUCKETS,
            ),
            request_queue_time: histogram(
                registry,
                names::REQUEST_QUEUE_TIME_SECONDS,
                "Histogram of time spent in WAITING phase for request.",
                &labels,
                names::REQUEST_LATENCY_BUCKETS,
            ),
            prompt_tokens: counter(registry, names::PROMPT_TOKENS, "Number of prefill tokens processed.", &labels),
            generation_tokens: counter(registry, names::GENERATION_TOKENS, "Number of generation tokens processed.", &labels),
            prefix_cache_queries: counter(
                registry,
                names::PREFIX_CACHE_QUERIES,
                "Prefix cache queries, in terms of number of queried tokens.",
                &labels,
            ),
            prefix_cache_hits: counter(
                registry,
                names::PREFIX_CACHE_HITS,
                "Prefix cache hits, in terms of number of cached tokens.",
                &labels,
            ),
        };
        registry.register_collector(Box::new(SchedulerCollector { labels, shape, activity, stats }));
        metrics
    }

    /// A new request (waiting until [`ActivityGuard::scheduled`]); `adapter` None for the base model.
    pub fn enter(&self, adapter: Option<String>) -> ActivityGuard {
        self.activity.enter(adapter)
    }
}

/// One series with a fixed label set, registered as a metric: what vLLM's
/// `metric.labels(model_name, engine)` makes, without a map behind it.
#[derive(Debug)]
struct SingleSeries<M> {
    labels: Labels,
    metric: M,
}

impl<M: EncodeMetric> EncodeMetric for SingleSeries<M> {
    fn encode(&self, mut encoder: prometheus_client::encoding::MetricEncoder) -> Result<(), std::fmt::Error> {
        self.metric.encode(encoder.encode_family(&self.labels)?)
    }

    fn metric_type(&self) -> MetricType {
        self.metric.metric_type()
    }
}

/// The gauges read at scrape time: queue, KV usage, cache configuration, LoRA requests.
struct SchedulerCollector<F> {
    labels: Labels,
    shape: EngineShape,
    activity: Arc<RequestActivity>,
    stats: F,
}

impl<F> std::fmt::Debug for SchedulerCollector<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SchedulerCollector")
    }
}

fn gauge<T: prometheus_client::encoding::EncodeGaugeValue + Send + Sync + std::fmt::Debug>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    labels: &Labels,
    value: T,
) -> Result<(), std::fmt::Error>
where
    ConstGauge<T>: EncodeMetric,
{
    ConstGauge::new(value).encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?.encode_family(labels)?)
}

impl<F: Fn() -> BackendStats + Send + Sync + 'static> prometheus_client::collector::Collector for SchedulerCollector<F> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = (self.stats)();
        let now = self.activity.snapshot();
        let e = &mut encoder;
        gauge(e, names::NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.", &self.labels, now.running as i64)?;
        gauge(e, names::NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", &self.labels, now.waiting as i64)?;
        let kv = stats.kv_cache_usage_ratio.clamp(0.0, 1.0);
        gauge(e, names::GPU_CACHE_USAGE_PERC, "GPU KV-cache usage. 1 means 100 percent usage.", &self.labels, kv)?;
        gauge(e, names::KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.", &self.labels, kv)?;
        // vLLM's info metrics are gauges fixed at 1 with the configuration as labels.
        let cache_config = vec![
            (names::LABEL_BLOCK_SIZE, self.shape.kv_block_size.to_string()),
            (names::LABEL_NUM_GPU_BLOCKS, self.shape.num_kv_blocks.to_string()),
            (names::LABEL_ENGINE, ENGINE_INDEX.to_string()),
        ];
        gauge(e, names::CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", &cache_config, 1_i64)?;
        // The engine's own total, read at scrape time like the gauges.
        let mut preemptions = e.encode_descriptor(
            names::NUM_PREEMPTIONS,
            "Cumulative number of preemption from the engine.",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(stats.num_preemptions).encode(preemptions.encode_family(&self.labels)?)?;
        if let Some(max_loras) = self.shape.max_loras {
            // One series: the current adapters (names comma-joined, as vLLM writes them), valued
            // with the time they last changed. vLLM keeps every past combination as a series and
            // readers take the newest; a single one reads the same and cannot grow.
            let lora = vec![
                (names::LABEL_MAX_LORA, max_loras.to_string()),
                (names::LABEL_WAITING_LORA_ADAPTERS, now.waiting_adapters.join(",")),
                (names::LABEL_RUNNING_LORA_ADAPTERS, now.running_adapters.join(",")),
            ];
            gauge(e, names::LORA_REQUESTS_INFO, "Running stats on lora requests.", &lora, now.changed_at)?;
        }
        Ok(())
    }
}
