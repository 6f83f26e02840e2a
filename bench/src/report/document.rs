//! The document side: finding the marker comments, reading the results
//! files they name, and rewriting what is between them.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::tables;
use super::values::{format_value, lookup};

/// Why a document cannot be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A results file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A results file is not JSON.
    #[error("{path} is not JSON")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A marker is malformed, unterminated or names nothing.
    #[error("line {line}: {why}")]
    Marker {
        /// 1-based line of the marker in the document.
        line: usize,
        /// What is wrong.
        why: String,
    },
}

const BLOCK_OPEN: &str = "<!-- results:";
const BLOCK_CLOSE: &str = "<!-- /results -->";
const VALUE_OPEN: &str = "<!-- v:";
const VALUE_CLOSE: &str = "<!-- /v -->";

/// The results files under one directory, loaded on first use.
struct Results<'a> {
    dir: &'a Path,
    loaded: std::collections::BTreeMap<String, Value>,
}

impl Results<'_> {
    fn get(&mut self, name: &str, line: usize) -> Result<&Value, ReportError> {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            || name.starts_with('.')
        {
            return Err(ReportError::Marker {
                line,
                why: format!("bad results name {name:?}"),
            });
        }
        if !self.loaded.contains_key(name) {
            let path = self.dir.join(format!("{name}.json"));
            let text = std::fs::read_to_string(&path).map_err(|source| ReportError::Read {
                path: path.clone(),
                source,
            })?;
            let v: Value =
                serde_json::from_str(&text).map_err(|source| ReportError::Json { path, source })?;
            self.loaded.insert(name.to_string(), v);
        }
        Ok(&self.loaded[name])
    }
}

/// `doc` with every marker's content generated from the JSON files in
/// `results_dir` (see the module docs).
///
/// # Errors
///
/// [`ReportError`]: a marker that is malformed, unterminated, or names a
/// file or value that does not exist.
pub fn render(doc: &str, results_dir: &Path) -> Result<String, ReportError> {
    let mut results = Results {
        dir: results_dir,
        loaded: std::collections::BTreeMap::new(),
    };
    let lines: Vec<&str> = doc.split_inclusive('\n').collect();
    let mut out = String::with_capacity(doc.len());
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_end();
        if let Some(rest) = trimmed.strip_prefix(BLOCK_OPEN) {
            let name =
                rest.strip_suffix("-->")
                    .map(str::trim)
                    .ok_or_else(|| ReportError::Marker {
                        line: i + 1,
                        why: "a results marker must be alone on its line".into(),
                    })?;
            let end = (i + 1..lines.len())
                .find(|&j| lines[j].trim_end() == BLOCK_CLOSE)
                .ok_or_else(|| ReportError::Marker {
                    line: i + 1,
                    why: format!("no {BLOCK_CLOSE} after results:{name}"),
                })?;
            if let Some(j) = (i + 1..end).find(|&j| lines[j].contains(BLOCK_OPEN)) {
                return Err(ReportError::Marker {
                    line: j + 1,
                    why: "results markers cannot nest".into(),
                });
            }
            let mut files = Vec::new();
            for n in name.split(',').map(str::trim) {
                files.push((n.to_string(), results.get(n, i + 1)?.clone()));
            }
            out.push_str(line);
            out.push_str(&tables::blocks(&files));
            out.push_str(lines[end]);
            i = end + 1;
            continue;
        }
        if trimmed == BLOCK_CLOSE {
            return Err(ReportError::Marker {
                line: i + 1,
                why: "a /results marker without its opening marker".into(),
            });
        }
        out.push_str(&render_values(line, i + 1, &mut results)?);
        i += 1;
    }
    Ok(out)
}

/// One line with its `<!-- v:… -->` markers' contents regenerated.
fn render_values(line: &str, lineno: usize, results: &mut Results) -> Result<String, ReportError> {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find(VALUE_OPEN) {
        out.push_str(&rest[..start]);
        let after = &rest[start + VALUE_OPEN.len()..];
        let bad = |why: String| ReportError::Marker { line: lineno, why };
        let spec_end = after
            .find("-->")
            .ok_or_else(|| bad("unterminated value marker".into()))?;
        let spec = after[..spec_end].trim();
        let body = &after[spec_end + 3..];
        let close = body
            .find(VALUE_CLOSE)
            .ok_or_else(|| bad(format!("no {VALUE_CLOSE} on the line of v:{spec}")))?;
        let mut parts = spec.splitn(3, ':');
        let (Some(name), Some(path), Some(format)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(bad(format!("v:{spec}: expected v:NAME:PATH:FORMAT")));
        };
        let doc = results.get(name, lineno)?;
        let value = lookup(doc, path).ok_or_else(|| bad(format!("{name}.json has no {path}")))?;
        let text = format_value(value, format).ok_or_else(|| {
            bad(format!(
                "{name}.json {path} = {value} cannot be shown as {format:?}"
            ))
        })?;
        out.push_str(VALUE_OPEN);
        out.push_str(&after[..spec_end + 3]);
        out.push_str(&text);
        out.push_str(VALUE_CLOSE);
        rest = &body[close + VALUE_CLOSE.len()..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The document at `doc` checked against (or, with `write`, rewritten from)
/// `results_dir`. Returns whether the file was already up to date.
///
/// # Errors
///
/// [`ReportError`], or the document cannot be read or written.
pub fn update(doc: &Path, results_dir: &Path, write: bool) -> Result<bool, ReportError> {
    let text = std::fs::read_to_string(doc).map_err(|source| ReportError::Read {
        path: doc.to_path_buf(),
        source,
    })?;
    let want = render(&text, results_dir)?;
    if want == text {
        return Ok(true);
    }
    if write {
        std::fs::write(doc, want).map_err(|source| ReportError::Read {
            path: doc.to_path_buf(),
            source,
        })?;
    }
    Ok(false)
}

/// The results files a document names (block and value markers), in order,
/// each once.
pub fn names_in(doc: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let mut push = |list: &str| {
        for n in list.split(',').map(str::trim) {
            if !names.iter().any(|x| x == n) {
                names.push(n.to_string());
            }
        }
    };
    for line in doc.lines() {
        if let Some(rest) = line.trim_end().strip_prefix(BLOCK_OPEN) {
            if let Some(name) = rest.strip_suffix("-->") {
                push(name.trim());
            }
        }
        let mut rest = line;
        while let Some(start) = rest.find(VALUE_OPEN) {
            rest = &rest[start + VALUE_OPEN.len()..];
            if let Some(name) = rest.split(':').next() {
                push(name.trim());
            }
        }
    }
    names
}
