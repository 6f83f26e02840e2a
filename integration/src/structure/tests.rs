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
fn a_re_export_used_by_a_sibling_leads_to_the_defining_file() {
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
        !b_imports.contains(Path::new("c/src/lib.rs")),
        "{b_imports:?}"
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
