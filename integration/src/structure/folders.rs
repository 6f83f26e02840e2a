//! Folder circles: import circles between sibling modules, each module
//! taken whole with every file under it.
//!
//! A file's place is its module path (`daemon::pool::take`). An import from
//! file A to file B is, at the level where their paths part
//! (`daemon`), an import between two sibling modules (`pool` → `quarantine`);
//! a module's folder and its own file (`pool/mod.rs` or `pool.rs`) are one
//! unit, and so is a plain file beside a folder (`fdstore.rs`). An import
//! between a module and one of its own descendants stays inside one unit.
//! A folder circle is a strongly connected component of more than one
//! sibling at one level of which at least one is a folder (a module of more
//! than one non-test file): a component of single files only is a file
//! circle and is reported as one.

use std::collections::{BTreeMap, BTreeSet};

use super::circles::circles;
use super::report::FolderCircle;
use super::tree::TreeReader;

/// Where a file sits: its crate root's module and its module path below it.
type Place = (usize, Vec<String>);

/// Sibling modules under one parent module: name → index, and the import
/// edges between them with the file imports behind each.
#[derive(Default)]
struct Level {
    units: BTreeMap<String, usize>,
    folders: BTreeSet<usize>,
    edges: BTreeMap<usize, BTreeSet<usize>>,
    behind: BTreeMap<(usize, usize), BTreeSet<(usize, usize)>>,
}

impl Level {
    fn unit(&mut self, name: &str) -> usize {
        let next = self.units.len();
        *self.units.entry(name.to_string()).or_insert(next)
    }
}

impl TreeReader {
    /// The module path of file `file` and the root it hangs from.
    fn place(&self, file: usize) -> Place {
        let mut module = self.parsed[file].1;
        let mut path = Vec::new();
        while let Some(parent) = self.modules[module].parent {
            path.push(self.modules[module].name.clone());
            module = parent;
        }
        path.reverse();
        (module, path)
    }

    /// The folder circles of the import graph `edges` (file → files).
    pub(super) fn folder_circles(
        &self,
        edges: &BTreeMap<usize, BTreeSet<usize>>,
    ) -> Vec<FolderCircle> {
        let places: Vec<Place> = (0..self.files.len()).map(|f| self.place(f)).collect();
        let mut levels: BTreeMap<Place, Level> = BTreeMap::new();
        // Every module with a (non-test) file below its own is a folder at
        // its level.
        for (file, (root, path)) in places.iter().enumerate() {
            if self.test_files.contains(&self.files[file].0) {
                continue;
            }
            for depth in 0..path.len().saturating_sub(1) {
                let level = levels.entry((*root, path[..depth].to_vec())).or_default();
                let unit = level.unit(&path[depth]);
                level.folders.insert(unit);
            }
        }
        for (&from, tos) in edges {
            for &to in tos {
                let ((root, from_path), (to_root, to_path)) = (&places[from], &places[to]);
                if root != to_root {
                    continue;
                }
                let shared = from_path
                    .iter()
                    .zip(to_path)
                    .take_while(|(a, b)| a == b)
                    .count();
                let (Some(from_unit), Some(to_unit)) = (from_path.get(shared), to_path.get(shared))
                else {
                    continue;
                };
                let level = levels
                    .entry((*root, from_path[..shared].to_vec()))
                    .or_default();
                let (a, b) = (level.unit(from_unit), level.unit(to_unit));
                level.edges.entry(a).or_default().insert(b);
                level.behind.entry((a, b)).or_default().insert((from, to));
            }
        }
        let mut found = Vec::new();
        for ((root, path), level) in &levels {
            found.extend(self.level_circles(*root, path, level));
        }
        found
    }

    fn level_circles(&self, root: usize, path: &[String], level: &Level) -> Vec<FolderCircle> {
        let names: BTreeMap<usize, &String> = level.units.iter().map(|(n, i)| (*i, n)).collect();
        circles(level.units.len(), &level.edges)
            .into_iter()
            .filter(|component| component.iter().any(|u| level.folders.contains(u)))
            .map(|component| {
                let mut imports = Vec::new();
                for &a in &component {
                    for &b in &component {
                        for &(from, to) in level.behind.get(&(a, b)).into_iter().flatten() {
                            imports.push((self.files[from].0.clone(), self.files[to].0.clone()));
                        }
                    }
                }
                let mut modules: Vec<String> = component.iter().map(|u| names[u].clone()).collect();
                modules.sort();
                imports.sort();
                FolderCircle {
                    root: self.files[self.modules[root].file].0.clone(),
                    parent: path.join("::"),
                    modules,
                    imports,
                }
            })
            .collect()
    }
}
