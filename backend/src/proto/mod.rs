//! The wire protocol is `hugemem_client::proto` (framing, messages, fd
//! passing; `docs/protocol.md`); the daemon adds its async framing on tokio.

pub use hugemem_client::proto::*;

pub mod async_io;
