//! Counters, the STATS JSON's counter part, and the Prometheus text endpoint.
//!
//! # Design
//!
//! Counters are lock-free `AtomicU64`s with `Relaxed` ordering grouped in one
//! struct (as Firecracker's metrics): the scrubbers bump them from their own
//! threads without touching the pool lock. Gauges that describe the pool
//! (bytes per node, size and state) are not kept as counters at all: they
//! are computed from the pool's entries when asked, so they cannot drift
//! from the truth.
//!
//! The endpoint is a tiny HTTP/1.0 responder on a tokio `TcpListener`: one
//! request line, `GET /metrics`, one response, close. It is off by default,
//! refuses non-loopback addresses (config validation), and bounds what it
//! reads (8 KiB, 5 s). A full HTTP server crate would be the alternative; for
//! one read-only text page it is not worth the dependency.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use numa::NodeId;

/// Daemon-wide counters (monotonic unless noted).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Connections accepted (and allowed).
    pub sessions_total: AtomicU64,
    /// Live sessions (gauge).
    pub sessions_active: AtomicU64,
    /// Connections refused by the uid check.
    pub peers_refused: AtomicU64,
    /// Connections closed because of a protocol or transport error
    /// (malformed frame, handshake timeout, reply not deliverable).
    pub connection_errors: AtomicU64,
    /// ALLOC requests that succeeded.
    pub allocs_ok: AtomicU64,
    /// ALLOC requests that failed.
    pub allocs_failed: AtomicU64,
    /// Regions handed out from the clean pool.
    pub regions_pooled: AtomicU64,
    /// Regions handed out after clearing a dirty pooled region on the ALLOC path.
    pub regions_recleared: AtomicU64,
    /// Regions handed out after growing a smaller clean pooled region.
    pub regions_grown: AtomicU64,
    /// ALLOC parts that `best` served on a smaller page size than the
    /// largest allowed because the larger pages did not exist (neither free
    /// nor pooled).
    pub downgrades: AtomicU64,
    /// Released regions found damaged by their tenant (file size changed,
    /// holes that cannot be filled) and given back to the kernel unscrubbed.
    pub regions_discarded: AtomicU64,
    /// Pages punched out of released regions and refaulted fresh before
    /// reuse (`pool.detach_pages`), so that no pin keeps a reused page.
    pub pages_detached: AtomicU64,
    /// Released regions found withheld: no process holds them, yet another
    /// open description of the file exists (an fd in flight). They stay
    /// quarantined and are re-checked; counted once per release.
    pub regions_withheld: AtomicU64,
    /// Region files of an earlier daemon instance found at start and unlinked.
    pub leftover_files_released: AtomicU64,
    /// Bytes those files held.
    pub leftover_bytes_released: AtomicU64,
    /// Regions created fresh from the kernel.
    pub regions_fresh: AtomicU64,
    /// FREE requests that succeeded.
    pub frees: AtomicU64,
    /// Bytes of regions created fresh.
    pub bytes_created: AtomicU64,
    /// Bytes of regions given back to the kernel.
    pub bytes_released: AtomicU64,
    /// Quarantine scans of `/proc`.
    pub quarantine_scans: AtomicU64,
}

impl Metrics {
    /// Adds `n` to a counter.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Per-node scrubber counters.
#[derive(Debug)]
pub struct ScrubCounters {
    /// The node.
    pub node: NodeId,
    /// Scrubber threads.
    pub threads: usize,
    /// Bytes cleared.
    pub bytes: AtomicU64,
    /// Nanoseconds spent inside clearing kernels, summed over threads.
    pub nanos: AtomicU64,
    /// Kernel calls (batches).
    pub batches: AtomicU64,
}

impl ScrubCounters {
    /// New, zeroed.
    pub fn new(node: NodeId, threads: usize) -> Self {
        Self {
            node,
            threads,
            bytes: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            batches: AtomicU64::new(0),
        }
    }

    /// Bytes per second of clearing time, in GB/s (10^9).
    pub fn gb_per_s(&self) -> f64 {
        gb_per_s(Metrics::get(&self.bytes), Metrics::get(&self.nanos))
    }
}

/// GB/s (10^9) from bytes and nanoseconds; 0 without time.
pub fn gb_per_s(bytes: u64, nanos: u64) -> f64 {
    guest_mem::size::gb_per_s(bytes, std::time::Duration::from_nanos(nanos).as_secs_f64())
}

/// Renders the STATS JSON as Prometheus text exposition format (0.0.4).
pub fn render_prometheus(stats: &Value) -> String {
    let mut out = String::new();
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let mut metric = |name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, v) in samples {
            out.push_str(&format!("{name}{labels} {v}\n"));
        }
    };
    let pools = stats
        .get("pools")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut bytes = Vec::new();
    let mut regions = Vec::new();
    for p in &pools {
        let node = p.get("node").map_or_else(String::new, |n| n.to_string());
        let size = p.get("page_size").and_then(Value::as_str).unwrap_or("?");
        for state in ["clean", "dirty", "quarantined", "in_use"] {
            let labels = format!("{{node=\"{node}\",page_size=\"{size}\",state=\"{state}\"}}");
            bytes.push((labels.clone(), num(p, &format!("{state}_bytes"))));
            regions.push((labels, p.get("regions").map_or(0.0, |r| num(r, state))));
        }
    }
    metric(
        "hugemem_pool_bytes",
        "gauge",
        "Pooled and in-use bytes by node, page size and state.",
        bytes,
    );
    metric(
        "hugemem_pool_regions",
        "gauge",
        "Regions by node, page size and state.",
        regions,
    );
    let counters = stats.get("counters").cloned().unwrap_or(Value::Null);
    if let Some(map) = counters.as_object() {
        for (k, v) in map {
            let kind = if k.ends_with("_active") {
                "gauge"
            } else {
                "counter"
            };
            let name = format!("hugemem_{k}");
            metric(
                &name,
                kind,
                &format!("Daemon counter {k}."),
                vec![(String::new(), v.as_f64().unwrap_or(0.0))],
            );
        }
    }
    let scrub = stats
        .get("scrub")
        .and_then(|s| s.get("nodes"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let per_node = |field: &str| {
        scrub
            .iter()
            .map(|n| {
                (
                    format!(
                        "{{node=\"{}\"}}",
                        n.get("node").map_or_else(String::new, Value::to_string)
                    ),
                    num(n, field),
                )
            })
            .collect()
    };
    metric(
        "hugemem_scrub_bytes_total",
        "counter",
        "Bytes cleared by the scrubbers.",
        per_node("bytes"),
    );
    metric(
        "hugemem_scrub_seconds_total",
        "counter",
        "Seconds spent clearing, summed over scrubber threads.",
        per_node("seconds"),
    );
    metric(
        "hugemem_scrub_pending_bytes",
        "gauge",
        "Dirty bytes waiting for a scrubber.",
        per_node("pending_bytes"),
    );
    metric(
        "hugemem_sessions",
        "gauge",
        "Live client sessions.",
        vec![(
            String::new(),
            stats.get("sessions").map_or(0.0, |s| num(s, "active")),
        )],
    );
    out
}

/// Serves `GET /metrics` on `listener` until `cancel` fires.
pub async fn serve(
    listener: TcpListener,
    stats: Arc<dyn Fn() -> Value + Send + Sync>,
    cancel: CancellationToken,
) {
    let addr = listener.local_addr().ok();
    info!(?addr, "metrics endpoint listening");
    loop {
        let (mut sock, peer) = tokio::select! {
            () = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    debug!(error = %e, "metrics accept failed");
                    continue;
                }
            },
        };
        let stats = Arc::clone(&stats);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut got = 0;
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while got < buf.len() {
                    let n = sock.read(&mut buf[got..]).await?;
                    if n == 0 {
                        break;
                    }
                    got += n;
                    if buf[..got].windows(4).any(|w| w == b"\r\n\r\n")
                        || buf[..got].windows(2).any(|w| w == b"\n\n")
                    {
                        break;
                    }
                }
                Ok::<(), std::io::Error>(())
            })
            .await;
            if !matches!(read, Ok(Ok(()))) {
                return;
            }
            let request = String::from_utf8_lossy(&buf[..got]);
            let line = request.lines().next().unwrap_or("");
            let mut parts = line.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let response = if method == "GET" && (path == "/metrics" || path == "/") {
                let body = render_prometheus(&stats());
                format!(
                    "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: 10\r\nConnection: close\r\n\r\nnot found\n".to_string()
            };
            let _ =
                tokio::time::timeout(Duration::from_secs(5), sock.write_all(response.as_bytes()))
                    .await;
            debug!(%peer, "metrics served");
        });
    }
}

/// Binds the endpoint (loopback was checked by config validation).
///
/// # Errors
///
/// The bind error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_pool_gauges_and_counters() {
        let stats = serde_json::json!({
            "pools": [{"node": 0, "page_size": "2M", "clean_bytes": 4194304, "dirty_bytes": 0,
                       "quarantined_bytes": 0, "in_use_bytes": 2097152,
                       "regions": {"clean": 1, "dirty": 0, "quarantined": 0, "in_use": 1}}],
            "counters": {"allocs_ok": 3, "sessions_active": 1},
            "scrub": {"nodes": [{"node": 0, "bytes": 10, "seconds": 0.5, "pending_bytes": 0}]},
            "sessions": {"active": 1, "total": 2}
        });
        let text = render_prometheus(&stats);
        assert!(
            text.contains(
                "hugemem_pool_bytes{node=\"0\",page_size=\"2M\",state=\"clean\"} 4194304"
            ),
            "{text}"
        );
        assert!(text.contains("hugemem_allocs_ok 3"), "{text}");
        assert!(
            text.contains("# TYPE hugemem_sessions_active gauge"),
            "{text}"
        );
        assert!(
            text.contains("hugemem_scrub_bytes_total{node=\"0\"} 10"),
            "{text}"
        );
        let table = crate::status::render_status(&stats);
        assert!(table.contains("2M"), "{table}");
        assert!(table.contains("4M"), "{table}");
    }
}
