//! Prints each workspace crate's structure: its largest file and function,
//! its import circles between files and between folders
//! (`integration::structure`).
//!
//! `cargo run -p integration --example structure [-- CRATE_DIR…]`

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("the integration crate has no parent directory")?
        .to_path_buf();
    let asked: Vec<PathBuf> = std::env::args().skip(1).map(|a| root.join(a)).collect();
    let crates = if asked.is_empty() {
        integration::structure::workspace_members(&root)
    } else {
        asked
    };
    let (mut total, mut folder_total) = (0, 0);
    for dir in crates {
        let structure = integration::structure::measure_crate(&root, &dir)?;
        total += structure.circles.len();
        folder_total += structure.folder_circles.len();
        println!("{}", dir.strip_prefix(&root).unwrap_or(&dir).display());
        print!("{structure}");
    }
    println!("import circles in all: {total}");
    println!("folder circles in all: {folder_total}");
    Ok(())
}
