//! Percentiles and the summary table of a load-generator run, computed the way vLLM's
//! `benchmark_serving.py` does (linear interpolation between order statistics, like numpy's default).

use std::time::Duration;

use serde::Serialize;

/// What one request measured, at the client.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestResult {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// Send → the first chunk that carries text.
    pub ttft: Duration,
    /// Gaps between successive text chunks.
    pub itl: Vec<Duration>,
    /// Send → the end of the stream.
    pub latency: Duration,
}

impl RequestResult {
    /// Time per output token after the first; None for single-token answers.
    pub fn tpot(&self) -> Option<Duration> {
        (self.output_tokens > 1).then(|| self.latency.saturating_sub(self.ttft) / (self.output_tokens as u32 - 1))
    }
}

/// The `p`-th percentile (0..=100) of `xs`, interpolating linearly; NaN when empty.
pub fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    let k = (sorted.len() - 1) as f64 * p / 100.0;
    let lo = k.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (k - lo as f64)
}

/// Mean and percentiles of one latency figure, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Distribution {
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
}

impl Distribution {
    fn of(xs: &[Duration]) -> Distribution {
        let ms: Vec<f64> = xs.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        let mean_ms = if ms.is_empty() { f64::NAN } else { ms.iter().sum::<f64>() / ms.len() as f64 };
        Distribution { mean_ms, p50_ms: percentile(&ms, 50.0), p90_ms: percentile(&ms, 90.0), p99_ms: percentile(&ms, 99.0) }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub successful_requests: usize,
    pub failed_requests: usize,
    /// The first failure's message, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Distribution,
    pub tpot: Distribution,
    pub itl: Distribution,
}

impl Summary {
    pub fn new(results: &[Result<RequestResult, String>], duration: Duration) -> Summary {
        let ok: Vec<&RequestResult> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        let first_error = results.iter().find_map(|r| r.as_ref().err().cloned());
        let secs = duration.as_secs_f64().max(1e-9);
        let input: usize = ok.iter().map(|r| r.prompt_tokens).sum();
        let output: usize = ok.iter().map(|r| r.output_tokens).sum();
        let ttft: Vec<Duration> = ok.iter().map(|r| r.ttft).collect();
        let tpot: Vec<Duration> = ok.iter().filter_map(|r| r.tpot()).collect();
        let itl: Vec<Duration> = ok.iter().flat_map(|r| r.itl.iter().copied()).collect();
        Summary {
            successful_requests: ok.len(),
            failed_requests: results.len() - ok.len(),
            first_error,
            duration_s: secs,
            total_input_tokens: input,
            total_output_tokens: output,
            request_throughput: ok.len() as f64 / secs,
            output_token_throughput: output as f64 / secs,
            total_token_throughput: (input + output) as f64 / secs,
            ttft: Distribution::of(&ttft),
            tpot: Distribution::of(&tpot),
            itl: Distribution::of(&itl),
        }
    }

    /// The table `benchmark_serving.py` prints (and `scripts/bench_serve.py`).
    pub fn table(&self) -> String {
        let mut out = String::new();
        let mut line = |label: &str, value: String| out.push_str(&format!("{label:<40}{value}\n"));
        line("Successful requests:", self.successful_requests.to_string());
        let failed = match &self.first_error {
            Some(e) => format!("{}  (first: {e})", self.failed_requests),
            None => self.failed_requests.to_string(),
        };
        line("Failed requests:", failed);
        line("Benchmark duration (s):", format!("{:.2}", self.duration_s));
        line("Total input tokens:", self.total_input_tokens.to_string());
        line("Total generated tokens:", self.total_output_tokens.to_string());
        line("Request throughput (req/s):", format!("{:.2}", self.request_throughput));
        line("Output token throughput (tok/s):", format!("{:.2}", self.output_token_throughput));
        line("Total token throughput (tok/s):", format!("{:.2}", self.total_token_throughput));
        for (name, d) in [("TTFT", &self.ttft), ("TPOT", &self.tpot), ("ITL", &self.itl)] {
            line(
                &format!("{name} (ms) mean/p50/p90/p99:"),
                format!("{:.1} / {:.1} / {:.1} / {:.1}", d.mean_ms, d.p50_ms, d.p90_ms, d.p99_ms),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpy_linear() {
        // numpy.percentile([1, 2, 3, 4], [50, 90, 99]) = [2.5, 3.7, 3.97]
        let xs = [4.0, 1.0, 3.0, 2.0];
        assert!((percentile(&xs, 50.0) - 2.5).abs() < 1e-12);
        assert!((percentile(&xs, 90.0) - 3.7).abs() < 1e-12);
        assert!((percentile(&xs, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn summary_counts_and_tpot() {
        let ms = Duration::from_millis;
        let ok = RequestResult { prompt_tokens: 10, output_tokens: 5, ttft: ms(100), itl: vec![ms(10); 4], latency: ms(140) };
        let single = RequestResult { prompt_tokens: 3, output_tokens: 1, ttft: ms(50), itl: vec![], latency: ms(50) };
        assert_eq!(ok.tpot(), Some(ms(10)));
        assert_eq!(single.tpot(), None);
        let s = Summary::new(&[Ok(ok), Ok(single), Err("HTTP 429".into())], Duration::from_secs(2));
        assert_eq!((s.successful_requests, s.failed_requests), (2, 1));
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (13, 6));
        assert!((s.output_token_throughput - 3.0).abs() < 1e-9);
        assert!((s.ttft.p50_ms - 75.0).abs() < 1e-9);
        assert!((s.tpot.mean_ms - 10.0).abs() < 1e-9);
        let table = s.table();
        assert!(table.contains("Failed requests:                        1  (first: HTTP 429)"), "{table}");
        assert!(table.contains("TPOT (ms) mean/p50/p90/p99:             10.0 / 10.0 / 10.0 / 10.0"), "{table}");
    }
}
