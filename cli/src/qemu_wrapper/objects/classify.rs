//! The policy, pure: what the wrapper does with one parsed `-object`, and
//! the rewritten backend for one it takes.

use guest_mem::size::format_size;
use serde_json::Value;

use super::syntax::{ObjectError, QemuObject, Syntax};

/// What the file system says about a `memory-backend-file`'s `mem-path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathInfo {
    /// It is on hugetlbfs.
    pub hugetlbfs: bool,
    /// The file system's block size (the huge-page size on hugetlbfs).
    pub block_size: u64,
    /// It is a directory (QEMU then creates an unlinked file in it, as libvirt
    /// asks for huge pages); a file is a path someone chose for its contents.
    pub is_dir: bool,
}

impl PathInfo {
    /// `statfs` and `stat` of `path`, as this process sees it.
    ///
    /// # Errors
    ///
    /// The `statfs`/`stat` error.
    pub fn of(path: &str) -> std::io::Result<Self> {
        let fs = nix::sys::statfs::statfs(path).map_err(std::io::Error::from)?;
        let meta = std::fs::metadata(path)?;
        Ok(Self {
            hugetlbfs: fs.filesystem_type() == nix::sys::statfs::HUGETLBFS_MAGIC,
            block_size: u64::try_from(fs.block_size()).unwrap_or(0),
            is_dir: meta.is_dir(),
        })
    }
}

/// A memory backend the daemon will provide.
#[derive(Debug, Clone, PartialEq)]
pub struct Take {
    /// The object's id (kept: `-numa … memdev=` and `-machine memory-backend=` name it).
    pub id: String,
    /// Bytes.
    pub size: u64,
    /// Huge-page size asked for, bytes.
    pub page_size: u64,
    /// Host node asked for (`host-nodes` with one node), if any.
    pub node: Option<u32>,
    /// Properties kept as written (besides id and size).
    pub keep: Vec<(String, Value)>,
    /// Properties dropped because the daemon did their work (prealloc, NUMA policy, …).
    pub dropped: Vec<String>,
}

impl Take {
    /// The rewritten object: a `memory-backend-file` on `mem_path`
    /// (`/proc/self/fd/N`), shared, in `syntax`.
    pub fn rewrite(&self, syntax: Syntax, mem_path: &str) -> QemuObject {
        let mut props = vec![
            ("qom-type".to_string(), Value::from("memory-backend-file")),
            ("id".to_string(), Value::from(self.id.clone())),
            ("mem-path".to_string(), Value::from(mem_path)),
            ("share".to_string(), Value::Bool(true)),
        ];
        props.extend(self.keep.iter().cloned());
        let size = match syntax {
            Syntax::Json => Value::from(self.size),
            Syntax::KeyVal => Value::from(self.size.to_string()),
        };
        props.push(("size".to_string(), size));
        QemuObject { syntax, props }
    }
}

/// What to do with one `-object`.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Not a memory backend: untouched, nothing to say.
    Other,
    /// A memory backend the daemon provides.
    Take(Take),
    /// A memory backend left exactly as written, with the reason (said on stderr).
    Leave(String),
}

/// Properties a taken backend keeps: they only change how QEMU treats the
/// mapping (KSM, core dumps, the RAM block's migration name).
const KEPT: &[&str] = &["merge", "dump", "x-use-canonical-path-for-ramblock-id"];

/// Decides what to do with `obj`. `path_info` describes a
/// `memory-backend-file`'s `mem-path` (the caller stats it; `None` when it
/// could not be read).
///
/// # Errors
///
/// [`ObjectError::Unsupported`] for a huge-page backend that needs what the
/// daemon's memory does not give (discard-data, a file of its own, several
/// host nodes, a private mapping, …), and [`ObjectError::BadValue`].
pub fn classify(obj: &QemuObject, path_info: Option<PathInfo>) -> Result<Decision, ObjectError> {
    let qom_type = obj.qom_type().to_string();
    let id = obj.id().to_string();
    let unsupported = |what: String| ObjectError::Unsupported {
        id: id.clone(),
        qom_type: qom_type.clone(),
        what,
    };
    let page_size = match qom_type.as_str() {
        t if !t.starts_with("memory-backend-") => return Ok(Decision::Other),
        "memory-backend-ram" => {
            return Ok(Decision::Leave(format!(
                "{id:?} is memory-backend-ram (the domain asked for no huge pages): left to QEMU"
            )))
        }
        "memory-backend-memfd" => {
            if obj.bool("hugetlb")? != Some(true) {
                return Ok(Decision::Leave(format!(
                    "{id:?} is a memfd without hugetlb (the domain asked for no huge pages): left to QEMU"
                )));
            }
            obj.size("hugetlbsize")?.ok_or_else(|| {
                unsupported(
                    "hugetlb without hugetlbsize (the host's default huge-page size)".into(),
                )
            })?
        }
        "memory-backend-file" => {
            let Some(path) = obj.get("mem-path").and_then(Value::as_str) else {
                return Err(unsupported("a file backend without mem-path".into()));
            };
            let Some(info) = path_info else {
                return Err(unsupported(format!(
                    "mem-path {path:?}, which this process cannot stat"
                )));
            };
            if !info.hugetlbfs {
                return Ok(Decision::Leave(format!(
                    "{id:?} is file memory at {path:?}, not on hugetlbfs (the domain asked for no huge pages): left to QEMU"
                )));
            }
            if !info.is_dir {
                return Err(unsupported(format!(
                    "the file {path:?} (a file chosen for its contents, not a hugetlbfs directory libvirt names for huge pages)"
                )));
            }
            info.block_size
        }
        other => return Err(unsupported(format!("the backend type {other}"))),
    };
    if !matches!(page_size, 0x20_0000 | 0x4000_0000) {
        return Err(unsupported(format!(
            "{} pages (hugemem serves 2M and 1G)",
            format_size(page_size)
        )));
    }
    let size = obj
        .size("size")?
        .filter(|s| *s > 0)
        .ok_or_else(|| unsupported("no size".into()))?;
    if size % page_size != 0 {
        return Err(unsupported(format!(
            "a size of {} bytes, not a whole number of {} pages",
            size,
            format_size(page_size)
        )));
    }
    if obj.bool("share")? == Some(false) {
        return Err(unsupported(
            "a private mapping (share=off: <access mode='private'/>); the guest must write the daemon's pages, so hugemem needs <access mode='shared'/> or no access mode".into(),
        ));
    }
    let nodes = obj.nodes("host-nodes")?;
    let policy = obj
        .get("policy")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let node = match (nodes.as_slice(), policy) {
        ([], "default") => None,
        ([n], "bind" | "preferred") => Some(*n),
        ([], p) => return Err(unsupported(format!("policy {p} without host-nodes"))),
        (many, p) => {
            return Err(unsupported(format!(
                "policy {p} over host nodes {many:?} (the daemon places one backend on one node; give each guest NUMA cell one host node in <numatune><memnode>)"
            )))
        }
    };
    let mut keep = Vec::new();
    let mut dropped = Vec::new();
    for (k, v) in &obj.props {
        match k.as_str() {
            "qom-type" | "id" | "size" | "mem-path" | "share" | "hugetlb" | "hugetlbsize" => {}
            "prealloc" | "prealloc-threads" | "prealloc-context" | "host-nodes" | "policy"
            | "seal" => dropped.push(k.clone()),
            "discard-data" if obj.bool(k)? == Some(true) => {
                return Err(unsupported("discard-data (<discard/>)".into()))
            }
            "discard-data" => {}
            kept if KEPT.contains(&kept) => keep.push((k.clone(), v.clone())),
            other => return Err(unsupported(format!("the property {other}={v}"))),
        }
    }
    Ok(Decision::Take(Take {
        id,
        size,
        page_size,
        node,
        keep,
        dropped,
    }))
}
