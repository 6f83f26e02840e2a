//! What the structure check reports: per crate, its files' and functions'
//! lengths, its import circles between files and between folders.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// Why a crate could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum StructureError {
    /// A source file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A source file is not valid Rust.
    #[error("cannot parse {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
}

/// One function's length.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct FnLength {
    /// Lines from `fn` to its closing brace.
    pub lines: usize,
    /// The file, relative to the workspace root.
    pub file: PathBuf,
    /// The function's name (`Type::name` for methods).
    pub name: String,
    /// Its first line.
    pub line: usize,
}

/// Sibling modules that import one another, each taken whole (its folder
/// and its own file): see the `folders` module of
/// [`structure`](super).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FolderCircle {
    /// The crate root the modules hang from (`src/lib.rs`, a binary's file).
    pub root: PathBuf,
    /// Their parent module's path below that root (`daemon`; empty for the
    /// root itself).
    pub parent: String,
    /// The sibling modules in the circle, by name.
    pub modules: Vec<String>,
    /// The file imports that cross between them: importer → imported.
    pub imports: Vec<(PathBuf, PathBuf)>,
}

impl fmt::Display for FolderCircle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let prefix = if self.parent.is_empty() {
            String::from("crate::")
        } else {
            format!("crate::{}::", self.parent)
        };
        write!(
            f,
            "{prefix}{{{}}} (from {})",
            self.modules.join(" ↔ "),
            self.root.display()
        )
    }
}

/// What [`measure_crate`](super::measure_crate) found in one crate.
#[derive(Debug, Default)]
pub struct CrateStructure {
    /// Each source file of the crate (relative to the workspace root) and
    /// its length in lines.
    pub files: BTreeMap<PathBuf, usize>,
    /// Files that hold test code only (`#[cfg(test)] mod tests;`).
    pub test_files: BTreeSet<PathBuf>,
    /// Every non-test function's length.
    pub functions: Vec<FnLength>,
    /// Import edges between files: importer → imported files.
    pub imports: BTreeMap<PathBuf, BTreeSet<PathBuf>>,
    /// The import circles: each a set of files that import one another.
    pub circles: Vec<Vec<PathBuf>>,
    /// The folder circles: sibling modules, each taken whole, that import
    /// one another.
    pub folder_circles: Vec<FolderCircle>,
}

impl CrateStructure {
    /// The longest non-test source file and its lines.
    pub fn largest_file(&self) -> Option<(&Path, usize)> {
        self.files
            .iter()
            .filter(|(f, _)| !self.test_files.contains(*f))
            .max_by_key(|(_, n)| **n)
            .map(|(f, n)| (f.as_path(), *n))
    }

    /// The longest non-test function.
    pub fn largest_function(&self) -> Option<&FnLength> {
        self.functions.iter().max()
    }
}

impl fmt::Display for CrateStructure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((file, n)) = self.largest_file() {
            writeln!(f, "  largest file: {} ({n} lines)", file.display())?;
        }
        if let Some(func) = self.largest_function() {
            writeln!(
                f,
                "  largest function: {} in {}:{} ({} lines)",
                func.name,
                func.file.display(),
                func.line,
                func.lines
            )?;
        }
        writeln!(f, "  import circles: {}", self.circles.len())?;
        for circle in &self.circles {
            let names: Vec<String> = circle.iter().map(|p| p.display().to_string()).collect();
            writeln!(f, "    {}", names.join(" ↔ "))?;
        }
        writeln!(f, "  folder circles: {}", self.folder_circles.len())?;
        for circle in &self.folder_circles {
            writeln!(f, "    {circle}")?;
            for (from, to) in &circle.imports {
                writeln!(f, "      {} → {}", from.display(), to.display())?;
            }
        }
        Ok(())
    }
}
