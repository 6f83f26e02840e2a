//! The metrics endpoint from a test: one HTTP exchange and a strict
//! OpenMetrics parser.

use std::io::{Read, Write};
use std::time::Duration;

/// One HTTP/1.1 exchange with the metrics endpoint: (status line, headers, body).
pub fn http_get(addr: std::net::SocketAddr, method: &str, path: &str) -> (String, String, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("response");
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (
        status.to_string(),
        headers.to_ascii_lowercase(),
        body.to_string(),
    )
}

/// Parses OpenMetrics text strictly: every line is `# HELP`, `# TYPE`,
/// `# UNIT`, the final `# EOF`, or a sample `name{labels} value` of the
/// family most recently typed (a counter's samples end in `_total`); names
/// and label syntax as the format says; no family typed twice; no sample
/// twice. Returns `name{labels}` -> value, labels as written.
pub fn parse_openmetrics(text: &str) -> std::collections::BTreeMap<String, f64> {
    use std::collections::{BTreeMap, BTreeSet};
    let name_ok = |n: &str| {
        let mut c = n.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
    };
    let labels_ok = |l: &str| -> bool {
        // k="v",k="v" with \\, \" and \n escapes inside values.
        let mut rest = l;
        loop {
            let Some((k, after)) = rest.split_once("=\"") else {
                return false;
            };
            if !name_ok(k) {
                return false;
            }
            let mut chars = after.char_indices();
            let mut end = None;
            while let Some((i, ch)) = chars.next() {
                match ch {
                    '\\' if !matches!(chars.next(), Some((_, '\\' | '"' | 'n'))) => {
                        return false;
                    }
                    '"' => {
                        end = Some(i);
                        break;
                    }
                    '\n' => return false,
                    _ => {}
                }
            }
            let Some(end) = end else { return false };
            rest = &after[end + 1..];
            if rest.is_empty() {
                return true;
            }
            let Some(r) = rest.strip_prefix(',') else {
                return false;
            };
            rest = r;
        }
    };
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    assert_eq!(lines.last(), Some(&"# EOF"), "ends with # EOF:\n{text}");
    let mut families = BTreeSet::new();
    let mut current: Option<(String, String)> = None;
    let mut samples = BTreeMap::new();
    for line in &lines[..lines.len() - 1] {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut f = rest.splitn(3, ' ');
            let (kw, name, arg) = (f.next(), f.next(), f.next());
            let name = name.unwrap_or_else(|| panic!("bad line {line:?}"));
            assert!(name_ok(name), "bad name in {line:?}");
            let arg = arg.unwrap_or_else(|| panic!("bad line {line:?}"));
            match kw {
                Some("HELP") => {}
                Some("UNIT") => assert!(name.ends_with(&format!("_{arg}")), "{line:?}"),
                Some("TYPE") => {
                    assert!(
                        [
                            "counter",
                            "gauge",
                            "histogram",
                            "summary",
                            "info",
                            "stateset",
                            "unknown",
                            "gaugehistogram"
                        ]
                        .contains(&arg),
                        "{line:?}"
                    );
                    assert!(families.insert(name.to_string()), "{name} typed twice");
                    current = Some((name.to_string(), arg.to_string()));
                }
                _ => panic!("bad line {line:?}"),
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let name = match series.split_once('{') {
            Some((n, l)) => {
                let l = l
                    .strip_suffix('}')
                    .unwrap_or_else(|| panic!("bad labels in {line:?}"));
                assert!(labels_ok(l), "bad labels in {line:?}");
                n
            }
            None => series,
        };
        assert!(name_ok(name), "bad name in {line:?}");
        let (family, kind) = current
            .as_ref()
            .unwrap_or_else(|| panic!("sample before any TYPE: {line:?}"));
        let suffixes: &[&str] = match kind.as_str() {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        assert!(
            suffixes
                .iter()
                .any(|s| name.strip_suffix(s) == Some(family.as_str())),
            "sample of another family: {line:?}"
        );
        assert!(
            samples.insert(series.to_string(), value).is_none(),
            "{series} twice"
        );
    }
    samples
}
