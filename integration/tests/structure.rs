//! The workspace's structure (issue 25): no import circle between the files
//! of any crate, and in the daemon's and the command's crates no source
//! file over 700 lines and no function over 120 (`integration::structure`
//! says what each measure counts). The figures of every crate are printed,
//! so a run shows where each stands.

use std::path::{Path, PathBuf};

use integration::structure::{measure_crate, workspace_members, CrateStructure};

/// Crates held to the length limits: the daemon, the shipped command and
/// the benchmarks moved out of it.
const LENGTH_LIMITED: &[&str] = &["backend", "cli", "bench"];
const MAX_FILE_LINES: usize = 700;
const MAX_FN_LINES: usize = 120;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the integration crate sits in the workspace root")
        .to_path_buf()
}

fn measure_all() -> Vec<(String, CrateStructure)> {
    let root = workspace_root();
    let members = workspace_members(&root);
    assert!(
        members.len() >= 8,
        "the workspace's members were not read from {}: {members:?}",
        root.join("Cargo.toml").display()
    );
    members
        .iter()
        .map(|dir| {
            let name = dir.strip_prefix(&root).unwrap_or(dir).display().to_string();
            let s = measure_crate(&root, dir).unwrap_or_else(|e| panic!("{name}: {e}"));
            println!("{name}\n{s}");
            (name, s)
        })
        .collect()
}

#[test]
fn no_crate_has_an_import_circle() {
    let circles: Vec<String> = measure_all()
        .into_iter()
        .flat_map(|(name, s)| {
            s.circles.into_iter().map(move |c| {
                let files: Vec<String> = c.iter().map(|p| p.display().to_string()).collect();
                format!("{name}: {}", files.join(" ↔ "))
            })
        })
        .collect();
    assert!(
        circles.is_empty(),
        "{} import circle(s):\n{}",
        circles.len(),
        circles.join("\n")
    );
}

#[test]
fn daemon_and_command_files_and_functions_stay_short() {
    let mut over = Vec::new();
    for (name, s) in measure_all() {
        if !LENGTH_LIMITED.contains(&name.as_str()) {
            continue;
        }
        for (file, lines) in &s.files {
            if *lines > MAX_FILE_LINES && !s.test_files.contains(file) {
                over.push(format!("{}: {lines} lines", file.display()));
            }
        }
        for f in s.functions.iter().filter(|f| f.lines > MAX_FN_LINES) {
            over.push(format!(
                "{} ({}:{}): {} lines",
                f.name,
                f.file.display(),
                f.line,
                f.lines
            ));
        }
    }
    assert!(
        over.is_empty(),
        "over {MAX_FILE_LINES} lines a file or {MAX_FN_LINES} a function:\n{}",
        over.join("\n")
    );
}
