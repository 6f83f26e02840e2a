//! What `hugemem check` found: one [`Item`] per question, each PASS, WARN,
//! FAIL or SKIP (a check that could not be made) with one line of why and
//! one of what to do, rendered as text or JSON.

use std::fmt::Write as _;

use serde::Serialize;

/// The verdict of one item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    /// Ready.
    Pass,
    /// Works, with a limit the operator should know about.
    Warn,
    /// Not ready: something the daemon or its tenants need is missing.
    Fail,
    /// Could not be checked (the line says why: not root, no libvirt, …).
    Skip,
}

impl Status {
    /// `PASS`, `WARN`, `FAIL` or `SKIP`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Warn => "WARN",
            Self::Fail => "FAIL",
            Self::Skip => "SKIP",
        }
    }
}

/// One answered question.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Item {
    /// Short, stable name (`hugepages-1G`, `socket-uid-64055`, …).
    pub name: String,
    /// The verdict.
    pub status: Status,
    /// Why: what was found.
    pub why: String,
    /// What to do; empty when nothing is to be done.
    pub fix: String,
}

impl Item {
    /// A PASS.
    pub fn pass(name: impl Into<String>, why: impl Into<String>) -> Self {
        Self::new(name, Status::Pass, why, "")
    }

    /// A WARN with what to do.
    pub fn warn(name: impl Into<String>, why: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::new(name, Status::Warn, why, fix)
    }

    /// A FAIL with what to do.
    pub fn fail(name: impl Into<String>, why: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::new(name, Status::Fail, why, fix)
    }

    /// A check that could not be made, and how to make it.
    pub fn skip(name: impl Into<String>, why: impl Into<String>, fix: impl Into<String>) -> Self {
        Self::new(name, Status::Skip, why, fix)
    }

    fn new(
        name: impl Into<String>,
        status: Status,
        why: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            status,
            why: why.into(),
            fix: fix.into(),
        }
    }
}

/// Every item, in the order checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The configuration file checked against (`None`: the defaults).
    pub config: Option<String>,
    /// The items.
    pub items: Vec<Item>,
}

/// Counts per status, for the summary line and the JSON.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// PASS items.
    pub pass: usize,
    /// WARN items.
    pub warn: usize,
    /// FAIL items.
    pub fail: usize,
    /// Items that could not be checked.
    pub skip: usize,
}

impl Report {
    /// Adds one item.
    pub fn push(&mut self, item: Item) {
        self.items.push(item);
    }

    /// Adds several.
    pub fn extend(&mut self, items: impl IntoIterator<Item = Item>) {
        self.items.extend(items);
    }

    /// Counts per status.
    pub fn summary(&self) -> Summary {
        let mut s = Summary::default();
        for i in &self.items {
            match i.status {
                Status::Pass => s.pass += 1,
                Status::Warn => s.warn += 1,
                Status::Fail => s.fail += 1,
                Status::Skip => s.skip += 1,
            }
        }
        s
    }

    /// 1 when any item FAILs, else 0.
    pub fn exit_code(&self) -> i32 {
        i32::from(self.summary().fail > 0)
    }

    /// The item named `name`.
    pub fn item(&self, name: &str) -> Option<&Item> {
        self.items.iter().find(|i| i.name == name)
    }

    /// One line per item (`STATUS name: why`), the fix indented below it,
    /// then a summary line.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let width = self.items.iter().map(|i| i.name.len()).max().unwrap_or(0);
        for i in &self.items {
            let _ = writeln!(out, "{} {:width$}  {}", i.status.as_str(), i.name, i.why);
            if !i.fix.is_empty() {
                let _ = writeln!(out, "     {:width$}  -> {}", "", i.fix);
            }
        }
        let s = self.summary();
        let _ = writeln!(
            out,
            "{} passed, {} warned, {} failed, {} not checked (config: {})",
            s.pass,
            s.warn,
            s.fail,
            s.skip,
            self.config.as_deref().unwrap_or("built-in defaults")
        );
        out
    }

    /// The report as one JSON object: `config`, `items`, `summary`, `ok`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "config": self.config,
            "items": self.items,
            "summary": self.summary(),
            "ok": self.exit_code() == 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fail_makes_the_exit_code_and_the_summary() {
        let mut r = Report::default();
        r.push(Item::pass("a", "fine"));
        assert_eq!(r.exit_code(), 0);
        r.push(Item::warn("b", "meh", "do x"));
        r.push(Item::skip("c", "not root", "run as root"));
        assert_eq!(r.exit_code(), 0, "WARN and SKIP are not failures");
        r.push(Item::fail("d", "broken", "fix it"));
        assert_eq!(r.exit_code(), 1);
        let text = r.to_text();
        assert!(text.contains("FAIL d  broken\n"), "{text}");
        assert!(text.contains("-> fix it"), "{text}");
        assert!(
            text.ends_with(
                "1 passed, 1 warned, 1 failed, 1 not checked (config: built-in defaults)\n"
            ),
            "{text}"
        );
        let json = r.to_json();
        assert_eq!(json["items"][3]["status"], "FAIL");
        assert_eq!(json["summary"]["fail"], 1);
        assert_eq!(json["ok"], false);
    }
}
