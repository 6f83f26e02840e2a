//! Resolving the paths a file names to the files that define their items:
//! the import edges.

use std::collections::{BTreeMap, BTreeSet};

use syn::visit::Visit;

use super::tree::{is_cfg_test, item_attrs, use_leaves, Target, TreeReader};

impl TreeReader {
    /// Every import edge, file → files.
    pub(super) fn edges(&self) -> BTreeMap<usize, BTreeSet<usize>> {
        let mut edges: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        for (file, (syntax, module)) in self.parsed.iter().enumerate() {
            // A test-only file (`#[cfg(test)] mod tests;`) is test code.
            if self.test_files.contains(&self.files[file].0) {
                continue;
            }
            let mut collector = PathCollector {
                reader: self,
                module_stack: vec![*module],
                found: Vec::new(),
            };
            collector.visit_file(syntax);
            for (from_module, path) in collector.found {
                let from_file = self.modules[from_module].file;
                for target in self.resolve(from_module, &path) {
                    if let Target::Item(to_file) = target {
                        if to_file != from_file {
                            edges.entry(from_file).or_default().insert(to_file);
                        }
                    }
                }
            }
        }
        edges
    }

    /// What `path`, named in `module`, stands for: every alternative, since
    /// a name can be imported once per `cfg` (`use self::x86_64 as arch`
    /// beside `use self::generic as arch`).
    fn resolve(&self, module: usize, path: &[String]) -> Vec<Target> {
        let Some((first, rest)) = path.split_first() else {
            return Vec::new();
        };
        let mut current = match first.as_str() {
            "crate" => vec![Target::Module(self.root_of(module))],
            "self" | "super" => vec![Target::Module(module)],
            _ => self.lookup(module, first),
        };
        let rest = if first == "super" { path } else { rest };
        for segment in rest {
            current = current
                .into_iter()
                .flat_map(|target| match target {
                    Target::Item(_) => vec![target],
                    Target::Module(m) => match segment.as_str() {
                        "super" => self.modules[m]
                            .parent
                            .map(Target::Module)
                            .into_iter()
                            .collect(),
                        "self" => vec![target],
                        _ => self.lookup(m, segment),
                    },
                })
                .collect();
        }
        current
    }

    fn root_of(&self, mut module: usize) -> usize {
        while let Some(parent) = self.modules[module].parent {
            module = parent;
        }
        module
    }

    fn lookup(&self, module: usize, name: &str) -> Vec<Target> {
        let key = (module, name.to_string());
        if let Some(known) = self.looked_up.borrow().get(&key) {
            return known.clone();
        }
        self.looked_up.borrow_mut().insert(key.clone(), Vec::new());
        let found = self.lookup_uncached(module, name);
        self.looked_up.borrow_mut().insert(key, found.clone());
        found
    }

    fn lookup_uncached(&self, module: usize, name: &str) -> Vec<Target> {
        let m = &self.modules[module];
        if let Some(child) = m.children.get(name) {
            return vec![Target::Module(*child)];
        }
        if let Some(file) = m.items.get(name) {
            return vec![Target::Item(*file)];
        }
        if let Some(paths) = m.imports.get(name) {
            let found: Vec<Target> = paths.iter().flat_map(|p| self.resolve(module, p)).collect();
            return through_re_export(found, m.file);
        }
        for glob in &m.globs {
            for source in self.resolve(module, glob) {
                if let Target::Module(g) = source {
                    if g != module {
                        let found = self.lookup(g, name);
                        if !found.is_empty() {
                            return through_re_export(found, m.file);
                        }
                    }
                }
            }
        }
        Vec::new()
    }
}

/// What a name that a module imports (`use`, a glob) stands for, seen from
/// another file: the file holding the import too, since a change there
/// (the re-export pointing elsewhere) changes what the user gets. Seen from
/// the importing file itself, that extra target is dropped as a self-edge.
fn through_re_export(mut found: Vec<Target>, re_exporting_file: usize) -> Vec<Target> {
    if !found.is_empty() {
        found.push(Target::Item(re_exporting_file));
    }
    found
}

/// Collects every path named in non-test code, with the module naming it.
struct PathCollector<'a> {
    reader: &'a TreeReader,
    module_stack: Vec<usize>,
    found: Vec<(usize, Vec<String>)>,
}

impl PathCollector<'_> {
    fn module(&self) -> usize {
        self.module_stack.last().copied().unwrap_or(0)
    }
}

impl<'ast> Visit<'ast> for PathCollector<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if is_cfg_test(item_attrs(item)) {
            return;
        }
        match item {
            syn::Item::Mod(m) => {
                let module = self.module();
                let Some(child) = self.reader.modules[module]
                    .children
                    .get(&m.ident.to_string())
                    .copied()
                else {
                    return;
                };
                // Only inline modules are walked here; a file module is
                // walked as its own file.
                if let Some((_, items)) = &m.content {
                    self.module_stack.push(child);
                    for item in items {
                        self.visit_item(item);
                    }
                    self.module_stack.pop();
                }
            }
            syn::Item::Use(u) => {
                let mut leaves = Vec::new();
                use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                let module = self.module();
                for (_, path) in leaves {
                    self.found.push((module, path));
                }
            }
            other => syn::visit::visit_item(self, other),
        }
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_cfg_test(&f.attrs) {
            syn::visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.first().is_some_and(|s| s != "Self") {
            self.found.push((self.module(), segments));
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        use syn::parse::Parser;
        let parser = syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated;
        if let Ok(exprs) = parser.parse2(mac.tokens.clone()) {
            for expr in &exprs {
                self.visit_expr(expr);
            }
        }
        syn::visit::visit_macro(self, mac);
    }
}
