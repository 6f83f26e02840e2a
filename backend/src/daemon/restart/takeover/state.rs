//! The versioned state document a daemon hands its successor, and the
//! sealed memfd it travels in.
//!
//! The document says what each fd that travels with it is (by its index in
//! the fd list): the listening socket, every region the pool owns and its
//! page states, every allocation and the connection that owns it, each
//! connection's half-read frame, each lazy allocation's userfaultfd and
//! mappings. It is JSON (`serde_json`): small, versioned by `version`, and
//! readable by an operator with `jq` when a takeover is refused.
//!
//! **Trust.** The successor checks that the memfd is one a daemon of its
//! own uid wrote and can no longer change: its owner is the successor's
//! euid and it carries every write seal (`F_SEAL_WRITE`, `F_SEAL_SHRINK`,
//! `F_SEAL_GROW`, `F_SEAL_SEAL`). A document of another `format` or a
//! `version` this build does not know is refused as a whole with a message
//! naming both versions: nothing in it is served unverified, and each
//! region's fd is still checked against what the document says
//! (`guest_mem::Region::adopt`).

use std::collections::BTreeMap;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, OwnedFd};

use serde::{Deserialize, Serialize};

pub use crate::daemon::lifecycle::suspended::LazyRecord;
pub use crate::daemon::lifecycle::ConnectionRecord;
pub use crate::daemon::persist::encoding::{decode_pages, encode_pages, hex, unhex};
pub use crate::daemon::pool::{AllocRecord, RegionRecord, SavedLife};
pub use crate::daemon::requests::parked::loads_record::LoadRecord;
use crate::sys;

/// `format` of a hugemem state document. Its old name stays: documents
/// of version 1 carry it (a predecessor's, systemd's fd store's).
pub const FORMAT: &str = "hugemem-handover";
/// The one version this build writes and reads.
pub const VERSION: u32 = 1;
/// Largest document read (a host with 64 Ki regions of 1 GiB pages fits
/// easily): a bound, so a bad memfd cannot make the successor allocate
/// without limit.
const MAX_BYTES: u64 = 256 << 20;

/// The state document.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`] of the writer.
    pub version: u32,
    /// The writer's package version (for the log).
    pub daemon_version: String,
    /// The writer's pid.
    pub pid: u32,
    /// Sequence number of the document (systemd's fd store keeps two; the
    /// higher one is the newer).
    pub seq: u64,
    /// Written with the daemon frozen (a takeover, a clean stop): the page
    /// states of pooled regions are exact. A document written while the
    /// daemon served (kept in systemd's fd store against a crash) may be
    /// older than the last hand-out, so its pooled regions go through
    /// quarantine before reuse.
    pub last: bool,
    /// Index of the listening socket in the fd list.
    pub listener: Option<usize>,
    /// Index of the metrics endpoint's listening socket.
    pub metrics: Option<usize>,
    /// The socket file was created by the daemon (not systemd's): the
    /// successor removes it when it stops.
    pub socket_owned: bool,
    /// Next region, allocation and session ids.
    pub next_region: u64,
    /// See `next_region`.
    pub next_alloc: u64,
    /// See `next_region`.
    pub next_session: u64,
    /// Every region the pool owned.
    pub regions: Vec<RegionRecord>,
    /// Every allocation.
    pub allocations: Vec<AllocRecord>,
    /// Every live client connection.
    pub connections: Vec<ConnectionRecord>,
    /// The files of every VM parked on demand, still to be read (absent in
    /// a predecessor's document that did not carry them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fills: Vec<LoadRecord>,
    /// The parked VMs (allocations) that shared clones may still map
    /// without a connection counting them (`requests::parked::clones`:
    /// the marks; left out when there are none, as in a document of an
    /// earlier version).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clone_templates: Vec<u64>,
    /// The daemon's counters (STATS `counters`), so totals stay balanced.
    pub counters: BTreeMap<String, u64>,
}

/// Why a state document was refused.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Not a memfd this daemon's uid sealed.
    #[error("the state memfd cannot be trusted: {0}")]
    Untrusted(String),
    /// Another format or a version this build does not read.
    #[error("state document {format:?} version {version}: this daemon reads {FORMAT:?} version {VERSION} only; refusing the takeover (nothing was served from it)")]
    Version {
        /// Its format.
        format: String,
        /// Its version.
        version: u32,
    },
    /// Malformed.
    #[error("the state document is malformed: {0}")]
    Malformed(String),
    /// Reading or writing the memfd failed.
    #[error("state memfd: {0}")]
    Io(#[from] std::io::Error),
}

impl State {
    /// Writes the document into a new memfd and seals it against any change.
    ///
    /// # Errors
    ///
    /// memfd creation, write or sealing.
    pub fn to_memfd(&self) -> Result<OwnedFd, StateError> {
        let json = serde_json::to_vec(self).map_err(|e| StateError::Malformed(e.to_string()))?;
        let fd = sys::sealable_memfd(c"hugemem-state")?;
        let mut f = std::fs::File::from(fd);
        f.write_all(&json)?;
        f.flush()?;
        let fd = OwnedFd::from(f);
        sys::seal_all(fd.as_fd())?;
        Ok(fd)
    }

    /// Reads a document from a memfd a predecessor wrote, after checking
    /// that it can be trusted (see the module docs), and checks its format
    /// and version.
    ///
    /// # Errors
    ///
    /// [`StateError`].
    pub fn from_memfd(fd: OwnedFd) -> Result<Self, StateError> {
        let (owner, size) = sys::owner_and_size(fd.as_fd())?;
        if owner != sys::euid() {
            return Err(StateError::Untrusted(format!(
                "owned by uid {owner}, this daemon runs as {}",
                sys::euid()
            )));
        }
        let seals = sys::seals(fd.as_fd())?;
        let want = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if seals & want != want {
            return Err(StateError::Untrusted(format!(
                "seals {seals:#x}, a state memfd has {want:#x}"
            )));
        }
        if size > MAX_BYTES {
            return Err(StateError::Untrusted(format!("{size} bytes")));
        }
        let mut f = std::fs::File::from(fd);
        f.rewind()?;
        let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
        f.take(MAX_BYTES).read_to_end(&mut bytes)?;
        // Format and version first, so a newer document is refused as such
        // rather than as malformed.
        #[derive(Deserialize)]
        struct Head {
            format: String,
            version: u32,
        }
        let head: Head =
            serde_json::from_slice(&bytes).map_err(|e| StateError::Malformed(e.to_string()))?;
        if head.format != FORMAT || head.version != VERSION {
            return Err(StateError::Version {
                format: head.format,
                version: head.version,
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| StateError::Malformed(e.to_string()))
    }

    /// Checks that every fd index is in the list and used once, so a
    /// region can never be handed two roles.
    ///
    /// # Errors
    ///
    /// [`StateError::Malformed`].
    pub fn check_fds(&self, fds: usize) -> Result<(), StateError> {
        let mut used = vec![false; fds];
        let mut take = |i: usize, what: &str| -> Result<(), StateError> {
            match used.get_mut(i) {
                Some(u) if !*u => {
                    *u = true;
                    Ok(())
                }
                Some(_) => Err(StateError::Malformed(format!("fd {i} ({what}) used twice"))),
                None => Err(StateError::Malformed(format!(
                    "fd {i} ({what}) is not among the {fds} fds received"
                ))),
            }
        };
        if let Some(l) = self.listener {
            take(l, "listener")?;
        }
        if let Some(l) = self.metrics {
            take(l, "metrics listener")?;
        }
        for r in &self.regions {
            take(r.fd, "region")?;
        }
        for c in &self.connections {
            take(c.fd, "connection")?;
            for f in &c.partial_fds {
                take(*f, "frame fd")?;
            }
            for l in &c.lazy {
                if let Some(u) = l.uffd {
                    take(u, "userfaultfd")?;
                }
            }
        }
        for f in &self.fills {
            for i in &f.files {
                take(*i, "a parked VM's file")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> State {
        State {
            format: FORMAT.into(),
            version: VERSION,
            daemon_version: "test".into(),
            pid: 1,
            seq: 1,
            last: true,
            listener: Some(0),
            metrics: None,
            socket_owned: true,
            next_region: 2,
            next_alloc: 1,
            next_session: 1,
            regions: vec![RegionRecord {
                id: 1,
                fd: 1,
                name: "r".into(),
                len: 4096,
                page_size: 4096,
                node: 0,
                bound: true,
                path: None,
                life: SavedLife::Clean,
                alloc: None,
                tenant: None,
                split: false,
                fill: false,
                pages: "3".into(),
            }],
            allocations: Vec::new(),
            connections: Vec::new(),
            fills: Vec::new(),
            clone_templates: Vec::new(),
            counters: BTreeMap::new(),
        }
    }

    #[test]
    fn a_sealed_document_reads_back() {
        let fd = doc().to_memfd().expect("write");
        let back = State::from_memfd(fd).expect("read");
        assert_eq!(back.regions[0].pages, "3");
        back.check_fds(2).expect("fds");
        assert!(back.check_fds(1).is_err());
    }

    #[test]
    fn a_newer_version_is_refused_by_name() {
        let mut d = doc();
        d.version = VERSION + 1;
        let fd = d.to_memfd().expect("write");
        let e = State::from_memfd(fd).expect_err("refused");
        assert!(matches!(e, StateError::Version { version, .. } if version == VERSION + 1));
        assert!(e.to_string().contains("refusing the takeover"), "{e}");
    }

    #[test]
    fn an_unsealed_memfd_is_refused() {
        let fd = sys::sealable_memfd(c"hugemem-state").expect("memfd");
        let mut f = std::fs::File::from(fd);
        f.write_all(&serde_json::to_vec(&doc()).expect("json"))
            .expect("write");
        let e = State::from_memfd(OwnedFd::from(f)).expect_err("refused");
        assert!(matches!(e, StateError::Untrusted(_)), "{e}");
    }

    #[test]
    fn page_states_and_hex_round_trip() {
        use guest_mem::PageState;
        let s = [PageState::Clean, PageState::Dirty, PageState::Mapped];
        assert_eq!(decode_pages(&encode_pages(&s)).expect("pages"), s);
        assert!(decode_pages("9").is_err());
        assert_eq!(unhex(&hex(&[0, 255, 16])).expect("hex"), vec![0, 255, 16]);
        assert!(unhex("abc").is_err());
    }

    #[test]
    fn version_1_documents_read_and_write_the_same_json() {
        // As a daemon before the typed records wrote it: the page life as
        // a string, a lazy allocation's region table and mappings as arrays.
        let v1 = serde_json::json!({
            "format": FORMAT, "version": 1, "daemon_version": "0", "pid": 1, "seq": 0,
            "last": true, "listener": null, "metrics": null, "socket_owned": false,
            "next_region": 2, "next_alloc": 2, "next_session": 2,
            "regions": [{
                "id": 1, "fd": 0, "name": "r", "len": 4096, "page_size": 4096, "node": 0,
                "bound": true, "path": null, "life": "in_use", "alloc": 1, "tenant": 7,
                "split": false, "fill": false, "pages": "3"
            }],
            "allocations": [{
                "id": 1, "session": 1, "regions": [1], "locked": false, "tenant": 7,
                "token": "00", "lazy": true, "lazy_fallback": false
            }],
            "connections": [{
                "session": 1, "fd": 1, "handshaken": true, "features": 0, "partial": "",
                "partial_fds": [], "lazy": [{
                    "alloc": 1, "infos": [[1, 0, 4096, 4096, 0, 2]],
                    "ranges": [[1, 0, 65536, 4096]], "uffd": 2
                }]
            }],
            "counters": {}
        });
        let doc: State = serde_json::from_value(v1.clone()).expect("a version 1 document");
        assert_eq!(doc.regions[0].life, SavedLife::InUse);
        let lazy = &doc.connections[0].lazy[0];
        assert_eq!(lazy.infos[0].flags, 2);
        assert_eq!(lazy.ranges[0].vmm_addr, 65536);
        assert_eq!(serde_json::to_value(&doc).expect("json"), v1);
        doc.check_fds(3).expect("fds");
    }
}
