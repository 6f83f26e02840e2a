//! The Prometheus endpoint (`[metrics] listen`): `GET /metrics`.
//!
//! # Design
//!
//! Built from two maintained crates instead of by hand:
//!
//! * [`prometheus_client`] (the Prometheus project's Rust client) owns the
//!   exposition format: names, `# HELP`/`# TYPE`/`# UNIT`, label escaping,
//!   the `_total` suffix of counters, `# EOF`. The daemon's figures are not
//!   kept twice: one [`Collector`] reads them when scraped — the daemon's
//!   lock-free counters ([`Metrics`]), the scrubbers' counters, the pool's
//!   per-state figures and the fault services' sums ([`FaultTotals`]) — and
//!   hands them to the encoder as const counters and gauges, so the endpoint
//!   cannot drift from STATS.
//! * [`hyper`] 1.x (HTTP/1 server only, on the tokio runtime the daemon
//!   already runs, with `hyper-util`'s tokio glue) parses requests and
//!   writes responses. It is the HTTP implementation under axum, reqwest
//!   and tonic: well kept, and small once only `server` + `http1` are on.
//!   A framework (axum, warp) would add routing and middleware one read-only
//!   page does not need.
//!
//! The endpoint is off by default; config validation refuses non-loopback
//! addresses. Each connection has 5 s to send its request head and 10 s in
//! all, at most [`MAX_CONNECTIONS`] are served at once (more wait in the
//! kernel's accept queue), and keep-alive is off: one scrape, one
//! connection. Anything but `GET`/`HEAD` of `/metrics` (or `/`) is 404/405.
//!
//! [`FaultTotals`]: crate::fault::FaultTotals

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hugemem_client::stats::PoolStats;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::daemon::counters::metrics::Metrics;
use crate::daemon::pool::PoolPart;
use crate::daemon::requests::stats::StatsSource;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Time a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time one connection may take in all.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// The OpenMetrics text format `prometheus_client` writes (Prometheus
/// scrapes it natively).
pub const CONTENT_TYPE_OPENMETRICS: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The registry with the daemon's collector; encoded once per scrape.
pub fn registry(source: Arc<StatsSource>) -> Registry {
    let mut registry = Registry::with_prefix("hugemem");
    registry.register_collector(Box::new(DaemonCollector { source }));
    registry
}

/// The exposition text of `registry`.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        // Writing into a String cannot fail; an encoder error is a bug.
        warn!(error = %e, "cannot encode metrics");
    }
    out
}

/// The daemon's figures, read at each scrape.
#[derive(Debug)]
struct DaemonCollector {
    source: Arc<StatsSource>,
}

/// Labels of one pool: its key.
type PoolLabels = [(&'static str, String); 3];

/// Encodes one unlabelled counter.
fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    let m = enc.encode_descriptor(name, help, unit, c.metric_type())?;
    c.encode(m)
}

/// Encodes one unlabelled gauge.
fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: i64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    let m = enc.encode_descriptor(name, help, unit, g.metric_type())?;
    g.encode(m)
}

/// A figure the exposition carries as a gauge (`i64`), saturated.
fn g64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

mod counters;

impl DaemonCollector {
    /// REATTACH and HANDOFF refusals by kind and uid (the totals by kind
    /// are `reattach_refused` and `handoff_refused`).
    fn encode_token_refusals(
        m: &Metrics,
        enc: &mut DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let mut family = enc.encode_descriptor(
            "token_refusals",
            "REATTACH and HANDOFF requests refused for their id, uid or token (guesses), by kind and uid (uid=\"other\" beyond 256 uids).",
            None,
            MetricType::Counter,
        )?;
        for (kind, uid, n) in m.token_refusals.snapshot() {
            let uid = uid.map_or_else(|| "other".to_string(), |u| u.to_string());
            let labels = [("kind", kind.label().to_string()), ("uid", uid)];
            ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn encode_pools(stats: &PoolPart, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let rows = &stats.pools;
        let allocs = &stats.allocations;
        gauge(
            enc,
            "allocations",
            "Live allocations.",
            None,
            g64(allocs.active),
        )?;
        gauge(
            enc,
            "allocations",
            "Bytes of live allocations.",
            Some(&Unit::Bytes),
            g64(allocs.bytes),
        )?;
        let labels = |r: &PoolStats| -> PoolLabels {
            [
                ("node", r.node.to_string()),
                ("page_size", r.page_size.clone()),
                ("backing", r.backing.clone()),
            ]
        };
        let g = ConstGauge::new(0i64);
        {
            let mut family = enc.encode_descriptor(
                "pool",
                "Pooled and in-use bytes by node, page size, backing and state.",
                Some(&Unit::Bytes),
                g.metric_type(),
            )?;
            for r in rows {
                for (state, v) in [
                    ("clean", r.clean_bytes),
                    ("dirty", r.dirty_bytes),
                    ("quarantined", r.quarantined_bytes),
                    ("in_use", r.in_use_bytes),
                ] {
                    let [a, b, c] = labels(r);
                    let set = [a, b, c, ("state", state.to_string())];
                    ConstGauge::new(g64(v)).encode(family.encode_family(&set)?)?;
                }
            }
        }
        {
            let mut family = enc.encode_descriptor(
                "pool_regions",
                "Regions by node, page size, backing and state.",
                None,
                g.metric_type(),
            )?;
            for r in rows {
                for (state, v) in [
                    ("clean", r.regions.clean),
                    ("dirty", r.regions.dirty),
                    ("quarantined", r.regions.quarantined),
                    ("in_use", r.regions.in_use),
                ] {
                    let [a, b, c] = labels(r);
                    let set = [a, b, c, ("state", state.to_string())];
                    ConstGauge::new(g64(v)).encode(family.encode_family(&set)?)?;
                }
            }
        }
        for (name, help, pick) in [
            (
                "pool_withheld",
                "Quarantined bytes withheld: no process holds them, yet another open description of the file exists (part of state=\"quarantined\").",
                (|r: &PoolStats| r.withheld_bytes) as fn(&PoolStats) -> u64,
            ),
            (
                "pool_target",
                "Idle bytes the node's pool keeps (pool.target).",
                |r: &PoolStats| r.target_bytes,
            ),
            (
                "pool_limit",
                "Most pooled bytes of the node (pool.limit).",
                |r: &PoolStats| r.limit_bytes,
            ),
        ] {
            let mut family = enc.encode_descriptor(name, help, Some(&Unit::Bytes), g.metric_type())?;
            for r in rows {
                ConstGauge::new(g64(pick(r))).encode(family.encode_family(&labels(r))?)?;
            }
        }
        Ok(())
    }

    fn encode_scrub(
        &self,
        pending: &std::collections::HashMap<numa::NodeId, u64>,
        enc: &mut DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let scrub = &self.source.scrub;
        let c = ConstCounter::new(0u64);
        let node = |n: numa::NodeId| [("node", n.to_string())];
        {
            let mut f = enc.encode_descriptor(
                "scrub",
                "Bytes cleared by the pool's scrubbers.",
                Some(&Unit::Bytes),
                c.metric_type(),
            )?;
            for s in scrub {
                ConstCounter::new(Metrics::get(&s.bytes))
                    .encode(f.encode_family(&node(s.node))?)?;
            }
        }
        {
            let mut f = enc.encode_descriptor(
                "scrub",
                "Seconds spent clearing, summed over scrubber threads.",
                Some(&Unit::Seconds),
                c.metric_type(),
            )?;
            for s in scrub {
                let secs = Duration::from_nanos(Metrics::get(&s.nanos)).as_secs_f64();
                ConstCounter::new(secs).encode(f.encode_family(&node(s.node))?)?;
            }
        }
        {
            let mut f = enc.encode_descriptor(
                "scrub_batches",
                "Clearing kernel calls of the pool's scrubbers.",
                None,
                c.metric_type(),
            )?;
            for s in scrub {
                ConstCounter::new(Metrics::get(&s.batches))
                    .encode(f.encode_family(&node(s.node))?)?;
            }
        }
        {
            let mut f = enc.encode_descriptor(
                "refault",
                "Bytes of detached regions' holes faulted in ahead of their guests (kernel-zeroed).",
                Some(&Unit::Bytes),
                c.metric_type(),
            )?;
            for s in scrub {
                ConstCounter::new(Metrics::get(&s.refault_bytes))
                    .encode(f.encode_family(&node(s.node))?)?;
            }
        }
        {
            let mut f = enc.encode_descriptor(
                "refault",
                "Seconds spent faulting detached regions' holes in, summed over scrubber threads.",
                Some(&Unit::Seconds),
                c.metric_type(),
            )?;
            for s in scrub {
                let secs = Duration::from_nanos(Metrics::get(&s.refault_nanos)).as_secs_f64();
                ConstCounter::new(secs).encode(f.encode_family(&node(s.node))?)?;
            }
        }
        {
            let mut f = enc.encode_descriptor(
                "scrub_pending",
                "Dirty bytes waiting for a scrubber.",
                Some(&Unit::Bytes),
                ConstGauge::new(0i64).metric_type(),
            )?;
            for s in scrub {
                let v = pending.get(&s.node).copied().unwrap_or(0);
                ConstGauge::new(g64(v)).encode(f.encode_family(&node(s.node))?)?;
            }
        }
        Ok(())
    }

    /// Parked VMs: how many, and each one's memory by uid and name.
    fn encode_parked(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let parked = self.source.parked();
        gauge(
            enc,
            "parked_vms",
            "cloud-hypervisor VMs parked in the daemon (hugemem park).",
            None,
            g64(parked.len() as u64),
        )?;
        gauge(
            enc,
            "parked_lost_vms",
            "VMs that were parked when the daemon last stopped and that this start could not bring back, not yet acknowledged (hugemem unpark NAME).",
            None,
            g64(self.source.park_record.lost(None).len() as u64),
        )?;
        let mut family = enc.encode_descriptor(
            "parked",
            "Memory of each parked VM, by its tenant's uid, its name and its VMM (qemu or cloud-hypervisor).",
            Some(&Unit::Bytes),
            MetricType::Gauge,
        )?;
        for p in &parked {
            let labels = [
                ("uid", p.uid.to_string()),
                ("name", p.name.clone()),
                ("vmm", p.vmm.clone().unwrap_or_default()),
            ];
            ConstGauge::new(g64(p.bytes)).encode(family.encode_family(&labels)?)?;
        }
        let mut clones = enc.encode_descriptor(
            "parked_shared_clones",
            "Shared clones that map each parked VM (its template) now, by its tenant's uid and its name.",
            None,
            MetricType::Gauge,
        )?;
        for p in &parked {
            let labels = [("uid", p.uid.to_string()), ("name", p.name.clone())];
            ConstGauge::new(g64(p.shared_clones)).encode(clones.encode_family(&labels)?)?;
        }
        let mut filling = enc.encode_descriptor(
            "parked_copy_clones_filling",
            "Copy clones whose memory is still being filled from each parked VM (its template), by its tenant's uid and its name.",
            None,
            MetricType::Gauge,
        )?;
        for p in &parked {
            let labels = [("uid", p.uid.to_string()), ("name", p.name.clone())];
            ConstGauge::new(g64(p.copy_clones_filling)).encode(filling.encode_family(&labels)?)?;
        }
        let mut written = enc.encode_descriptor(
            "parked_shared_clone_written",
            "Huge pages the shared clones of each parked VM wrote (their own copies, from the kernel's free huge pages), by its tenant's uid and its name.",
            Some(&Unit::Bytes),
            MetricType::Gauge,
        )?;
        for p in parked {
            let labels = [("uid", p.uid.to_string()), ("name", p.name)];
            ConstGauge::new(g64(p.shared_clone_written_bytes))
                .encode(written.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn encode_faults(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sums = self.source.fault_totals.read();
        gauge(
            enc,
            "fault_services",
            "Lazy-mode fault services running now.",
            None,
            g64(sums.live),
        )?;
        let names = crate::fault::FaultStats::default().counters();
        for ((name, help, _), v) in names.iter().zip(sums.counters) {
            counter(
                enc,
                &format!("fault_{}", name.trim_start_matches("fault_")),
                &format!("{help} Summed over every fault service the daemon ran."),
                None,
                v,
            )?;
        }
        counter(
            enc,
            "fault_latency_samples",
            "Served faults with a read-to-wake latency sample.",
            None,
            sums.latency_count,
        )?;
        let c = ConstCounter::new(Duration::from_nanos(sums.latency_sum_ns).as_secs_f64());
        let m = enc.encode_descriptor(
            "fault_latency",
            "Read-to-wake latency of served faults, summed (divide by fault_latency_samples for the mean).",
            Some(&Unit::Seconds),
            c.metric_type(),
        )?;
        c.encode(m)
    }
}

impl Collector for DaemonCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = &self.source.metrics;
        gauge(
            &mut enc,
            "sessions",
            "Live client sessions.",
            None,
            g64(Metrics::get(&m.sessions_active)),
        )?;
        gauge(
            &mut enc,
            "sessions_active",
            "Live client sessions (STATS counters.sessions_active).",
            None,
            g64(Metrics::get(&m.sessions_active)),
        )?;
        for (name, help, v) in counters::daemon_counters(m) {
            counter(&mut enc, name, help, None, v)?;
        }
        Self::encode_token_refusals(m, &mut enc)?;
        let (sum, count, buckets) = m.alloc_latency.snapshot();
        let mut metric = enc.encode_descriptor(
            "alloc_duration",
            "Successful ALLOCs by how long the daemon took, request to reply (pooled hand-outs, fresh populates, waits for pages).",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        metric.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        gauge(
            &mut enc,
            "uptime",
            "Seconds since the daemon started.",
            Some(&Unit::Seconds),
            g64(self.source.started.elapsed().as_secs()),
        )?;
        // One look at the pool (one lock) per scrape.
        let (pool, pending) = self.source.pool.stats();
        Self::encode_pools(&pool, &mut enc)?;
        self.encode_parked(&mut enc)?;
        self.encode_scrub(&pending, &mut enc)?;
        self.encode_faults(&mut enc)
    }
}

/// The one page this server has.
fn respond(registry: &Registry, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let plain = |status: StatusCode, body: &'static str| {
        let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
        *r.status_mut() = status;
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        r
    };
    if req.uri().path() != "/metrics" && req.uri().path() != "/" {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
    }
    let mut r = Response::new(Full::new(Bytes::from(encode(registry))));
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(CONTENT_TYPE_OPENMETRICS),
    );
    r
}

/// Serves `GET /metrics` on `listener` until `cancel` fires.
pub async fn serve(listener: TcpListener, registry: Registry, cancel: CancellationToken) {
    let addr = listener.local_addr().ok();
    info!(?addr, "metrics endpoint listening");
    let registry = Arc::new(registry);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            break;
        };
        let (stream, peer) = tokio::select! {
            () = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    debug!(error = %e, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let registry = Arc::clone(&registry);
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let r = respond(&registry, &req);
                async move { Ok::<_, Infallible>(r) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                () = cancel.cancelled() => {}
                r = tokio::time::timeout(CONNECTION_TIMEOUT, conn) => match r {
                    Ok(Ok(())) => debug!(%peer, "metrics served"),
                    Ok(Err(e)) => debug!(%peer, error = %e, "metrics connection failed"),
                    Err(_) => debug!(%peer, "metrics connection timed out"),
                },
            }
        });
    }
}
