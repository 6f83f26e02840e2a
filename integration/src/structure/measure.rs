//! Measuring one crate: read its module tree, collect its imports, find
//! the circles.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::circles::circles;
use super::report::{CrateStructure, StructureError};
use super::tree::TreeReader;

/// Measures the crate whose package directory is `crate_dir`, naming files
/// relative to `workspace_root`.
pub fn measure_crate(
    workspace_root: &Path,
    crate_dir: &Path,
) -> Result<CrateStructure, StructureError> {
    let mut reader = TreeReader {
        workspace_root: workspace_root.to_path_buf(),
        files: Vec::new(),
        test_files: BTreeSet::new(),
        modules: Vec::new(),
        functions: Vec::new(),
        parsed: Vec::new(),
        looked_up: Default::default(),
    };
    let mut roots = Vec::new();
    for root in ["src/lib.rs", "src/main.rs"] {
        let path = crate_dir.join(root);
        if path.is_file() {
            roots.push(path);
        }
    }
    if let Ok(entries) = std::fs::read_dir(crate_dir.join("src/bin")) {
        let mut bins: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "rs"))
            .collect();
        bins.sort();
        roots.extend(bins);
    }
    // Each root is a crate of its own (a binary names the library by its
    // crate name, an external path): their graphs are measured together
    // but never joined.
    for root in roots {
        reader.read_root(&root)?;
    }
    let mut structure = CrateStructure {
        test_files: reader.test_files.clone(),
        functions: std::mem::take(&mut reader.functions),
        ..CrateStructure::default()
    };
    for (path, lines) in &reader.files {
        structure.files.insert(path.clone(), *lines);
    }
    let edges = reader.edges();
    for (from, tos) in &edges {
        let from_path = reader.files[*from].0.clone();
        let set = structure.imports.entry(from_path).or_default();
        for to in tos {
            set.insert(reader.files[*to].0.clone());
        }
    }
    structure.circles = circles(reader.files.len(), &edges)
        .into_iter()
        .map(|c| c.into_iter().map(|i| reader.files[i].0.clone()).collect())
        .collect();
    structure.folder_circles = reader.folder_circles(&edges);
    Ok(structure)
}

/// The workspace's member crates (directories with a `Cargo.toml` listed
/// in the root manifest's `[workspace] members`), read with `toml`
/// rather than `cargo metadata`, so the check needs no network or lock.
pub fn workspace_members(workspace_root: &Path) -> Vec<PathBuf> {
    let manifest = std::fs::read_to_string(workspace_root.join("Cargo.toml")).unwrap_or_default();
    let Ok(manifest) = manifest.parse::<toml::Table>() else {
        return Vec::new();
    };
    manifest
        .get("workspace")
        .and_then(|w| w.get("members"))
        .and_then(|m| m.as_array())
        .into_iter()
        .flatten()
        .filter_map(|member| member.as_str())
        .map(|member| workspace_root.join(member))
        .collect()
}
