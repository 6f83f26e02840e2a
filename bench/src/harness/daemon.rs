//! A bench's private daemon in its own process: the configuration every
//! bench starts from.

use std::path::PathBuf;

use backend::daemon::{ByteSize, Config};

/// The defaults on `socket`, with a pool that keeps at least `holds`
/// freed bytes (its target and limit raised to it) and looks for other
/// holders every `recheck_ms`.
pub(crate) fn holding(socket: PathBuf, holds: u64, recheck_ms: u64) -> Config {
    let mut config = Config {
        socket,
        ..Config::default()
    };
    config.pool.target = config.pool.target.max(ByteSize(holds));
    config.pool.limit = config.pool.limit.max(ByteSize(holds));
    config.pool.recheck_ms = recheck_ms;
    config
}
