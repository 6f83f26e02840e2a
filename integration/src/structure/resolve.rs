//! Resolving the paths a file names to the files that define their items:
//! the import edges.

use std::collections::{BTreeMap, BTreeSet};

use syn::visit::Visit;

use super::tree::{is_cfg_test, item_attrs, use_leaves, Target, TreeReader};

impl TreeReader {
    /// Every import edge, file → files.
    pub(super) fn edges(&self) -> BTreeMap<usize, BTreeSet<usize>> {
        let mut edges: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        for (syntax, module) in &self.parsed {
            let mut collector = PathCollector {
                reader: self,
                module_stack: vec![*module],
                found: Vec::new(),
            };
            collector.visit_file(syntax);
            for (from_module, path) in collector.found {
                let from_file = self.modules[from_module].file;
                if let Some(Target::Item(to_file)) = self.resolve(from_module, &path, 0) {
                    if to_file != from_file {
                        edges.entry(from_file).or_default().insert(to_file);
                    }
                }
            }
        }
        edges
    }

    fn resolve(&self, module: usize, path: &[String], depth: usize) -> Option<Target> {
        if depth > 32 || path.is_empty() {
            return None;
        }
        let mut segments = path.iter().peekable();
        let mut current = match segments.peek().map(|s| s.as_str()) {
            Some("crate") => {
                segments.next();
                Target::Module(self.root_of(module))
            }
            Some("self") => {
                segments.next();
                Target::Module(module)
            }
            Some("super") => Target::Module(module),
            Some(first) => {
                let first = first.to_string();
                segments.next();
                self.lookup(module, &first, depth)?
            }
            None => return None,
        };
        for segment in segments {
            let Target::Module(m) = current else {
                break;
            };
            current = if segment == "super" {
                Target::Module(self.modules[m].parent?)
            } else if segment == "self" {
                Target::Module(m)
            } else {
                self.lookup(m, segment, depth)?
            };
        }
        Some(current)
    }

    fn root_of(&self, mut module: usize) -> usize {
        while let Some(parent) = self.modules[module].parent {
            module = parent;
        }
        module
    }

    fn lookup(&self, module: usize, name: &str, depth: usize) -> Option<Target> {
        let key = (module, name.to_string());
        if let Some(known) = self.looked_up.borrow().get(&key) {
            return *known;
        }
        self.looked_up.borrow_mut().insert(key.clone(), None);
        let found = self.lookup_uncached(module, name, depth);
        self.looked_up.borrow_mut().insert(key, found);
        found
    }

    fn lookup_uncached(&self, module: usize, name: &str, depth: usize) -> Option<Target> {
        let m = &self.modules[module];
        if let Some(child) = m.children.get(name) {
            return Some(Target::Module(*child));
        }
        if let Some(file) = m.items.get(name) {
            return Some(Target::Item(*file));
        }
        if let Some(path) = m.imports.get(name) {
            return self.resolve(module, path, depth + 1);
        }
        m.globs
            .iter()
            .find_map(|glob| match self.resolve(module, glob, depth + 1)? {
                Target::Module(g) if g != module => self.lookup(g, name, depth + 1),
                _ => None,
            })
    }
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
