//! The workspace's structure, measured from its source: import circles
//! between files and between folders, file lengths and function lengths.
//!
//! **Import circles.** Each crate's module tree is read from its roots
//! (`src/lib.rs`, `src/main.rs`, `src/bin/*.rs`) through its `mod`
//! declarations. File A imports file B when code in A names, through a `use`
//! or a path, an item *defined* in B, and every file whose `use` (a
//! re-export, a glob) the path passes through on its way there: a
//! `pub use x::Foo` in a `mod.rs` used by a sibling as `super::Foo` is an
//! import of `x.rs` *and* of the `mod.rs`, so a circle that runs through a
//! re-export is counted.
//! `mod child;` is a declaration, not an import. Naming a module itself
//! (`use super::pool;`) imports nothing; naming an item in it does. A circle
//! is a strongly connected component of more than one file. Test code
//! (`#[cfg(test)]` items and modules, and files declared by a
//! `#[cfg(test)] mod`) is left out.
//!
//! **Folder circles.** The same imports, seen one level of the module tree
//! at a time: sibling modules, each taken whole (a module's folder together
//! with its own `mod.rs` or `name.rs`; a plain file beside a folder is a
//! module of one file), import one another when a file in one imports a
//! file in the other. A folder circle is a circle between siblings of which
//! at least one is a folder; one between single files only is already a
//! file circle.
//!
//! Paths inside macro invocations are read where the macro's tokens parse
//! as comma-separated expressions (`format!`, `assert!`, `matches!` …);
//! method calls name no path and so import nothing: the measure can miss an
//! import, never invent one.
//!
//! **Lengths.** A file's length is all its lines, inline tests included. A
//! function's length runs from its `fn` line to its closing brace (doc
//! comments and attributes left out); test functions are left out.
//!
//! Between crates, Cargo itself refuses a circle of normal dependencies.

mod circles;
mod folders;
mod measure;
mod report;
mod resolve;
mod tree;

pub use measure::{measure_crate, workspace_members};
pub use report::{CrateStructure, FnLength, FolderCircle, StructureError};

#[cfg(test)]
mod tests;
