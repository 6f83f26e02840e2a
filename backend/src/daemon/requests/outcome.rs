//! What serving one request produced: the reply, the fds that go with it,
//! the allocation it hands out, and whether the connection closes after it.

use crate::daemon::pool::AllocId;
use crate::proto::messages::Reply;
use crate::proto::Status;

/// What handling a request produced.
#[derive(Debug)]
pub struct Outcome {
    /// The reply.
    pub reply: Reply,
    /// The fds that go with the reply, in order: one new open file
    /// description per region for this tenant ([`crate::sys::reopen`]),
    /// never the daemon's own (see `docs/security.md`, hostile tenants).
    pub fds: Vec<std::os::fd::OwnedFd>,
    /// The allocation the reply hands out (released again if it cannot be sent).
    pub alloc: Option<AllocId>,
    /// Close the connection once the reply is sent (too many refused
    /// REATTACH).
    pub close: bool,
}

impl Outcome {
    /// A reply without fds.
    pub fn reply(reply: Reply) -> Self {
        Self {
            reply,
            fds: Vec::new(),
            alloc: None,
            close: false,
        }
    }

    /// An error reply.
    pub fn error(status: Status, message: impl Into<String>) -> Self {
        Self::reply(Reply::error(status, message))
    }
}
