//! An `-object` (or `-device`) value in either syntax, parsed into one
//! [`QemuObject`] with typed accessors, and written back as it came.

use std::fmt::Write as _;

use guest_mem::size::parse_size;
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
