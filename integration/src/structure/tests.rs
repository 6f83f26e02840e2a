//! The measure on small crates written for the purpose.

use std::path::Path;

use super::measure_crate;

fn write(root: &Path, files: &[(&str, &str)]) {
    for (path, text) in files {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

#[test]
fn a_child_using_what_its_parent_defines_is_a_circle() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            ("c/src/lib.rs", "pub mod room;\n"),
            (
                "c/src/room/mod.rs",
                "mod child;\npub struct Shared;\npub fn f() -> child::Part { child::Part }\n",
            ),
            (
                "c/src/room/child.rs",
                "use super::Shared;\npub struct Part;\npub fn g(_: &Shared) {}\n",
            ),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    assert_eq!(s.circles.len(), 1, "{s}");
    assert_eq!(s.circles[0].len(), 2, "{s}");
}

#[test]
fn a_re_export_used_by_a_sibling_leads_to_the_defining_file_and_the_re_export() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            ("c/src/lib.rs", "mod a;\nmod b;\npub use a::Thing;\n"),
            ("c/src/a.rs", "pub struct Thing;\n"),
            ("c/src/b.rs", "use crate::Thing;\npub fn h(_: Thing) {}\n"),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    assert!(s.circles.is_empty(), "{s}");
    let b_imports = &s.imports[Path::new("c/src/b.rs")];
    assert!(b_imports.contains(Path::new("c/src/a.rs")), "{b_imports:?}");
    assert!(
        b_imports.contains(Path::new("c/src/lib.rs")),
        "{b_imports:?}"
    );
}

#[test]
fn a_circle_through_a_re_export_is_a_circle() {
    // b uses a's item through lib.rs's re-export, and a uses b: the edges
    // a → b → lib.rs → a make a circle although b never names a.rs.
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            ("c/src/lib.rs", "mod a;\nmod b;\npub use a::Thing;\n"),
            (
                "c/src/a.rs",
                "pub struct Thing;\npub fn f() { crate::b::h(crate::Thing) }\n",
            ),
            ("c/src/b.rs", "use crate::Thing;\npub fn h(_: Thing) {}\n"),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    assert_eq!(s.circles.len(), 1, "{s}");
    let circle: Vec<&str> = s.circles[0].iter().map(|p| p.to_str().unwrap()).collect();
    assert!(circle.contains(&"c/src/lib.rs"), "{circle:?}");
    assert!(
        circle.contains(&"c/src/a.rs") && circle.contains(&"c/src/b.rs"),
        "{circle:?}"
    );
}

#[test]
fn test_code_imports_nothing_and_function_lengths_count_fn_to_brace() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            (
                "c/src/lib.rs",
                "mod a;\npub struct Top;\n/// Doc.\n#[inline]\npub fn three() {\n    a::f();\n}\n",
            ),
            (
                "c/src/a.rs",
                "pub fn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::Top;\n    fn t(_: Top) {}\n}\n",
            ),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    assert!(s.circles.is_empty(), "{s}");
    let three = s.functions.iter().find(|f| f.name == "three").unwrap();
    assert_eq!((three.line, three.lines), (5, 3));
    assert!(s.functions.iter().all(|f| f.name != "t"));
}

#[test]
fn only_a_cfg_that_names_test_is_test_code() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            ("c/src/lib.rs", "mod a;\npub struct Top;\n"),
            (
                "c/src/a.rs",
                "#[cfg(not(test))]\npub fn live(_: crate::Top) {}\n\
                 #[cfg(feature = \"test-utils\")]\npub fn featured() {}\n\
                 #[cfg(all(test, target_os = \"linux\"))]\npub fn tested() {}\n",
            ),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    let names: Vec<&str> = s.functions.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["live", "featured"]);
    let a_imports = &s.imports[Path::new("c/src/a.rs")];
    assert!(
        a_imports.contains(Path::new("c/src/lib.rs")),
        "{a_imports:?}"
    );
}

/// `a/x.rs` imports `b.rs`, which imports `a/y.rs`: no file imports back a
/// file that imports it, but the folder `a/` and the file `b.rs` beside it
/// import one another.
#[test]
fn a_folder_and_a_sibling_importing_each_other_is_a_folder_circle() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            ("c/src/lib.rs", "mod a;\nmod b;\n"),
            ("c/src/a/mod.rs", "mod x;\npub mod y;\n"),
            ("c/src/a/x.rs", "pub fn f(_: crate::b::B) {}\n"),
            ("c/src/a/y.rs", "pub struct Y;\n"),
            ("c/src/b.rs", "use crate::a::y::Y;\npub struct B(pub Y);\n"),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    assert!(s.circles.is_empty(), "{s}");
    assert_eq!(s.folder_circles.len(), 1, "{s}");
    let circle = &s.folder_circles[0];
    assert_eq!(circle.parent, "", "{s}");
    assert_eq!(circle.modules, ["a", "b"], "{s}");
    assert_eq!(circle.root, Path::new("c/src/lib.rs"));
    assert_eq!(
        circle.imports,
        [
            ("c/src/a/x.rs".into(), "c/src/b.rs".into()),
            ("c/src/b.rs".into(), "c/src/a/y.rs".into()),
        ]
    );
}

/// The same tree one level down, with `name.rs` beside its folder instead
/// of a `mod.rs`: the circle is between the siblings under `top`.
#[test]
fn a_folder_circle_is_found_at_every_level_with_either_module_file_style() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            ("c/src/lib.rs", "mod top;\n"),
            ("c/src/top/mod.rs", "mod a;\nmod b;\n"),
            ("c/src/top/a.rs", "mod x;\npub mod y;\n"),
            ("c/src/top/a/x.rs", "pub fn f(_: super::super::b::B) {}\n"),
            ("c/src/top/a/y.rs", "pub struct Y;\n"),
            (
                "c/src/top/b.rs",
                "use super::a::y::Y;\npub struct B(pub Y);\n",
            ),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    assert!(s.circles.is_empty(), "{s}");
    assert_eq!(s.folder_circles.len(), 1, "{s}");
    assert_eq!(s.folder_circles[0].parent, "top", "{s}");
    assert_eq!(s.folder_circles[0].modules, ["a", "b"], "{s}");
}

/// Imports one way between folders, and between a folder's files and its
/// own `mod.rs` both ways, make no folder circle; nor does a test file
/// importing what imports its module.
#[test]
fn imports_one_way_or_inside_a_folder_are_no_folder_circle() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        &[
            ("c/src/lib.rs", "mod a;\nmod b;\nmod c;\n"),
            (
                "c/src/a/mod.rs",
                "mod x;\npub struct Shared;\npub fn g() -> x::X { x::X }\n",
            ),
            (
                "c/src/a/x.rs",
                "pub struct X(pub crate::b::B, pub super::Shared);\n",
            ),
            (
                "c/src/b/mod.rs",
                "pub struct B;\npub fn h(_: crate::c::C) {}\n#[cfg(test)]\nmod tests;\n",
            ),
            ("c/src/b/tests.rs", "pub fn t(_: crate::a::Shared) {}\n"),
            ("c/src/c.rs", "pub struct C;\n"),
        ],
    );
    let s = measure_crate(dir.path(), &dir.path().join("c")).unwrap();
    assert_eq!(s.circles.len(), 1, "a/mod.rs ↔ a/x.rs: {s}");
    assert!(s.folder_circles.is_empty(), "{s}");
}
