//! Would the API server accept our CRDs' CEL rules? It refuses a CRD whose rule's estimated cost is
//! over its static limits, and it estimates from the schema's bounds: a rule under a list without
//! `maxItems` is multiplied by as many items as a 3 MiB request could hold, a string without
//! `maxLength` is as long as the request. This test walks the generated CRD YAML, compiles every
//! `x-kubernetes-validations` rule with the `cel` crate, and fails on
//! - a rule that does not parse;
//! - a rule under a list or map without `maxItems`/`maxProperties` (its cardinality is unbounded);
//! - a rule that reads a string, list or object whose size is unbounded in a way that costs
//!   (compared, matched, iterated) - `has()` and `size()` are O(1) and need no bound;
//! - an estimated cost over the API server's limits: 10M per rule (`StaticEstimatedCostLimit`,
//!   cost of one evaluation times the rule's cardinality) and 100M per CRD
//!   (`StaticEstimatedCRDCostLimit`).
//!
//! The per-evaluation estimate follows CEL's cost model in spirit (1 per node, string traversal at
//! 0.1 per byte, comprehensions at list size times body), not to the unit: it is a guard against
//! schema changes that would blow the limits, and the bounds checks are exact.

use std::collections::HashMap;

use cel::common::ast::{Expr, IdedExpr, LiteralValue};
use serde_json::{json, Value};

/// The API server's per-rule estimated cost limit (apiextensions `StaticEstimatedCostLimit`).
const PER_RULE_LIMIT: u64 = 10_000_000;
/// The API server's per-CRD estimated cost limit (apiextensions `StaticEstimatedCRDCostLimit`).
const PER_CRD_LIMIT: u64 = 100_000_000;
/// CEL's cost of traversing one byte of a string (`common.StringTraversalCostFactor`).
const STRING_TRAVERSAL_FACTOR: f64 = 0.1;

/// One rule found in the schema: where it is, its text, and how many times it can run per object.
struct FoundRule {
    path: String,
    rule: String,
    node: Value,
    cardinality: u64,
}

/// What the check found wrong.
#[derive(Debug, Default)]
struct Report {
    problems: Vec<String>,
    total_cost: u64,
}

/// Walks a structural schema, collecting every rule with its node and cardinality (the product of
/// the bounds of the lists and maps above it).
fn collect_rules(node: &Value, path: &str, cardinality: Option<u64>, unbounded_at: Option<&str>, out: &mut Vec<FoundRule>, problems: &mut Vec<String>) {
    if let Some(rules) = node.get("x-kubernetes-validations").and_then(Value::as_array) {
        for rule in rules {
            let text = rule.get("rule").and_then(Value::as_str).unwrap_or_default().to_string();
            match (cardinality, unbounded_at) {
                (Some(cardinality), None) => out.push(FoundRule { path: path.to_string(), rule: text, node: node.clone(), cardinality }),
                (_, at) => problems.push(format!("{path}: rule {text:?} sits under the unbounded list/map {}", at.unwrap_or("?"))),
            }
        }
    }
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (name, child) in props {
            collect_rules(child, &format!("{path}.{name}"), cardinality, unbounded_at, out, problems);
        }
    }
    if let Some(items) = node.get("items") {
        let child_path = format!("{path}[*]");
        match node.get("maxItems").and_then(Value::as_u64) {
            Some(max) => collect_rules(items, &child_path, cardinality.map(|c| c.saturating_mul(max.max(1))), unbounded_at, out, problems),
            None => collect_rules(items, &child_path, None, Some(unbounded_at.unwrap_or(path)), out, problems),
        }
    }
    if let Some(values) = node.get("additionalProperties").filter(|v| v.is_object()) {
        let child_path = format!("{path}[*]");
        match node.get("maxProperties").and_then(Value::as_u64) {
            Some(max) => collect_rules(values, &child_path, cardinality.map(|c| c.saturating_mul(max.max(1))), unbounded_at, out, problems),
            None => collect_rules(values, &child_path, None, Some(unbounded_at.unwrap_or(path)), out, problems),
        }
    }
}

/// The schema the API server gives `self.metadata` at a CRD's root: only `name` and `generateName`
/// are visible to rules, both bounded by the API server itself.
fn root_metadata() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 253},
        "generateName": {"type": "string", "maxLength": 253}
    }})
}

/// Largest serialized size of a value of `node`, in bytes (1 for scalars), or why it is unbounded.
fn max_size(node: &Value, path: &str) -> Result<u64, String> {
    if let Some(values) = node.get("enum").and_then(Value::as_array) {
        return Ok(values.iter().map(|v| v.as_str().map_or(1, |s| s.len() as u64)).max().unwrap_or(1));
    }
    let kind = node.get("type").and_then(Value::as_str).unwrap_or("");
    let int_or_string = node.get("x-kubernetes-int-or-string").and_then(Value::as_bool).unwrap_or(false);
    if kind == "string" || int_or_string {
        if let Some(max) = node.get("maxLength").and_then(Value::as_u64) {
            return Ok(max);
        }
        // Formats the API server parses to fixed-size values.
        if matches!(node.get("format").and_then(Value::as_str), Some("date-time" | "date" | "duration")) {
            return Ok(64);
        }
        return Err(format!("{path} is a string without maxLength or enum"));
    }
    match kind {
        "array" => {
            let max = node.get("maxItems").and_then(Value::as_u64).ok_or_else(|| format!("{path} is a list without maxItems"))?;
            let item = max_size(node.get("items").unwrap_or(&Value::Null), &format!("{path}[*]"))?;
            Ok(max.saturating_mul(item))
        }
        "object" => {
            let mut total = 0u64;
            if let Some(props) = node.get("properties").and_then(Value::as_object) {
                for (name, child) in props {
                    total = total.saturating_add(max_size(child, &format!("{path}.{name}"))?);
                }
            }
            if let Some(values) = node.get("additionalProperties").filter(|v| v.is_object()) {
                let max = node.get("maxProperties").and_then(Value::as_u64).ok_or_else(|| format!("{path} is a map without maxProperties"))?;
                total = total.saturating_add(max.saturating_mul(max_size(values, &format!("{path}[*]"))?));
            }
            Ok(total.max(1))
        }
        _ => Ok(1),
    }
}

/// The schema node an expression evaluates to, when it is a field of the object.
type Typed = Option<(Value, String)>;

struct Estimator<'a> {
    self_node: &'a Value,
    self_path: &'a str,
    is_root: bool,
    /// Comprehension variables bound to list items.
    vars: HashMap<String, (Value, String)>,
    problems: Vec<String>,
}

impl Estimator<'_> {
    fn size(&mut self, typed: &Typed) -> u64 {
        match typed {
            Some((node, path)) => max_size(node, path).unwrap_or_else(|why| {
                self.problems.push(why);
                1
            }),
            // A literal or a computed value: its size is in the rule's text.
            None => 1,
        }
    }

    fn traverse(&mut self, typed: &Typed) -> u64 {
        (self.size(typed) as f64 * STRING_TRAVERSAL_FACTOR).ceil() as u64
    }

    /// Cost of one evaluation of `expr`, and the schema node it yields (if it is a field).
    fn cost(&mut self, expr: &IdedExpr) -> (u64, Typed) {
        match &expr.expr {
            Expr::Ident(name) if name == "self" || name == "oldSelf" => (1, Some((self.self_node.clone(), self.self_path.to_string()))),
            Expr::Ident(name) => (1, self.vars.get(name).cloned()),
            Expr::Literal(LiteralValue::String(s)) => (1, Some((json!({"type": "string", "maxLength": s.len()}), "literal".into()))),
            Expr::Literal(_) => (1, None),
            Expr::Select(select) => {
                let (cost, operand) = self.cost(&select.operand);
                if select.test {
                    return (cost + 1, None);
                }
                let child = operand.and_then(|(node, path)| {
                    if self.is_root && path == self.self_path && select.field == "metadata" {
                        return Some((root_metadata(), format!("{path}.metadata")));
                    }
                    node.get("properties").and_then(|p| p.get(&select.field)).map(|c| (c.clone(), format!("{path}.{}", select.field)))
                });
                (cost + 1, child)
            }
            Expr::Call(call) => {
                let mut cost = 1;
                let mut operands = Vec::new();
                if let Some(target) = &call.target {
                    let (c, t) = self.cost(target);
                    cost += c;
                    operands.push(t);
                }
                for arg in &call.args {
                    let (c, t) = self.cost(arg);
                    cost += c;
                    operands.push(t);
                }
                let name = call.func_name.as_str();
                match name {
                    // O(1): presence, size, logic, arithmetic and ordering of scalars.
                    "size" | "@not_strictly_false" | "_&&_" | "_||_" | "!_" | "_?_:_" | "_<_" | "_<=_" | "_>_" | "_>=_" | "_+_" | "_-_" | "_*_" | "_/_" | "_%_" | "-_" | "int" | "double" => {}
                    // Equality walks both sides.
                    "_==_" | "_!=_" => {
                        let a = self.traverse(&operands[0]);
                        let b = self.traverse(&operands[1]);
                        cost += a.min(b).max(1);
                    }
                    // `x in [..]`: one comparison per element.
                    "@in" => {
                        let elements = match &call.args.get(1).map(|a| &a.expr) {
                            Some(Expr::List(list)) => list.elements.len() as u64,
                            _ => self.size(&operands[1]),
                        };
                        cost += elements.saturating_mul(self.traverse(&operands[0]).max(1));
                    }
                    "_[_]" => {}
                    // String functions walk the receiver (and a regex is compiled and run over it).
                    "matches" | "contains" | "startsWith" | "endsWith" | "indexOf" | "lastIndexOf" | "lowerAscii" | "upperAscii" | "replace" | "split" | "trim" | "substring" | "find" | "findAll" | "isQuantity" | "quantity" | "string" => {
                        let receiver = self.traverse(&operands[0]);
                        let pattern = operands.get(1).map(|p| self.traverse(p)).unwrap_or(1).max(1);
                        cost += if name == "matches" || name.starts_with("find") { receiver.saturating_mul(pattern) } else { receiver.max(1) };
                    }
                    other => self.problems.push(format!("{}: no cost model for function {other:?}", self.self_path)),
                }
                (cost, None)
            }
            Expr::Comprehension(comp) => {
                let (range_cost, range) = self.cost(&comp.iter_range);
                let Some((node, path)) = range else {
                    self.problems.push(format!("{}: a comprehension over something not in the schema", self.self_path));
                    return (range_cost, None);
                };
                let (count, item) = match (node.get("items"), node.get("additionalProperties")) {
                    (Some(items), _) => (node.get("maxItems").and_then(Value::as_u64), (items.clone(), format!("{path}[*]"))),
                    (None, Some(_)) => (node.get("maxProperties").and_then(Value::as_u64), (json!({"type": "string", "maxLength": 253}), format!("{path}.key"))),
                    _ => (None, (Value::Null, path.clone())),
                };
                let Some(count) = count else {
                    self.problems.push(format!("{path}: iterated by a rule but has no maxItems/maxProperties"));
                    return (range_cost, None);
                };
                self.vars.insert(comp.iter_var.clone(), item);
                let (cond, _) = self.cost(&comp.loop_cond);
                let (step, _) = self.cost(&comp.loop_step);
                self.vars.remove(&comp.iter_var);
                (range_cost + count.saturating_mul(cond + step) + 1, None)
            }
            Expr::List(list) => {
                let mut cost = 1;
                for element in &list.elements {
                    cost += self.cost(element).0;
                }
                (cost, None)
            }
            _ => (1, None),
        }
    }
}

/// Checks every rule of one CRD version's schema.
fn check_schema(schema: &Value, name: &str) -> Report {
    let mut report = Report::default();
    let mut rules = Vec::new();
    collect_rules(schema, name, Some(1), None, &mut rules, &mut report.problems);
    for found in rules {
        let program = match cel::Program::compile(&found.rule) {
            Ok(program) => program,
            Err(err) => {
                report.problems.push(format!("{}: rule {:?} does not compile: {err}", found.path, found.rule));
                continue;
            }
        };
        let mut estimator = Estimator {
            self_node: &found.node,
            self_path: &found.path,
            is_root: found.path == name,
            vars: HashMap::new(),
            problems: Vec::new(),
        };
        let (per_evaluation, _) = estimator.cost(program.expression());
        for why in estimator.problems {
            report.problems.push(format!("{}: rule {:?}: {why}", found.path, found.rule));
        }
        let cost = per_evaluation.saturating_mul(found.cardinality);
        if cost > PER_RULE_LIMIT {
            report.problems.push(format!("{}: rule {:?} estimated cost {cost} is over {PER_RULE_LIMIT}", found.path, found.rule));
        }
        report.total_cost = report.total_cost.saturating_add(cost);
    }
    if report.total_cost > PER_CRD_LIMIT {
        report.problems.push(format!("{name}: the rules' total estimated cost {} is over {PER_CRD_LIMIT}", report.total_cost));
    }
    report
}

fn generated_crds() -> Vec<Value> {
    let text = peregrine_crds::crd_yaml().unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
        .collect()
}

#[test]
fn every_rule_of_the_generated_crds_compiles_is_bounded_and_within_the_cost_limits() {
    let crds = generated_crds();
    assert_eq!(crds.len(), 2);
    let mut rules_seen = 0;
    for crd in &crds {
        for version in crd["spec"]["versions"].as_array().unwrap() {
            let schema = &version["schema"]["openAPIV3Schema"];
            let name = crd["spec"]["names"]["kind"].as_str().unwrap();
            let mut found = Vec::new();
            collect_rules(schema, name, Some(1), None, &mut found, &mut Vec::new());
            rules_seen += found.len();
            let report = check_schema(schema, name);
            assert!(report.problems.is_empty(), "{name}:\n{}", report.problems.join("\n"));
        }
    }
    assert!(rules_seen > 20, "the walk must reach the rules ({rules_seen} found)");
}

// The check itself: each kind of problem is caught (so the test above can fail).

#[test]
fn a_rule_under_an_unbounded_list_is_refused() {
    let schema = json!({"type": "object", "properties": {"messages": {"type": "array", "items": {
        "type": "object",
        "properties": {"role": {"type": "string", "maxLength": 16}},
        "x-kubernetes-validations": [{"rule": "self.role in ['user', 'system']"}]
    }}}});
    let report = check_schema(&schema, "T");
    assert!(report.problems.iter().any(|p| p.contains("unbounded list/map T.messages")), "{:?}", report.problems);
}

#[test]
fn a_rule_reading_an_unbounded_string_is_refused_but_size_and_has_are_free() {
    let schema = json!({"type": "object", "properties": {"uri": {"type": "string",
        "x-kubernetes-validations": [{"rule": "self.matches('^s3://.+$')"}]}}});
    let report = check_schema(&schema, "T");
    assert!(report.problems.iter().any(|p| p.contains("T.uri is a string without maxLength")), "{:?}", report.problems);
    let schema = json!({"type": "object", "properties": {"uri": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "x-kubernetes-validations": [{"rule": "has(self.uri) && size(self.uri) < 10 && size(self.tags) < 3"}]});
    assert!(check_schema(&schema, "T").problems.is_empty());
}

#[test]
fn iterating_an_unbounded_list_is_refused() {
    let schema = json!({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
        "x-kubernetes-validations": [{"rule": "self.tags.all(t, t != 'x')"}]});
    let report = check_schema(&schema, "T");
    assert!(report.problems.iter().any(|p| p.contains("T.tags: iterated by a rule but has no maxItems")), "{:?}", report.problems);
}

#[test]
fn cost_over_the_limit_is_refused_even_when_bounded() {
    // 1000 items x 1000 items x a 10 KB string compare: far over 10M.
    let schema = json!({"type": "object", "properties": {"names": {"type": "array", "maxItems": 1000, "items": {"type": "string", "maxLength": 10000}}},
        "x-kubernetes-validations": [{"rule": "self.names.all(a, self.names.exists_one(b, a == b))"}]});
    let report = check_schema(&schema, "T");
    assert!(report.problems.iter().any(|p| p.contains("is over 10000000")), "{:?}", report.problems);
}

#[test]
fn a_rule_that_does_not_parse_is_refused() {
    let schema = json!({"type": "object", "x-kubernetes-validations": [{"rule": "self.x >="}]});
    let report = check_schema(&schema, "T");
    assert!(report.problems.iter().any(|p| p.contains("does not compile")), "{:?}", report.problems);
}
