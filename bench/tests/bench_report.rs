//! docs/benchmarks.md against the runs kept under docs/results/: every
//! generated table and quoted figure must be exactly what
//! `hugemem bench report` produces from the JSON files, so that the text
//! and the measurements cannot drift apart. After a new run, put its
//! `--json` under docs/results/ and run `hugemem bench report`.
//!
//! Also checks that every results file the document uses says what produced
//! it: the bench, the exact command, the date and the machine.

use std::path::Path;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

#[test]
fn benchmarks_md_is_what_the_results_give() {
    let doc_path = Path::new(ROOT).join("docs/benchmarks.md");
    let results = Path::new(ROOT).join("docs/results");
    let doc = std::fs::read_to_string(&doc_path).expect("read docs/benchmarks.md");
    let want = hugemem_bench::report::render(&doc, &results)
        .unwrap_or_else(|e| panic!("docs/benchmarks.md: {e}"));
    if want != doc {
        let first = doc
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| doc.lines().count().min(want.lines().count()));
        panic!(
            "docs/benchmarks.md differs from what docs/results/*.json give, first at line {}:\n  doc:       {:?}\n  generated: {:?}\nrun `hugemem bench report` (from the repository root) to regenerate it",
            first + 1,
            doc.lines().nth(first).unwrap_or(""),
            want.lines().nth(first).unwrap_or("")
        );
    }
}

#[test]
fn every_results_file_the_document_uses_describes_its_run() {
    let doc = std::fs::read_to_string(Path::new(ROOT).join("docs/benchmarks.md"))
        .expect("read docs/benchmarks.md");
    let names = hugemem_bench::report::names_in(&doc);
    assert!(
        !names.is_empty(),
        "docs/benchmarks.md quotes no results file"
    );
    for name in names {
        let path = Path::new(ROOT).join(format!("docs/results/{name}.json"));
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(v["bench"].is_string(), "{name}: no \"bench\"");
        let run = &v["run"];
        let command = run["command"].as_str().unwrap_or_default();
        assert!(
            command.starts_with("hugemem "),
            "{name}: run.command {command:?}"
        );
        assert!(
            run["date"].as_str().is_some_and(|d| d.len() == 20),
            "{name}: run.date"
        );
        assert!(run["build"].is_string(), "{name}: run.build");
        let m = &run["machine"];
        for key in ["cpu_model", "kernel"] {
            assert!(m[key].is_string(), "{name}: run.machine.{key}");
        }
        for key in ["cores", "numa_nodes", "memory_bytes"] {
            assert!(
                m[key].as_u64().is_some_and(|x| x > 0),
                "{name}: run.machine.{key}"
            );
        }
    }
}
