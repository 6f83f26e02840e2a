//! The daemon's side: it answers on the configured socket (HANDSHAKE and
//! STATS), as this process and as every tenant uid the configuration
//! allows, and the socket's group lets those tenants reach it.

use std::os::unix::net::UnixStream;
use std::time::Duration;

use hugemem_client::client::{Client, ClientError};

use super::accounts::{first_line, group_label, Account};
use super::inputs::CheckInputs;
use super::report::Item;

/// How long the daemon may take to answer HANDSHAKE and STATS.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// HANDSHAKE and STATS on the configured socket, as this process; then the
/// same as each tenant (`hugemem status` run as that uid), when it answered
/// this process at all.
pub fn answers(inputs: &CheckInputs, tenants: &[Account]) -> Vec<Item> {
    let socket = &inputs.config.socket;
    let own = match probe(socket) {
        Ok(summary) => Item::pass(
            "daemon",
            format!("answers on {}: {summary}", socket.display()),
        ),
        Err(why) => {
            let item = Item::fail(
                "daemon",
                format!("nothing answers on {}: {why}", socket.display()),
                "systemctl start hugemem (journalctl -u hugemem says why it stopped), or set socket in the configuration to where it listens",
            );
            return vec![item];
        }
    };
    let mut items = vec![own];
    for t in tenants {
        let name = format!("daemon-uid-{}", t.uid);
        if !inputs.is_root() {
            items.push(Item::skip(
                name,
                format!("a HANDSHAKE as {} needs root (setpriv)", t.label()),
                "run hugemem check as root",
            ));
            continue;
        }
        let socket_arg = socket.to_string_lossy();
        let Some(out) = t.run(&inputs.exe, &["status", "--json", "--socket", &socket_arg]) else {
            items.push(Item::skip(
                name,
                "setpriv (util-linux) cannot be run",
                "apt-get install util-linux",
            ));
            continue;
        };
        items.push(if out.status.success() {
            Item::pass(name, format!("{} gets HANDSHAKE and STATS on {}", t.label(), socket.display()))
        } else {
            Item::fail(
                name,
                format!("{} is turned away: {}", t.label(), first_line(&out)),
                format!(
                    "allowed_uids must list {} and socket_group must be a group it is in; every directory above {} must be traversable by it; restart the daemon after editing the configuration",
                    t.uid,
                    socket.display()
                ),
            )
        });
    }
    items
}

/// Why the daemon did not answer, for the FAIL line.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    /// The socket could not be opened (or given its timeout).
    #[error("{0}")]
    Socket(#[from] std::io::Error),
    /// HANDSHAKE failed.
    #[error("HANDSHAKE: {0}")]
    Handshake(#[source] ClientError),
    /// STATS failed.
    #[error("STATS: {0}")]
    Stats(#[source] ClientError),
}

/// `pid P, version V, up S s, N sessions`, or why not.
fn probe(socket: &std::path::Path) -> Result<String, ProbeError> {
    let stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let mut client = Client::from_stream(stream).map_err(ProbeError::Handshake)?;
    let stats = client.stats().map_err(ProbeError::Stats)?;
    Ok(format!(
        "hugemem {} pid {}, up {:.0} s, {} active session(s), {} allocation(s)",
        stats.version, stats.pid, stats.uptime_s, stats.sessions.active, stats.allocations.active
    ))
}

/// The configuration lets its non-root tenants reach the socket at all:
/// with `allowed_uids` non-empty, `socket_group` must be set and each of
/// them in it (the socket is 0600 root otherwise).
pub fn socket_access(inputs: &CheckInputs, tenants: &[Account]) -> Item {
    let cfg = &inputs.config;
    if tenants.is_empty() {
        return Item::pass(
            "socket-access",
            "no non-root tenants configured: socket 0600, root only",
        );
    }
    let Some(gid) = cfg.socket_group else {
        return Item::fail(
            "socket-access",
            format!(
                "socket_group is unset: the socket is root 0600 and {} cannot open it",
                tenants.iter().map(Account::label).collect::<Vec<_>>().join(", ")
            ),
            "set socket_group to a group the tenants are in (e.g. the libvirt-qemu group) and restart the daemon",
        );
    };
    let outside: Vec<String> = tenants
        .iter()
        .filter(|t| !t.in_group(gid))
        .map(Account::label)
        .collect();
    if outside.is_empty() {
        Item::pass(
            "socket-access",
            format!(
                "socket_group {}: every tenant is a member",
                group_label(gid)
            ),
        )
    } else {
        Item::fail(
            "socket-access",
            format!(
                "{} not in socket_group {}: the socket (0660) is closed to them",
                outside.join(", "),
                group_label(gid)
            ),
            format!(
                "usermod -aG {} USER, or set socket_group to their group",
                group_label(gid)
            ),
        )
    }
}
