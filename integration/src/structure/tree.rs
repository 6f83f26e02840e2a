//! Reading a crate's module tree: its files, the items each module
//! defines, its `use` declarations and its functions' lengths.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;

use super::report::{FnLength, StructureError};

/// A module of the crate: where its items live and what it imports.
#[derive(Debug, Default)]
pub(super) struct Module {
    pub(super) parent: Option<usize>,
    /// Its name in its parent (empty for a crate root).
    pub(super) name: String,
    /// The file its code is in (an inline module shares its file).
    pub(super) file: usize,
    pub(super) children: HashMap<String, usize>,
    /// Items defined here → the file defining them.
    pub(super) items: HashMap<String, usize>,
    /// `use` names → the path they stand for.
    pub(super) imports: HashMap<String, Vec<Vec<String>>>,
    /// `use path::*` sources.
    pub(super) globs: Vec<Vec<String>>,
}

/// What a path resolves to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Target {
    Module(usize),
    Item(usize),
}

pub(super) struct TreeReader {
    pub(super) workspace_root: PathBuf,
    /// Each file (relative path) and its line count.
    pub(super) files: Vec<(PathBuf, usize)>,
    pub(super) test_files: BTreeSet<PathBuf>,
    pub(super) modules: Vec<Module>,
    pub(super) functions: Vec<FnLength>,
    /// Each file's syntax and the module its top level is.
    pub(super) parsed: Vec<(syn::File, usize)>,
    /// Names already looked up, per module: a name is looked up once, and
    /// one met again while it is being looked up (a `use` or glob loop)
    /// resolves to nothing.
    pub(super) looked_up: RefCell<HashMap<(usize, String), Vec<Target>>>,
}

/// Whether `attrs` hold a `cfg` that names `test` (`cfg(test)`,
/// `cfg(all(test, …))`), read from its tokens: `cfg(not(test))` does not,
/// and neither does a feature whose name merely contains "test".
pub(super) fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| match &a.meta {
        syn::Meta::List(list) if list.path.is_ident("cfg") => names_test(list.tokens.clone()),
        _ => false,
    })
}

fn names_test(tokens: proc_macro2::TokenStream) -> bool {
    let mut after_not = false;
    for tree in tokens {
        match tree {
            proc_macro2::TokenTree::Ident(ident) if ident == "test" => return true,
            proc_macro2::TokenTree::Ident(ident) => after_not = ident == "not",
            proc_macro2::TokenTree::Group(group) => {
                if !after_not && names_test(group.stream()) {
                    return true;
                }
                after_not = false;
            }
            _ => after_not = false,
        }
    }
    false
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find_map(|a| match &a.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

impl TreeReader {
    pub(super) fn read_root(&mut self, root: &Path) -> Result<(), StructureError> {
        let module = self.new_module(None, String::new(), 0);
        let dir = root.parent().map(Path::to_path_buf).unwrap_or_default();
        self.read_file(root, module, &dir, false)
    }

    fn new_module(&mut self, parent: Option<usize>, name: String, file: usize) -> usize {
        self.modules.push(Module {
            parent,
            name,
            file,
            ..Module::default()
        });
        self.modules.len() - 1
    }

    /// Reads `path` as the body of `module`; its child modules' files are
    /// looked up in `child_dir`.
    fn read_file(
        &mut self,
        path: &Path,
        module: usize,
        child_dir: &Path,
        test_only: bool,
    ) -> Result<(), StructureError> {
        let text = std::fs::read_to_string(path).map_err(|source| StructureError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let syntax = syn::parse_file(&text).map_err(|e| StructureError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let relative = path
            .strip_prefix(&self.workspace_root)
            .unwrap_or(path)
            .to_path_buf();
        if test_only {
            self.test_files.insert(relative.clone());
        }
        self.files.push((relative, text.lines().count()));
        let file = self.files.len() - 1;
        self.modules[module].file = file;
        let items = syntax.items.clone();
        self.parsed.push((syntax, module));
        self.read_items(&items, module, file, child_dir, test_only)
    }

    fn read_items(
        &mut self,
        items: &[syn::Item],
        module: usize,
        file: usize,
        child_dir: &Path,
        test_only: bool,
    ) -> Result<(), StructureError> {
        for item in items {
            let in_test = test_only || is_cfg_test(item_attrs(item));
            match item {
                syn::Item::Mod(m) => {
                    let name = m.ident.to_string();
                    let child = self.new_module(Some(module), name.clone(), file);
                    self.modules[module].children.insert(name.clone(), child);
                    let dir = child_dir.join(&name);
                    match &m.content {
                        Some((_, inner)) => {
                            self.read_items(inner, child, file, &dir, in_test)?;
                        }
                        None => {
                            let path = match path_attr(&m.attrs) {
                                // `#[path]` is relative to the declaring
                                // file's own directory.
                                Some(p) => self
                                    .workspace_root
                                    .join(&self.files[file].0)
                                    .with_file_name(p),
                                None if child_dir.join(format!("{name}.rs")).is_file() => {
                                    child_dir.join(format!("{name}.rs"))
                                }
                                None => dir.join("mod.rs"),
                            };
                            let is_mod_rs = path.file_name().is_some_and(|f| f == "mod.rs");
                            let grand_dir = if is_mod_rs {
                                path.parent().map(Path::to_path_buf).unwrap_or_default()
                            } else {
                                dir
                            };
                            self.read_file(&path, child, &grand_dir, in_test)?;
                        }
                    }
                }
                syn::Item::Use(u) if !in_test => {
                    let mut leaves = Vec::new();
                    use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                    for (name, path) in leaves {
                        match name {
                            Some(name) => {
                                self.modules[module]
                                    .imports
                                    .entry(name)
                                    .or_default()
                                    .push(path);
                            }
                            None => self.modules[module].globs.push(path),
                        }
                    }
                }
                _ if in_test => {}
                other => {
                    if let Some(name) = item_name(other) {
                        self.modules[module].items.insert(name, file);
                    }
                    self.record_functions(other, file);
                }
            }
        }
        Ok(())
    }

    fn record_functions(&mut self, item: &syn::Item, file: usize) {
        let path = self.files[file].0.clone();
        let mut push = |name: String, sig: &syn::Signature, block: &syn::Block| {
            let start = sig.fn_token.span().start().line;
            let end = block.brace_token.span.close().end().line;
            self.functions.push(FnLength {
                lines: end.saturating_sub(start) + 1,
                file: path.clone(),
                name,
                line: start,
            });
        };
        match item {
            syn::Item::Fn(f) => push(f.sig.ident.to_string(), &f.sig, &f.block),
            syn::Item::Impl(imp) => {
                let owner = quote::ToTokens::to_token_stream(&imp.self_ty)
                    .to_string()
                    .replace(' ', "");
                for it in &imp.items {
                    if let syn::ImplItem::Fn(f) = it {
                        if !is_cfg_test(&f.attrs) {
                            push(format!("{owner}::{}", f.sig.ident), &f.sig, &f.block);
                        }
                    }
                }
            }
            syn::Item::Trait(t) => {
                for it in &t.items {
                    if let syn::TraitItem::Fn(syn::TraitItemFn {
                        sig,
                        default: Some(block),
                        ..
                    }) = it
                    {
                        push(format!("{}::{}", t.ident, sig.ident), sig, block);
                    }
                }
            }
            _ => {}
        }
    }
}

pub(super) fn item_attrs(item: &syn::Item) -> &[syn::Attribute] {
    match item {
        syn::Item::Const(i) => &i.attrs,
        syn::Item::Enum(i) => &i.attrs,
        syn::Item::Fn(i) => &i.attrs,
        syn::Item::Impl(i) => &i.attrs,
        syn::Item::Macro(i) => &i.attrs,
        syn::Item::Mod(i) => &i.attrs,
        syn::Item::Static(i) => &i.attrs,
        syn::Item::Struct(i) => &i.attrs,
        syn::Item::Trait(i) => &i.attrs,
        syn::Item::Type(i) => &i.attrs,
        syn::Item::Union(i) => &i.attrs,
        syn::Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

fn item_name(item: &syn::Item) -> Option<String> {
    let ident = match item {
        syn::Item::Const(i) => &i.ident,
        syn::Item::Enum(i) => &i.ident,
        syn::Item::Fn(i) => &i.sig.ident,
        syn::Item::Static(i) => &i.ident,
        syn::Item::Struct(i) => &i.ident,
        syn::Item::Trait(i) => &i.ident,
        syn::Item::Type(i) => &i.ident,
        syn::Item::Union(i) => &i.ident,
        _ => return None,
    };
    Some(ident.to_string())
}

/// The names a `use` tree brings in: `(Some(name), path)`, or `(None,
/// path)` for a glob.
pub(super) fn use_leaves(
    tree: &syn::UseTree,
    prefix: &mut Vec<String>,
    out: &mut Vec<(Option<String>, Vec<String>)>,
) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            if name == "self" {
                if let Some(last) = prefix.last() {
                    out.push((Some(last.clone()), prefix.clone()));
                }
            } else {
                let mut path = prefix.clone();
                path.push(name.clone());
                out.push((Some(name), path));
            }
        }
        syn::UseTree::Rename(r) => {
            let mut path = prefix.clone();
            if r.ident != "self" {
                path.push(r.ident.to_string());
            }
            out.push((Some(r.rename.to_string()), path));
        }
        syn::UseTree::Glob(_) => out.push((None, prefix.clone())),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_leaves(t, prefix, out);
            }
        }
    }
}
