//! The JSON of a results file as the document quotes it: a value at a
//! dotted path, and its formatting.

use serde_json::Value;

/// The value at a dotted `path` (keys, indexes, `field=value` selectors).
pub fn lookup<'a>(mut v: &'a Value, path: &str) -> Option<&'a Value> {
    for seg in path.split('.') {
        v = match v {
            Value::Object(m) => m.get(seg)?,
            Value::Array(a) => match seg.split_once('=') {
                Some((field, want)) => a
                    .iter()
                    .find(|e| e.get(field).and_then(Value::as_str) == Some(want))?,
                None => a.get(seg.parse::<usize>().ok()?)?,
            },
            _ => return None,
        };
    }
    Some(v)
}

/// `v` shown as `format` (`.N` + suffix, `+.N` + suffix with the sign
/// always shown, `s`, or `size`: bytes as `2G`).
pub fn format_value(v: &Value, format: &str) -> Option<String> {
    if let Some(unsigned) = format.strip_prefix('+') {
        let shown = format_value(v, unsigned)?;
        return Some(if v.as_f64()? >= 0.0 && !shown.starts_with('-') {
            format!("+{shown}")
        } else {
            shown
        });
    }
    if format == "size" {
        return v.as_u64().map(guest_mem::size::format_size);
    }
    if format == "s" {
        return match v {
            Value::String(s) => Some(s.clone()),
            Value::Number(_) | Value::Bool(_) => Some(v.to_string()),
            _ => None,
        };
    }
    let spec = format.strip_prefix('.')?;
    let digits_len = spec.chars().take_while(char::is_ascii_digit).count();
    let digits: usize = spec[..digits_len].parse().ok()?;
    let suffix = &spec[digits_len..];
    Some(format!("{}{suffix}", fixed(v.as_f64()?, digits)))
}

/// `x` with `digits` decimals.
pub(crate) fn fixed(x: f64, digits: usize) -> String {
    format!("{x:.digits$}")
}
