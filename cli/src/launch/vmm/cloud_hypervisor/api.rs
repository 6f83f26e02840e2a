//! A blocking client of cloud-hypervisor's REST API on its `--api-socket`
//! (HTTP/1.1 over a UNIX socket), for the requests an update needs:
//! `vmm.ping`, `vm.info`, `vm.receive-migration`, `vm.send-migration`,
//! `vm.resume` and `vmm.shutdown`.
//!
//! One request per connection, `Connection: close`: cloud-hypervisor's
//! HTTP server (micro-http) answers each request on the connection it came
//! on, and a fresh connection per request keeps a half-read answer from
//! ever being taken for the next one. The response is parsed with
//! `httparse`; the body is read to its `Content-Length` (micro-http always
//! sends one), at most [`MAX_BODY`] bytes.
//!
//! `vm.receive-migration` answers only once the migration is received (its
//! handler runs the whole receive on cloud-hypervisor's VMM thread), so the
//! caller gives it a timeout of its own; `vm.send-migration` answers once
//! the migration worker started.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The largest response body read (`vm.info` of a large VM is a few KiB).
pub const MAX_BODY: usize = 1 << 20;
/// Headers a response may have.
const MAX_HEADERS: usize = 32;

/// Errors of an API request.
#[derive(Debug, thiserror::Error)]
pub enum ChApiError {
    /// Connecting, writing or reading failed (the socket is not there yet,
    /// the process exited, a timeout).
    #[error("cloud-hypervisor API {socket}: {what}: {source}")]
    Io {
        /// The API socket.
        socket: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The response was not HTTP as expected.
    #[error("cloud-hypervisor API {socket}: malformed response to {endpoint}: {what}")]
    Malformed {
        /// The API socket.
        socket: PathBuf,
        /// The request's endpoint.
        endpoint: String,
        /// What was wrong.
        what: String,
    },
    /// cloud-hypervisor refused or failed the request.
    #[error("cloud-hypervisor refused {endpoint} (HTTP {status}): {body}")]
    Refused {
        /// The request's endpoint.
        endpoint: String,
        /// The HTTP status.
        status: u16,
        /// Its error text (cloud-hypervisor's error chain, as JSON or text).
        body: String,
    },
    /// A newer cloud-hypervisor refused the `local` field of
    /// `vm.send-migration`: the message names the protocol hugemem speaks
    /// and the option the newer release expects.
    #[error("cloud-hypervisor refused vm.send-migration: {0}")]
    NewerProtocol(#[from] ch_migration::version::LocalOptionRefused),
}

/// One cloud-hypervisor process's API socket.
#[derive(Debug, Clone)]
pub struct ChApi {
    socket: PathBuf,
}

impl ChApi {
    /// The API on `socket` (cloud-hypervisor's `--api-socket path=…`).
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_owned(),
        }
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `GET /api/v1/vmm.ping`: answers once the VMM's API thread serves.
    ///
    /// # Errors
    ///
    /// [`ChApiError`].
    pub fn ping(&self, timeout: Duration) -> Result<(), ChApiError> {
        self.request("GET", "vmm.ping", None, timeout).map(drop)
    }

    /// `GET /api/v1/vm.info`: the VM's configuration and state.
    ///
    /// # Errors
    ///
    /// [`ChApiError`]; a body that is not JSON is [`ChApiError::Malformed`].
    pub fn vm_info(&self, timeout: Duration) -> Result<serde_json::Value, ChApiError> {
        let body = self.request("GET", "vm.info", None, timeout)?;
        serde_json::from_slice(&body).map_err(|e| self.malformed("vm.info", e.to_string()))
    }

    /// The VM's state as `vm.info` reports it (`Created`, `Running`,
    /// `Paused`, `Shutdown`).
    ///
    /// # Errors
    ///
    /// [`ChApiError`].
    pub fn vm_state(&self, timeout: Duration) -> Result<String, ChApiError> {
        let info = self.vm_info(timeout)?;
        info.get("state")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| self.malformed("vm.info", "no \"state\"".into()))
    }

    /// `PUT /api/v1/vm.receive-migration` from `unix:<listen>`: returns once
    /// the migration is received and the VM runs here (or failed).
    ///
    /// # Errors
    ///
    /// [`ChApiError`].
    pub fn receive_migration(&self, listen: &Path, timeout: Duration) -> Result<(), ChApiError> {
        let body = serde_json::json!({ "receiver_url": format!("unix:{}", listen.display()) });
        self.request(
            "PUT",
            "vm.receive-migration",
            Some(&body.to_string()),
            timeout,
        )
        .map(drop)
    }

    /// `PUT /api/v1/vm.send-migration` to `unix:<to>`; `local`: pass the
    /// guest memory's fds instead of copying it. Returns once the migration
    /// worker started (the receiving side's `vm.receive-migration` says
    /// when it is done).
    ///
    /// # Errors
    ///
    /// [`ChApiError`].
    pub fn send_migration(
        &self,
        to: &Path,
        local: bool,
        timeout: Duration,
    ) -> Result<(), ChApiError> {
        let body = serde_json::json!({
            "destination_url": format!("unix:{}", to.display()),
            "local": local,
        });
        let sent = self.request("PUT", "vm.send-migration", Some(&body.to_string()), timeout);
        if let (true, Err(ChApiError::Refused { body, .. })) = (local, &sent) {
            // A newer cloud-hypervisor that dropped `local`: say which
            // protocol hugemem speaks and what the newer one expects.
            if let Some(refused) = ch_migration::version::local_option_refused(body) {
                return Err(refused.into());
            }
        }
        sent.map(drop)
    }

    /// `PUT /api/v1/<endpoint>` with `body` (JSON), for the endpoints
    /// without a method here (`vm.pause`, `vm.snapshot`, a
    /// `vm.receive-migration` with a `memory_mode`); the answer's body.
    ///
    /// # Errors
    ///
    /// [`ChApiError`].
    pub fn put(
        &self,
        endpoint: &str,
        body: Option<&serde_json::Value>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ChApiError> {
        let body = body.map(serde_json::Value::to_string);
        self.request("PUT", endpoint, body.as_deref(), timeout)
    }

    /// `PUT /api/v1/vm.resume`.
    ///
    /// # Errors
    ///
    /// [`ChApiError`].
    pub fn resume(&self, timeout: Duration) -> Result<(), ChApiError> {
        self.request("PUT", "vm.resume", None, timeout).map(drop)
    }

    /// `PUT /api/v1/vmm.shutdown`: the VMM process exits.
    ///
    /// # Errors
    ///
    /// [`ChApiError`].
    pub fn shutdown_vmm(&self, timeout: Duration) -> Result<(), ChApiError> {
        self.request("PUT", "vmm.shutdown", None, timeout).map(drop)
    }

    fn malformed(&self, endpoint: &str, what: String) -> ChApiError {
        ChApiError::Malformed {
            socket: self.socket.clone(),
            endpoint: endpoint.to_owned(),
            what,
        }
    }

    /// One request; the response body of a 2xx answer.
    fn request(
        &self,
        method: &str,
        endpoint: &str,
        body: Option<&str>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ChApiError> {
        let io = |what| {
            let socket = self.socket.clone();
            move |source| ChApiError::Io {
                socket,
                what,
                source,
            }
        };
        let mut stream = UnixStream::connect(&self.socket).map_err(io("connect"))?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(io("set a timeout"))?;
        let body = body.unwrap_or("");
        let mut request = format!(
            "{method} /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\nConnection: close\r\n"
        );
        if !body.is_empty() {
            request.push_str("Content-Type: application/json\r\n");
        }
        request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
        stream
            .write_all(request.as_bytes())
            .map_err(io("send the request"))?;
        let (status, response_body) = self.read_response(&mut stream, endpoint)?;
        if !(200..300).contains(&status) {
            return Err(ChApiError::Refused {
                endpoint: endpoint.to_owned(),
                status,
                body: String::from_utf8_lossy(&response_body).trim().to_owned(),
            });
        }
        Ok(response_body)
    }

    /// Reads one response: its status and body.
    fn read_response(
        &self,
        stream: &mut UnixStream,
        endpoint: &str,
    ) -> Result<(u16, Vec<u8>), ChApiError> {
        let mut buf = Vec::with_capacity(1024);
        let mut chunk = [0u8; 4096];
        loop {
            let n = stream.read(&mut chunk).map_err(|source| ChApiError::Io {
                socket: self.socket.clone(),
                what: "read the response",
                source,
            })?;
            if n == 0 {
                return Err(self.malformed(endpoint, "the connection closed mid-response".into()));
            }
            buf.extend_from_slice(&chunk[..n]);
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut headers);
            let parsed = response
                .parse(&buf)
                .map_err(|e| self.malformed(endpoint, e.to_string()))?;
            let httparse::Status::Complete(head) = parsed else {
                if buf.len() > MAX_BODY {
                    return Err(self.malformed(endpoint, "headers too long".into()));
                }
                continue;
            };
            let status = response
                .code
                .ok_or_else(|| self.malformed(endpoint, "no status".into()))?;
            let length = content_length(response.headers)
                .map_err(|e| self.malformed(endpoint, e.to_string()))?;
            if length > MAX_BODY {
                return Err(self.malformed(endpoint, format!("a body of {length} bytes")));
            }
            let mut body = buf.split_off(head);
            while body.len() < length {
                let n = stream.read(&mut chunk).map_err(|source| ChApiError::Io {
                    socket: self.socket.clone(),
                    what: "read the response body",
                    source,
                })?;
                if n == 0 {
                    return Err(self.malformed(endpoint, "the connection closed mid-body".into()));
                }
                body.extend_from_slice(&chunk[..n]);
            }
            body.truncate(length);
            return Ok((status, body));
        }
    }
}

/// The `Content-Length` of a response (0 without one: micro-http sends one
/// whenever there is a body).
fn content_length(headers: &[httparse::Header<'_>]) -> Result<usize, BadContentLength> {
    match headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
    {
        None => Ok(0),
        Some(h) => std::str::from_utf8(h.value)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| BadContentLength(String::from_utf8_lossy(h.value).into_owned())),
    }
}

/// A `Content-Length` header that is not a number.
#[derive(Debug, thiserror::Error)]
#[error("a Content-Length of {0:?}")]
struct BadContentLength(String);

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    use super::*;

    /// A one-request API on a fresh socket that answers `status` and `body`.
    fn answering(
        status: u16,
        body: &'static str,
    ) -> (tempfile::TempDir, std::thread::JoinHandle<()>) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let listener = UnixListener::bind(dir.path().join("api")).expect("bind");
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut request = [0u8; 4096];
            let _ = conn.read(&mut request);
            let reply = format!(
                "HTTP/1.1 {status} Bad Request\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            conn.write_all(reply.as_bytes()).expect("answer");
        });
        (dir, server)
    }

    #[test]
    fn a_newer_cloud_hypervisor_refusing_local_names_both_protocols() {
        let (dir, server) = answering(
            400,
            "Error parsing JSON: unknown field `local`, expected `destination_url`",
        );
        let api = ChApi::new(&dir.path().join("api"));
        let err = api
            .send_migration(Path::new("/nonexistent"), true, Duration::from_secs(10))
            .expect_err("refused");
        server.join().expect("the fake API");
        assert!(matches!(err, ChApiError::NewerProtocol(_)), "{err:?}");
        let text = err.to_string();
        for piece in [
            ch_migration::version::CLOUD_HYPERVISOR_RELEASE,
            "memory_mode=memfds",
            "unknown field `local`",
        ] {
            assert!(text.contains(piece), "{piece:?} missing from: {text}");
        }
    }

    #[test]
    fn any_other_refusal_stays_a_refusal() {
        let (dir, server) = answering(500, "the VM is not running");
        let api = ChApi::new(&dir.path().join("api"));
        let err = api
            .send_migration(Path::new("/nonexistent"), true, Duration::from_secs(10))
            .expect_err("refused");
        server.join().expect("the fake API");
        assert!(
            matches!(&err, ChApiError::Refused { status: 500, body, .. } if body == "the VM is not running"),
            "{err:?}"
        );
    }
}
