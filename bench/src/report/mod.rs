//! `hugemem bench report`: the tables and quoted figures of
//! `docs/benchmarks.md`, generated from the `--json` of the runs kept under
//! `docs/results/`, so that text and figures cannot drift apart.
//!
//! Two kinds of marker comments in the document are rewritten; everything
//! else is left as it is:
//!
//! * `<!-- results:NAME -->` … `<!-- /results -->`: everything between is
//!   replaced by the tables of `docs/results/NAME.json`, headed by the run's
//!   command, date, build and machine (from its `"run"`). The file's
//!   `"bench"` picks the tables (see [`tables`]); a file of another kind
//!   gets a plain table of its top-level figures. `NAME` may list several
//!   files, comma-separated: runs of a kind with one row per run (`churn`)
//!   share one table, others follow each other.
//! * `<!-- v:NAME:PATH:FORMAT -->` … `<!-- /v -->`: one value quoted in prose.
//!   `PATH` walks the JSON: object keys, array indexes, and `field=value` to
//!   pick the element of an array whose `field` is `value` (e.g.
//!   `scenarios.name=eager-dirty.first_instruction_ms`), separated by dots.
//!   `FORMAT` is `.N` (N decimals) followed by an optional suffix (`.2x`
//!   quotes `2.11x`), or `s` for a string as it is.
//!
//! [`render`] returns the document as it must be; `hugemem bench report`
//! writes it, and `hugemem bench report --check` (and the workspace test
//! `bench/tests/bench_report.rs`) fails when the document differs.
//!
//! `document.rs` finds and rewrites the markers, `values.rs` reads and
//! formats one value, [`tables`] builds the tables.

mod document;
pub mod tables;
#[cfg(test)]
mod tests;
mod values;

pub use document::{names_in, render, update, ReportError};
pub(crate) use values::fixed;
pub use values::{format_value, lookup};
