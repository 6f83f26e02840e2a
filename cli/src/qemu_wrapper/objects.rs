//! QEMU `-object` values in both syntaxes, and what the wrapper does with
//! each memory backend.
//!
//! libvirt 9 writes `-object` as JSON (`{"qom-type":"memory-backend-file",
//! "id":"ram-node0",…}`); older libvirt, and people, write QEMU's key=value
//! form (`memory-backend-file,id=ram-node0,…`, a comma inside a value doubled).
//! Both parse into one [`QemuObject`]: its properties in the order they were
//! written, each a JSON value (a key=value value is a string until a typed
//! accessor reads it), and both are written back in the syntax they came in.
//!
//! [`classify`] is the policy, pure: a memory backend that asked for huge
//! pages is taken ([`Take`]); one that did not is left to QEMU with a note
//! ([`Decision::Leave`]); anything the daemon's memory cannot honestly stand
//! in for is an error ([`ObjectError::Unsupported`]) and the domain does not
//! start.

use std::fmt::Write as _;

use guest_mem::size::{format_size, parse_size};
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

/// How an `-object` value was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// `{"qom-type":…}`.
    Json,
    /// `type,key=value,…`.
    KeyVal,
}

/// One parsed `-object` value.
#[derive(Debug, Clone, PartialEq)]
pub struct QemuObject {
    /// The syntax it came in (and goes back out in).
    pub syntax: Syntax,
    /// Properties in the order written; `qom-type` among them.
    pub props: Vec<(String, Value)>,
}

/// An `-object` value the wrapper cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ObjectError {
    /// It does not parse.
    #[error("cannot parse -object {value:?}: {why}")]
    Parse {
        /// The value as given.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// A property has the wrong type or an unusable value.
    #[error("memory backend {id:?}: property {key:?} = {value}: {why}")]
    BadValue {
        /// The backend's id.
        id: String,
        /// The property.
        key: String,
        /// Its value, as JSON.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
    /// The backend needs something the daemon's memory does not give.
    #[error("memory backend {id:?} ({qom_type}) needs {what}, which hugemem does not provide; the domain is not started (remove it from the domain, or use the real QEMU as <emulator>)")]
    Unsupported {
        /// The backend's id.
        id: String,
        /// Its type.
        qom_type: String,
        /// What it needs.
        what: String,
    },
}

/// Properties in order, from a JSON object (serde_json's `Map` sorts keys
/// unless a crate-wide feature is on; the order libvirt wrote is kept here).
struct Ordered(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Ordered, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    out.push((k, v));
                }
                Ok(Ordered(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Splits a QEMU key=value list at single commas; `,,` is a literal comma.
fn split_keyval(text: &str) -> Vec<String> {
    let mut items = Vec::new();
    let mut cur = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                items.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    items.push(cur);
    items
}

impl QemuObject {
    /// Parses an `-object` value: JSON when it starts with `{`, else key=value
    /// (a first item without `=` is the `qom-type`).
    ///
    /// # Errors
    ///
    /// [`ObjectError::Parse`].
    pub fn parse(text: &str) -> Result<Self, ObjectError> {
        let err = |why: String| ObjectError::Parse {
            value: text.to_string(),
            why,
        };
        if text.trim_start().starts_with('{') {
            let Ordered(props) = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
            return Ok(Self {
                syntax: Syntax::Json,
                props,
            });
        }
        let mut props = Vec::new();
        for (i, item) in split_keyval(text).into_iter().enumerate() {
            match item.split_once('=') {
                Some((k, v)) => props.push((k.to_string(), Value::String(v.to_string()))),
                None if i == 0 && !item.is_empty() => {
                    props.push(("qom-type".to_string(), Value::String(item)));
                }
                None => return Err(err(format!("item {item:?} has no '='"))),
            }
        }
        Ok(Self {
            syntax: Syntax::KeyVal,
            props,
        })
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.props.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// `qom-type` (empty when missing).
    pub fn qom_type(&self) -> &str {
        self.get("qom-type").and_then(Value::as_str).unwrap_or("")
    }

    /// `id` (empty when missing).
    pub fn id(&self) -> &str {
        self.get("id").and_then(Value::as_str).unwrap_or("")
    }

    fn bad(&self, key: &str, value: &Value, why: &'static str) -> ObjectError {
        ObjectError::BadValue {
            id: self.id().to_string(),
            key: key.to_string(),
            value: value.to_string(),
            why,
        }
    }

    /// A boolean property (`true`/`false`, or `on`/`off`/`yes`/`no`/`true`/`false`).
    ///
    /// # Errors
    ///
    /// [`ObjectError::BadValue`] for anything else.
    pub fn bool(&self, key: &str) -> Result<Option<bool>, ObjectError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v {
            Value::Bool(b) => Ok(Some(*b)),
            Value::String(s) => match s.as_str() {
                "on" | "yes" | "true" => Ok(Some(true)),
                "off" | "no" | "false" => Ok(Some(false)),
                _ => Err(self.bad(key, v, "not a boolean")),
            },
            _ => Err(self.bad(key, v, "not a boolean")),
        }
    }

    /// A size property (a JSON number, or bytes with an optional K/M/G/T suffix).
    ///
    /// # Errors
    ///
    /// [`ObjectError::BadValue`] for anything else.
    pub fn size(&self, key: &str) -> Result<Option<u64>, ObjectError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v {
            Value::Number(n) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| self.bad(key, v, "not a size in bytes")),
            Value::String(s) => parse_size(s)
                .map(Some)
                .map_err(|_| self.bad(key, v, "not a size in bytes")),
            _ => Err(self.bad(key, v, "not a size in bytes")),
        }
    }

    /// A node list: JSON `[0, 1]`, or key=value `0`, `0-2`, repeated keys.
    ///
    /// # Errors
    ///
    /// [`ObjectError::BadValue`] for anything else.
    pub fn nodes(&self, key: &str) -> Result<Vec<u32>, ObjectError> {
        let mut out = Vec::new();
        for (_, v) in self.props.iter().filter(|(k, _)| k == key) {
            let bad = || self.bad(key, v, "not a list of node numbers");
            match v {
                Value::Array(items) => {
                    for item in items {
                        let n = item.as_u64().ok_or_else(bad)?;
                        out.push(u32::try_from(n).map_err(|_| bad())?);
                    }
                }
                Value::Number(n) => {
                    out.push(u32::try_from(n.as_u64().ok_or_else(bad)?).map_err(|_| bad())?);
                }
                Value::String(s) => {
                    let (lo, hi) = s.split_once('-').unwrap_or((s, s));
                    let lo: u32 = lo.trim().parse().map_err(|_| bad())?;
                    let hi: u32 = hi.trim().parse().map_err(|_| bad())?;
                    if hi < lo || hi - lo > 1024 {
                        return Err(bad());
                    }
                    out.extend(lo..=hi);
                }
                _ => return Err(bad()),
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    /// The value as an `-object` argument, in the syntax it came in.
    pub fn to_arg(&self) -> String {
        match self.syntax {
            Syntax::Json => {
                let mut s = String::from("{");
                for (i, (k, v)) in self.props.iter().enumerate() {
                    if i > 0 {
                        s.push(',');
                    }
                    // Serializing a String or a Value cannot fail.
                    let _ = write!(
                        s,
                        "{}:{}",
                        Value::String(k.clone()),
                        serde_json::to_string(v).unwrap_or_default()
                    );
                }
                s.push('}');
                s
            }
            Syntax::KeyVal => {
                let mut items: Vec<String> = Vec::new();
                let scalar = |v: &Value| match v {
                    Value::String(s) => s.replace(',', ",,"),
                    Value::Bool(true) => "on".into(),
                    Value::Bool(false) => "off".into(),
                    other => other.to_string().replace(',', ",,"),
                };
                for (i, (k, v)) in self.props.iter().enumerate() {
                    match v {
                        // The type first, as QEMU's implied key.
                        _ if i == 0 && k == "qom-type" => items.push(scalar(v)),
                        Value::Array(list) => {
                            items.extend(list.iter().map(|x| format!("{k}={}", scalar(x))));
                        }
                        _ => items.push(format!("{k}={}", scalar(v))),
                    }
                }
                items.join(",")
            }
        }
    }
}

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

/// The driver of a `-device` value (JSON `driver`, or the first key=value item).
pub fn device_driver(text: &str) -> Option<String> {
    if text.trim_start().starts_with('{') {
        let Ordered(props) = serde_json::from_str(text).ok()?;
        return props
            .into_iter()
            .find(|(k, _)| k == "driver")
            .and_then(|(_, v)| v.as_str().map(str::to_string));
    }
    let first = split_keyval(text).into_iter().next()?;
    match first.split_once('=') {
        None => Some(first),
        Some(_) => split_keyval(text)
            .into_iter()
            .find_map(|i| i.strip_prefix("driver=").map(str::to_string)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIBVIRT_FILE: &str = r#"{"qom-type":"memory-backend-file","id":"ram-node0","mem-path":"/dev/hugepages-1G/libvirt/qemu/1-hm1","share":true,"prealloc":true,"size":1073741824,"host-nodes":[0],"policy":"bind","prealloc-context":"tc-ram-node0"}"#;

    fn hugetlb_dir() -> Option<PathInfo> {
        Some(PathInfo {
            hugetlbfs: true,
            block_size: 1 << 30,
            is_dir: true,
        })
    }

    fn take(text: &str, info: Option<PathInfo>) -> Take {
        match classify(&QemuObject::parse(text).expect("parse"), info).expect("classify") {
            Decision::Take(t) => t,
            other => panic!("{text}: {other:?}"),
        }
    }

    fn unsupported(text: &str, info: Option<PathInfo>) -> String {
        match classify(&QemuObject::parse(text).expect("parse"), info) {
            Err(e @ ObjectError::Unsupported { .. }) => e.to_string(),
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn libvirt_9_json_file_backend_is_taken_and_rewritten() {
        let obj = QemuObject::parse(LIBVIRT_FILE).expect("parse");
        assert_eq!(obj.syntax, Syntax::Json);
        // Round trip keeps libvirt's order.
        assert_eq!(obj.to_arg(), LIBVIRT_FILE);
        let t = take(LIBVIRT_FILE, hugetlb_dir());
        assert_eq!(
            (t.id.as_str(), t.size, t.page_size, t.node),
            ("ram-node0", 1 << 30, 1 << 30, Some(0))
        );
        assert_eq!(
            t.dropped,
            ["prealloc", "host-nodes", "policy", "prealloc-context"]
        );
        assert_eq!(
            t.rewrite(Syntax::Json, "/dev/fd/5").to_arg(),
            r#"{"qom-type":"memory-backend-file","id":"ram-node0","mem-path":"/dev/fd/5","share":true,"size":1073741824}"#
        );
    }

    #[test]
    fn keyval_backends() {
        let text = "memory-backend-file,id=ram,,0,mem-path=/dev/hugepages-2M/libvirt/qemu/1-x,prealloc=on,size=2G,host-nodes=1,policy=bind,merge=off";
        let obj = QemuObject::parse(text).expect("parse");
        assert_eq!(obj.syntax, Syntax::KeyVal);
        assert_eq!(obj.id(), "ram,0");
        assert_eq!(obj.to_arg(), text);
        let t = take(
            text,
            Some(PathInfo {
                hugetlbfs: true,
                block_size: 2 << 20,
                is_dir: true,
            }),
        );
        assert_eq!((t.size, t.page_size, t.node), (2 << 30, 2 << 20, Some(1)));
        assert_eq!(
            t.rewrite(Syntax::KeyVal, "/dev/fd/7").to_arg(),
            "memory-backend-file,id=ram,,0,mem-path=/dev/fd/7,share=on,merge=off,size=2147483648"
        );
        // memfd with hugetlb (libvirt <source type='memfd'/>), no host node.
        let t = take(
            r#"{"qom-type":"memory-backend-memfd","id":"pc.ram","hugetlb":true,"hugetlbsize":1073741824,"share":true,"prealloc":true,"size":2147483648}"#,
            None,
        );
        assert_eq!((t.size, t.page_size, t.node), (2 << 30, 1 << 30, None));
        let t = take(
            "qom-type=memory-backend-memfd,id=m,hugetlb=yes,hugetlbsize=2M,size=64M,host-nodes=0-0,policy=preferred",
            None,
        );
        assert_eq!((t.size, t.page_size, t.node), (64 << 20, 2 << 20, Some(0)));
    }

    #[test]
    fn backends_without_huge_pages_are_left_alone() {
        for (text, info) in [
            (
                r#"{"qom-type":"memory-backend-ram","id":"pc.ram","size":1073741824}"#,
                None,
            ),
            ("memory-backend-memfd,id=m,size=1G,share=on", None),
            (
                r#"{"qom-type":"memory-backend-file","id":"ram-node0","mem-path":"/var/lib/libvirt/qemu/ram/1-x/ram-node0","share":true,"size":1073741824}"#,
                Some(PathInfo {
                    hugetlbfs: false,
                    block_size: 4096,
                    is_dir: false,
                }),
            ),
        ] {
            let obj = QemuObject::parse(text).expect("parse");
            assert!(
                matches!(classify(&obj, info), Ok(Decision::Leave(_))),
                "{text}"
            );
        }
        let obj = QemuObject::parse(r#"{"qom-type":"secret","id":"s","data":"x"}"#).expect("parse");
        assert_eq!(classify(&obj, None), Ok(Decision::Other));
    }

    #[test]
    fn what_the_daemon_cannot_stand_in_for_is_refused() {
        let with = |extra: &str| LIBVIRT_FILE.replace(r#""share":true"#, extra);
        for (text, info, what) in [
            (
                with(r#""share":true,"discard-data":true"#),
                hugetlb_dir(),
                "discard-data",
            ),
            (with(r#""share":false"#), hugetlb_dir(), "private mapping"),
            (with(r#""share":true,"pmem":true"#), hugetlb_dir(), "pmem"),
            (
                with(r#""share":true,"readonly":true"#),
                hugetlb_dir(),
                "readonly",
            ),
            (
                LIBVIRT_FILE.replace("[0]", "[0,1]"),
                hugetlb_dir(),
                "host nodes [0, 1]",
            ),
            (
                LIBVIRT_FILE.to_string(),
                Some(PathInfo {
                    hugetlbfs: true,
                    block_size: 1 << 30,
                    is_dir: false,
                }),
                "chosen for its contents",
            ),
            (LIBVIRT_FILE.to_string(), None, "cannot stat"),
            (
                LIBVIRT_FILE.replace("1073741824", "1073745920"),
                hugetlb_dir(),
                "whole number",
            ),
            (
                r#"{"qom-type":"memory-backend-epc","id":"e","size":1048576}"#.to_string(),
                None,
                "memory-backend-epc",
            ),
        ] {
            let msg = unsupported(&text, info);
            assert!(msg.contains(what), "{what} not in {msg}");
            assert!(msg.contains("not started"), "{msg}");
        }
        // discard-data=false is what QEMU does anyway.
        let t = take(&with(r#""share":true,"discard-data":false"#), hugetlb_dir());
        assert_eq!(t.size, 1 << 30);
    }

    #[test]
    fn bad_values_and_syntax() {
        assert!(QemuObject::parse("{not json").is_err());
        assert!(QemuObject::parse("memory-backend-ram,id=x,oops").is_err());
        let obj = QemuObject::parse("memory-backend-file,id=x,size=lots").expect("parse");
        assert!(matches!(
            obj.size("size"),
            Err(ObjectError::BadValue { .. })
        ));
        let obj = QemuObject::parse("memory-backend-file,id=x,share=maybe").expect("parse");
        assert!(obj.bool("share").is_err());
        let obj = QemuObject::parse("memory-backend-file,id=x,host-nodes=3-1").expect("parse");
        assert!(obj.nodes("host-nodes").is_err());
        let obj =
            QemuObject::parse("memory-backend-file,host-nodes=0,host-nodes=2-3").expect("parse");
        assert_eq!(obj.nodes("host-nodes"), Ok(vec![0, 2, 3]));
    }

    #[test]
    fn device_drivers() {
        assert_eq!(
            device_driver(
                r#"{"driver":"virtio-mem-pci","memdev":"memvirtiomem0","id":"virtiomem0"}"#
            )
            .as_deref(),
            Some("virtio-mem-pci")
        );
        assert_eq!(
            device_driver("isa-debug-exit,iobase=0x501").as_deref(),
            Some("isa-debug-exit")
        );
        assert_eq!(
            device_driver("driver=virtio-mem-pci,memdev=m").as_deref(),
            Some("virtio-mem-pci")
        );
    }
}
