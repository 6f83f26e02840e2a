//! The Grafana dashboard (`scripts/grafana-dashboard.json`, in the package
//! as `/usr/share/hugemem/grafana/hugemem.json`) against a live daemon's
//! `/metrics`: every series a panel or a variable queries exists, and every
//! label a query selects on or groups by is one that series carries. A
//! daemon that has served and freed an allocation shows every family
//! (pools appear once a region exists). Runs under the machine lock.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use test_support::metrics::{http_get, parse_openmetrics};
use test_support::prelude::{serial, TestDaemon};
use test_support::tenant::{alloc_2m, MIB};

/// Every PromQL query of the dashboard: panel targets (rows' nested panels
/// too) and query variables, with where each comes from.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    fn panels(list: &Value, out: &mut Vec<(String, String)>) {
        for p in list.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?").to_string();
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{title}: a target without expr"));
                out.push((format!("panel {title:?}"), expr.to_string()));
            }
            panels(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    panels(&dashboard["panels"], &mut out);
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if v["type"] == "query" {
            let q = v["query"]["query"]
                .as_str()
                .or(v["query"].as_str())
                .expect("a variable's query");
            out.push((format!("variable {}", v["name"]), q.to_string()));
        }
    }
    out
}

/// The metric names (`hugemem_…`) a query names, each with the labels its
/// selector `{…}` names.
fn metrics_in(expr: &str) -> Vec<(String, Vec<String>)> {
    let bytes = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = expr[i..].find("hugemem_") {
        let start = i + at;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len()
            && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_' || bytes[end] == b':')
        {
            end += 1;
        }
        i = end;
        if !boundary {
            continue;
        }
        let mut labels = Vec::new();
        if bytes.get(end) == Some(&b'{') {
            let close = expr[end..]
                .find('}')
                .map(|c| end + c)
                .expect("a closed selector");
            for matcher in expr[end + 1..close]
                .split(',')
                .filter(|m| !m.trim().is_empty())
            {
                let name = matcher
                    .split(['=', '!', '~'])
                    .next()
                    .expect("a label")
                    .trim();
                labels.push(name.to_string());
            }
            i = close;
        }
        out.push((expr[start..end].to_string(), labels));
    }
    out
}

/// The labels of `by (…)` / `without (…)` clauses.
fn grouping_labels(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["by (", "by(", "without (", "without("] {
        let mut rest = expr;
        while let Some(at) = rest.find(kw) {
            let after = &rest[at + kw.len()..];
            let close = after.find(')').expect("a closed grouping");
            out.extend(
                after[..close]
                    .split(',')
                    .map(|l| l.trim().to_string())
                    .filter(|l| !l.is_empty()),
            );
            rest = &after[close..];
        }
    }
    out
}

#[test]
fn every_dashboard_query_names_a_series_the_daemon_serves() {
    let _s = serial();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shipped = test_support::installed::shipped(env!("CARGO_BIN_EXE_hugemem"), &repo);
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(&shipped.dashboard)
            .unwrap_or_else(|e| panic!("{}: {e}", shipped.dashboard.display())),
    )
    .expect("the dashboard is JSON");
    let daemon = TestDaemon::start(|c| {
        c.metrics.listen = Some("127.0.0.1:0".parse().expect("addr"));
        c.pool.target = backend::daemon::config::ByteSize(64 * MIB);
    });
    // One region served and freed: the pool's families get their rows.
    if test_support::hugepages::reserve_2m(
        2,
        "every_dashboard_query_names_a_series_the_daemon_serves",
    ) {
        let mut c = daemon.client();
        let a = c.alloc(alloc_2m(4 * MIB, false)).expect("ALLOC");
        let id = a.id;
        drop(a);
        c.free(id).expect("FREE");
    } else {
        return;
    }
    let addr = daemon.handle().metrics_addr().expect("metrics on");
    let (status, _, body) = http_get(addr, "GET", "/metrics");
    assert!(status.contains("200"), "{status}");
    let samples = parse_openmetrics(&body);
    // Series name -> every label name it carries.
    let mut served: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for key in samples.keys() {
        let (name, labels) = key.split_once('{').unwrap_or((key.as_str(), ""));
        let entry = served.entry(name.to_string()).or_default();
        for pair in labels
            .trim_end_matches('}')
            .split(',')
            .filter(|p| !p.is_empty())
        {
            entry.insert(pair.split('=').next().expect("label").to_string());
        }
    }
    let queries = queries(&dashboard);
    assert!(queries.len() >= 20, "{} queries only", queries.len());
    let mut missing = Vec::new();
    let mut names = BTreeSet::new();
    for (from, expr) in &queries {
        let metrics = metrics_in(expr);
        if metrics.is_empty() {
            missing.push(format!("{from}: {expr:?} names no hugemem series"));
        }
        let mut labels_here = BTreeSet::new();
        for (metric, selector) in &metrics {
            names.insert(metric.clone());
            let Some(labels) = served.get(metric) else {
                missing.push(format!("{from}: {metric} is not served (in {expr:?})"));
                continue;
            };
            labels_here.extend(labels.iter().cloned());
            for l in selector {
                if !labels.contains(l) {
                    missing.push(format!("{from}: {metric} has no label {l} (in {expr:?})"));
                }
            }
        }
        for l in grouping_labels(expr) {
            if !labels_here.contains(&l) {
                missing.push(format!(
                    "{from}: groups by {l}, which none of its series carries (in {expr:?})"
                ));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "dashboard queries without a series:\n  {}\nserved: {:?}",
        missing.join("\n  "),
        served.keys().collect::<Vec<_>>()
    );
    println!(
        "OBSERVED: {} dashboard queries over {} distinct series, 0 without a series (dashboard {})",
        queries.len(),
        names.len(),
        shipped.dashboard.display()
    );
}

#[test]
fn the_query_parser_finds_names_selectors_and_groupings() {
    let m = metrics_in("sum by (node, state) (rate(hugemem_pool_bytes{node=~\"$node\", page_size!=\"4K\"}[5m])) / hugemem_x_total");
    assert_eq!(
        m,
        [
            (
                "hugemem_pool_bytes".to_string(),
                vec!["node".to_string(), "page_size".to_string()]
            ),
            ("hugemem_x_total".to_string(), vec![])
        ]
    );
    assert_eq!(
        grouping_labels("sum by (node, state) (x) + max without(a) (y)"),
        ["node", "state", "a"]
    );
    assert!(metrics_in("rate(not_hugemem_x[5m])").is_empty());
}
