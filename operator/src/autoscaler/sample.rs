//! One scrape of one agent's `/metrics`, reduced to the series the autoscaler reads.
//!
//! The text is parsed by `prometheus-parse`; this module only picks the agent's metric names out of
//! the result (the names are defined once, in `peregrine_api::metric_names`, where the agent takes
//! them too). Series of every `model` label value are summed: a pod serves one base model and its
//! LoRA adapters (each under its own model name), and all of them load the same replica.

use std::io;

use peregrine_api::metric_names as names;

use super::histogram::Histogram;

/// Time to first token (histogram).
pub const TTFT: &str = names::TIME_TO_FIRST_TOKEN_SECONDS;
/// Time per output token after the first (histogram).
pub const TPOT: &str = names::TIME_PER_OUTPUT_TOKEN_SECONDS;
/// End-to-end request latency (histogram).
pub const E2E: &str = names::E2E_REQUEST_LATENCY_SECONDS;
/// Time spent waiting before the first schedule (histogram).
pub const QUEUE_TIME: &str = names::QUEUE_TIME_SECONDS;
/// Requests in the running batch (gauge).
pub const RUNNING: &str = names::NUM_REQUESTS_RUNNING;
/// Requests waiting to be admitted (gauge).
pub const WAITING: &str = names::NUM_REQUESTS_WAITING;
/// Fraction of KV-cache blocks in use (gauge).
pub const KV_USAGE: &str = names::KV_CACHE_USAGE_RATIO;
/// Output tokens generated (counter).
pub const GENERATION_TOKENS: &str = names::GENERATION_TOKENS_TOTAL;
/// Prompt tokens processed (counter).
pub const PROMPT_TOKENS: &str = names::PROMPT_TOKENS_TOTAL;

#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error("unreadable metrics text: {0}")]
    Parse(#[from] io::Error),
    #[error("metric {0}: series have different bucket bounds")]
    BucketMismatch(&'static str),
}

/// The autoscaler's view of one pod at one instant. Absent fields were not exported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodMetrics {
    pub ttft: Option<Histogram>,
    pub tpot: Option<Histogram>,
    pub e2e: Option<Histogram>,
    pub queue_time: Option<Histogram>,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// Mean over the pod's series (one per model label value share one cache).
    pub kv_usage: Option<f64>,
    pub generation_tokens: Option<f64>,
    pub prompt_tokens: Option<f64>,
}

/// Parses one `/metrics` body (Prometheus text exposition format).
pub fn parse(text: &str) -> Result<PodMetrics, SampleError> {
    let lines = text.lines().map(|line| Ok::<_, io::Error>(line.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines)?;
    let mut pod = PodMetrics::default();
    let mut kv_series = 0u32;
    for sample in &scrape.samples {
        match &sample.value {
            prometheus_parse::Value::Histogram(buckets) => {
                let (slot, name) = match sample.metric.as_str() {
                    TTFT => (&mut pod.ttft, TTFT),
                    TPOT => (&mut pod.tpot, TPOT),
                    E2E => (&mut pod.e2e, E2E),
                    QUEUE_TIME => (&mut pod.queue_time, QUEUE_TIME),
                    _ => continue,
                };
                let mut bounds: Vec<(f64, f64)> = buckets.iter().map(|b| (b.less_than, b.count)).collect();
                bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
                let labels = &sample.labels;
                let sum = series_value(&scrape, &format!("{name}_sum"), labels);
                let count = series_value(&scrape, &format!("{name}_count"), labels)
                    .or_else(|| bounds.last().map(|b| b.1));
                let hist = Histogram::new(bounds, sum.unwrap_or(0.0), count.unwrap_or(0.0));
                match slot {
                    Some(acc) => acc.add(&hist).map_err(|_| SampleError::BucketMismatch(name))?,
                    None => *slot = Some(hist),
                }
            }
            value => {
                let v = match value {
                    prometheus_parse::Value::Counter(v)
                    | prometheus_parse::Value::Gauge(v)
                    | prometheus_parse::Value::Untyped(v) => *v,
                    _ => continue,
                };
                if !v.is_finite() {
                    continue;
                }
                let slot = match sample.metric.as_str() {
                    RUNNING => &mut pod.running,
                    WAITING => &mut pod.waiting,
                    KV_USAGE => {
                        kv_series += 1;
                        &mut pod.kv_usage
                    }
                    GENERATION_TOKENS => &mut pod.generation_tokens,
                    PROMPT_TOKENS => &mut pod.prompt_tokens,
                    _ => continue,
                };
                *slot = Some(slot.unwrap_or(0.0) + v);
            }
        }
    }
    if let Some(kv) = pod.kv_usage.as_mut() {
        *kv /= f64::from(kv_series.max(1));
    }
    Ok(pod)
}

/// The value of the series `metric` with exactly `labels`, as the parser left `_sum`/`_count` lines.
fn series_value(scrape: &prometheus_parse::Scrape, metric: &str, labels: &prometheus_parse::Labels) -> Option<f64> {
    scrape.samples.iter().find_map(|s| {
        if s.metric != metric || s.labels != *labels {
            return None;
        }
        match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Written the way prometheus-client (the agent's exporter) encodes it: counters typed without
    // the `_total` suffix, `+Inf` bucket, EOF marker.
    const TEXT: &str = r#"# HELP peregrine_time_to_first_token_seconds Time to first token.
# TYPE peregrine_time_to_first_token_seconds histogram
peregrine_time_to_first_token_seconds_sum{model="smol"} 3.5
peregrine_time_to_first_token_seconds_count{model="smol"} 10
peregrine_time_to_first_token_seconds_bucket{le="0.1",model="smol"} 2
peregrine_time_to_first_token_seconds_bucket{le="0.5",model="smol"} 8
peregrine_time_to_first_token_seconds_bucket{le="+Inf",model="smol"} 10
peregrine_time_to_first_token_seconds_sum{model="smol-lora"} 1.0
peregrine_time_to_first_token_seconds_count{model="smol-lora"} 4
peregrine_time_to_first_token_seconds_bucket{le="0.1",model="smol-lora"} 1
peregrine_time_to_first_token_seconds_bucket{le="0.5",model="smol-lora"} 4
peregrine_time_to_first_token_seconds_bucket{le="+Inf",model="smol-lora"} 4
# TYPE peregrine_num_requests_waiting gauge
peregrine_num_requests_waiting{model="smol"} 3
peregrine_num_requests_waiting{model="smol-lora"} 1
# TYPE peregrine_kv_cache_usage_ratio gauge
peregrine_kv_cache_usage_ratio{model="smol"} 0.5
# TYPE peregrine_generation_tokens counter
peregrine_generation_tokens_total{model="smol"} 1200
# EOF
"#;

    #[test]
    fn sums_series_of_every_model_label() {
        let pod = parse(TEXT).unwrap();
        let ttft = pod.ttft.unwrap();
        assert_eq!(ttft.count, 14.0);
        assert_eq!(ttft.sum, 4.5);
        assert_eq!(ttft.buckets, vec![(0.1, 3.0), (0.5, 12.0), (f64::INFINITY, 14.0)]);
        assert_eq!(pod.waiting, Some(4.0));
        assert_eq!(pod.kv_usage, Some(0.5));
        assert_eq!(pod.generation_tokens, Some(1200.0));
        assert_eq!(pod.tpot, None);
        assert_eq!(pod.running, None);
    }

    #[test]
    fn mismatched_buckets_are_an_error() {
        let text = "# TYPE peregrine_time_per_output_token_seconds histogram\n\
            peregrine_time_per_output_token_seconds_bucket{le=\"0.1\",model=\"a\"} 1\n\
            peregrine_time_per_output_token_seconds_bucket{le=\"+Inf\",model=\"a\"} 1\n\
            peregrine_time_per_output_token_seconds_bucket{le=\"0.2\",model=\"b\"} 1\n\
            peregrine_time_per_output_token_seconds_bucket{le=\"+Inf\",model=\"b\"} 1\n";
        assert!(matches!(parse(text), Err(SampleError::BucketMismatch(TPOT))));
    }
}
