//! The Grafana dashboards of `docs/dashboards/` (shipped by the chart as ConfigMaps) name only
//! metrics that exist: every metric in every PromQL expression and variable query is a family the
//! agent exposes (`peregrine_api::metric_names::FAMILIES`, which the agent's own test checks
//! against a scrape) or one the operator's registry encodes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use peregrine_operator::metrics::Metrics;
use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn dashboards() -> Vec<(String, Value)> {
    let dir = repo_root().join("docs/dashboards");
    let mut out: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Every PromQL text of a dashboard: panel target expressions and query-variable definitions.
fn queries(dashboard: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            out.push(target["expr"].as_str().unwrap().to_string());
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] == "query" {
            out.push(var["query"]["query"].as_str().unwrap().to_string());
        }
    }
    out
}

/// Removes every `open ... close` span (not nested across kinds; PromQL's are not).
fn strip(text: &str, open: char, close: char) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    for c in text.chars() {
        if c == open {
            depth += 1;
        } else if c == close && depth > 0 {
            depth -= 1;
        } else if depth == 0 {
            out.push(c);
        }
    }
    out
}

/// The metric names a PromQL expression reads: identifiers outside strings, label matchers `{}`,
/// ranges `[]` and grouping lists (`by (...)`, `without (...)`, `on (...)`, `ignoring (...)`),
/// that are not function calls, keywords or numbers. `label_values(metric..., label)` names its
/// metric like any call argument; its trailing label name is dropped with the grouping rule.
fn metric_names(expr: &str) -> BTreeSet<String> {
    // Strings first (they may hold any character), then matchers and ranges.
    let mut no_strings = String::new();
    let mut in_string = false;
    for c in expr.chars() {
        if c == '"' {
            in_string = !in_string;
        } else if !in_string {
            no_strings.push(c);
        }
    }
    let mut text = strip(&strip(&no_strings, '{', '}'), '[', ']');
    let grouping = regex::Regex::new(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)").unwrap();
    text = grouping.replace_all(&text, " ").into_owned();
    let label_values = regex::Regex::new(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)").unwrap();
    text = label_values.replace_all(&text, "label_values($1)").into_owned();
    let ident = regex::Regex::new(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?").unwrap();
    let keywords = ["and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"];
    ident
        .captures_iter(&text)
        .filter(|c| c.get(1).is_none())
        .map(|c| c[0].to_string())
        .filter(|name| !keywords.contains(&name.as_str()))
        // `$var` leftovers (`$__rate_interval` sits in a range, variables in matchers).
        .filter(|name| !name.starts_with("__"))
        .collect()
}

/// Families the operator's `/metrics` has, by their `# TYPE` names, with every series present.
fn operator_families() -> BTreeSet<String> {
    let metrics = Metrics::default();
    metrics.record_replicas("ns", "md", 2, 1);
    metrics.record_rollout_step("ns", "md", Some(0));
    metrics.record_adapter("ns", "adapter", 1, 2);
    metrics.adapter_call("load", false);
    drop(metrics.reconcile_started("modeldeployment"));
    metrics.reconcile_failed("modeldeployment", &peregrine_operator::Error::MissingField("x"));
    metrics.autoscaler.record_decision("ns", "md", 3, peregrine_operator::autoscaler::decision::Reason::Stabilizing);
    metrics.autoscaler.scrape_failures.get_or_create(&peregrine_operator::autoscaler::metrics::DeploymentLabels { namespace: "ns".into(), name: "md".into() }).inc();
    metrics.autoscaler.capacity_output_tokens.get_or_create(&peregrine_operator::autoscaler::metrics::DeploymentLabels { namespace: "ns".into(), name: "md".into() }).set(10.0);
    metrics
        .encode()
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// `name` is `family` or one of its samples (`_total`, `_bucket`, `_sum`, `_count`, `_created`).
fn belongs(name: &str, families: &BTreeSet<String>) -> bool {
    families.contains(name)
        || ["_total", "_bucket", "_sum", "_count", "_created"].iter().any(|s| name.strip_suffix(s).is_some_and(|base| families.contains(base)))
}

#[test]
fn the_extractor_finds_metrics_and_nothing_else() {
    let expr = r#"histogram_quantile(0.99, sum by (le, pod) (rate(peregrine_time_to_first_token_seconds_bucket{namespace=~"$namespace", le="0.5"}[$__rate_interval]))) / on (pod) group_left sum without (code) (vllm:lora_requests_info > 0)"#;
    assert_eq!(metric_names(expr), BTreeSet::from(["peregrine_time_to_first_token_seconds_bucket".to_string(), "vllm:lora_requests_info".to_string()]));
    assert_eq!(metric_names(r#"label_values(peregrine_num_requests_running{namespace=~"$namespace"}, pod)"#), BTreeSet::from(["peregrine_num_requests_running".to_string()]));
    let families = BTreeSet::from(["peregrine_request_errors".to_string()]);
    assert!(belongs("peregrine_request_errors_total", &families));
    assert!(!belongs("peregrine_request_error_total", &families));
}

#[test]
fn every_metric_a_dashboard_queries_is_exported() {
    let mut families = operator_families();
    assert!(families.contains("peregrine_operator_rollout_step") && families.contains("peregrine_autoscaler_desired_replicas"), "{families:?}");
    families.extend(peregrine_api::metric_names::FAMILIES.iter().map(|s| s.to_string()));
    let all = dashboards();
    assert_eq!(all.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["peregrine-agent.json", "peregrine-operator.json"]);
    for (file, dashboard) in &all {
        let mut named = 0;
        for expr in queries(dashboard) {
            let names = metric_names(&expr);
            assert!(!names.is_empty(), "{file}: no metric in {expr}");
            for name in names {
                assert!(belongs(&name, &families), "{file}: {name} (in `{expr}`) is exported by neither the agent nor the operator");
                named += 1;
            }
        }
        assert!(named >= 10, "{file}: {named} metric references");
    }
}

#[test]
fn dashboards_cover_what_people_look_at() {
    let all = dashboards();
    let text = |file: &str| all.iter().find(|(n, _)| n == file).map(|(_, d)| queries(d).join("\n")).unwrap();
    let agent = text("peregrine-agent.json");
    for metric in [
        "peregrine_time_to_first_token_seconds_bucket",
        "peregrine_time_per_output_token_seconds_bucket",
        "peregrine_e2e_request_latency_seconds_bucket",
        "peregrine_generation_tokens_total",
        "peregrine_num_requests_waiting",
        "peregrine_kv_cache_usage_ratio",
        "peregrine_num_preemptions_total",
        "peregrine_operator_adapter_loaded_replicas",
        "vllm:lora_requests_info",
        "peregrine_request_errors_total",
    ] {
        assert!(agent.contains(metric), "agent dashboard lacks {metric}");
    }
    let operator = text("peregrine-operator.json");
    for metric in [
        "peregrine_operator_model_deployment_replicas",
        "peregrine_autoscaler_desired_replicas",
        "peregrine_time_to_first_token_seconds_count",
        "peregrine_operator_rollout_step",
        "peregrine_operator_reconcile_failures_total",
    ] {
        assert!(operator.contains(metric), "operator dashboard lacks {metric}");
    }
    // Every panel reads the datasource variable, so the dashboards import into any Grafana.
    for (file, dashboard) in &all {
        for panel in dashboard["panels"].as_array().unwrap() {
            assert_eq!(panel["datasource"]["uid"], "${datasource}", "{file}: {}", panel["title"]);
        }
        assert!(dashboard["uid"].as_str().is_some_and(|u| !u.is_empty()), "{file}");
    }
}

#[test]
fn the_chart_ships_the_same_files() {
    // charts/peregrine/dashboards/ links to docs/dashboards/ (Helm follows the links when it loads
    // the chart), so the two cannot drift.
    for (file, _) in dashboards() {
        let in_chart = std::fs::read(repo_root().join("charts/peregrine/dashboards").join(&file)).unwrap_or_else(|e| panic!("{file} not in the chart: {e}"));
        assert_eq!(in_chart, std::fs::read(repo_root().join("docs/dashboards").join(&file)).unwrap(), "{file}");
    }
}
