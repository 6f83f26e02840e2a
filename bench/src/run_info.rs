//! What makes a benchmark's `--json` self-describing: the exact command, the
//! date, the build and a summary of the machine, recorded by the bench itself
//! (`hugemem bench … --json` puts it under `"run"`, and the bench's name
//! under `"bench"`). `hugemem bench report` quotes it next to every table it
//! generates from the files kept under `docs/results/`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The machine a run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineSummary {
    /// `model name` of the first CPU in `/proc/cpuinfo` (empty when absent).
    pub cpu_model: String,
    /// Online CPUs (`available_parallelism`).
    pub cores: usize,
    /// NUMA nodes with memory (0 when the topology cannot be read).
    pub numa_nodes: usize,
    /// `MemTotal` of `/proc/meminfo`, bytes.
    pub memory_bytes: u64,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel: String,
    /// Whether `/proc/cpuinfo` has the `hypervisor` flag (this is a guest).
    pub virtualized: bool,
    /// The 1-minute load average when the run started (other work on the CPUs).
    pub load_at_start: f64,
}

/// The command and its circumstances.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// The command line as run (`hugemem bench …`), arguments joined by
    /// spaces, each quoted for a POSIX shell where it needs it.
    pub command: String,
    /// UTC date and time the run started, `YYYY-MM-DDTHH:MM:SSZ`.
    pub date: String,
    /// `debug` or `release`.
    pub build: String,
    /// hugemem's version.
    pub version: String,
    /// The machine.
    pub machine: MachineSummary,
}

impl RunInfo {
    /// The current process's run: its arguments as the documented command
    /// (`hugemem-bench X …` is `hugemem bench X …`, `hugemem-bench demo …`
    /// is `hugemem demo …`: the program as `hugemem` either way, as the
    /// files under docs/results/ record it), now, this build and this
    /// machine.
    pub fn current() -> Self {
        Self {
            command: documented_command(std::env::args().skip(1))
                .iter()
                .map(|a| shell_quote(a))
                .collect::<Vec<_>>()
                .join(" "),
            date: utc_date(std::time::SystemTime::now()),
            build: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .into(),
            version: env!("CARGO_PKG_VERSION").into(),
            machine: MachineSummary::detect(),
        }
    }
}

impl MachineSummary {
    /// Reads this machine's summary from `/proc` and sysfs; what cannot be
    /// read stays empty or zero.
    pub fn detect() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let loadavg = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        Self {
            cpu_model: cpuinfo_field(&cpuinfo, "model name").unwrap_or_default(),
            cores: std::thread::available_parallelism().map_or(0, usize::from),
            numa_nodes: numa::Topology::detect().map_or(0, |t| {
                t.nodes().iter().filter(|n| !n.is_memoryless()).count()
            }),
            memory_bytes: mem_total(&meminfo).unwrap_or(0),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            virtualized: cpuinfo_field(&cpuinfo, "flags")
                .is_some_and(|f| f.split_whitespace().any(|x| x == "hypervisor")),
            load_at_start: loadavg
                .split_whitespace()
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0.0),
        }
    }
}

/// `hugemem-bench`'s arguments (without the program) as the documented
/// command that runs them.
fn documented_command(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut args = args.into_iter().peekable();
    let mut command = vec!["hugemem".to_string()];
    if args.peek().map(String::as_str) != Some("demo") {
        command.push("bench".into());
    }
    command.extend(args);
    command
}

/// `arg` as a POSIX shell word: as it is when it has only characters that
/// need no quoting, else in single quotes.
fn shell_quote(arg: &str) -> String {
    let plain = !arg.is_empty()
        && arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_./=:,@%+-".contains(c));
    if plain {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// The value of the first `key : value` line of `/proc/cpuinfo` text.
fn cpuinfo_field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// `MemTotal` of `/proc/meminfo` text, bytes.
fn mem_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `t` as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub fn utc_date(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let [year, month, day, hour, minute, second] = hugemem_client::stats::utc_fields(secs);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

/// A bench report as the JSON `--json` prints: the report's own fields,
/// plus `"bench"` (its name, e.g. `"alloc"`) and `"run"` ([`RunInfo`]).
/// A report that does not serialize to an object is put under `"report"`.
pub fn with_run_info(bench: &str, report: Value, run: &RunInfo) -> Value {
    let mut obj = match report {
        Value::Object(m) => m,
        other => {
            let mut m = serde_json::Map::new();
            m.insert("report".into(), other);
            m
        }
    };
    obj.insert("bench".into(), Value::String(bench.into()));
    obj.insert(
        "run".into(),
        serde_json::to_value(run).unwrap_or(Value::Null),
    );
    Value::Object(obj)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn the_command_is_the_documented_one() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            documented_command(args(&["clear", "--size", "64M"])),
            args(&["hugemem", "bench", "clear", "--size", "64M"])
        );
        assert_eq!(
            documented_command(args(&["demo", "--json"])),
            args(&["hugemem", "demo", "--json"])
        );
    }

    #[test]
    fn dates_are_utc_civil_dates() {
        assert_eq!(utc_date(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        // 2000-02-29 12:34:56 UTC = 951827696 (a leap day).
        assert_eq!(
            utc_date(UNIX_EPOCH + Duration::from_secs(951_827_696)),
            "2000-02-29T12:34:56Z"
        );
        // 2026-11-23 00:00:00 UTC = 1795392000.
        assert_eq!(
            utc_date(UNIX_EPOCH + Duration::from_secs(1_795_392_000)),
            "2026-11-23T00:00:00Z"
        );
    }

    #[test]
    fn arguments_are_quoted_where_a_shell_needs_it() {
        assert_eq!(shell_quote("--size"), "--size");
        assert_eq!(shell_quote("2G"), "2G");
        assert_eq!(shell_quote("/a/b.png"), "/a/b.png");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn proc_fields_parse() {
        let cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu hypervisor avx512f\n";
        assert_eq!(
            cpuinfo_field(cpuinfo, "model name").as_deref(),
            Some("Intel(R) Xeon(R) Processor")
        );
        assert_eq!(cpuinfo_field(cpuinfo, "nothing"), None);
        assert_eq!(
            mem_total("MemTotal:       24576000 kB\nMemFree: 1 kB\n"),
            Some(24_576_000 * 1024)
        );
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn this_machine_is_described_and_wrapped() {
        let run = RunInfo::current();
        // This host's values: present and plausible, whatever they are.
        assert!(run.machine.cores >= 1);
        assert!(!run.machine.kernel.is_empty());
        assert!(run.machine.memory_bytes > 0);
        assert!(run.command.starts_with("hugemem"));
        assert_eq!(run.date.len(), "1970-01-01T00:00:00Z".len());
        let v = with_run_info("clear", serde_json::json!({"x": 1}), &run);
        assert_eq!(v["bench"], "clear");
        assert_eq!(v["x"], 1);
        let back: RunInfo = serde_json::from_value(v["run"].clone()).expect("round trip");
        assert_eq!(back, run);
        let wrapped = with_run_info("x", serde_json::json!([1]), &run);
        assert_eq!(wrapped["report"][0], 1);
    }
}
