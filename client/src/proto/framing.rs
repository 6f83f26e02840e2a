//! Frame reassembly without I/O: the one place that turns the bytes a peer
//! sends into frames, whatever the reads split them into.
//!
//! Both readers run it — the blocking one ([`super::socket::recv_message`])
//! and the daemon's tokio one (`backend::proto::async_io::read_frame`) — and
//! so does the fuzzer (`fuzz/`, target `frames`), which feeds it hostile
//! bytes in arbitrary pieces. A reader asks [`FrameReader::next_read`] where
//! the next `recvmsg` goes (the rest of the header, then the rest of the
//! payload; never past the frame, so a second frame's bytes stay in the
//! socket), and tells [`FrameReader::advance`] how many bytes came (0 at EOF).
//! The header is checked ([`Header::decode`]: version, code, flags, payload ≤
//! [`super::header::MAX_PAYLOAD`]) before a single payload byte is allocated; EOF
//! between frames is [`ProtoError::Closed`], inside one
//! [`ProtoError::UnexpectedEof`]. Fds received on the way are kept with the
//! frame (the reader appends them to the `Vec` that [`FrameReader::next_read`]
//! hands out).

use std::os::fd::OwnedFd;

use super::header::Header;
use super::header::ProtoError;
use super::header::HEADER_SIZE;

/// One message as it travelled: header, payload and the fds that came with it.
#[derive(Debug)]
pub struct Frame {
    /// Checked header.
    pub header: Header,
    /// Payload bytes (`header.size` of them).
    pub payload: Vec<u8>,
    /// Descriptors received with the frame.
    pub fds: Vec<OwnedFd>,
}

/// Reassembles one frame from reads of any size (see the module docs).
#[derive(Debug, Default)]
pub struct FrameReader {
    head: [u8; HEADER_SIZE],
    /// Bytes of the header (before it is decoded) or of the payload (after).
    got: usize,
    header: Option<Header>,
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl FrameReader {
    /// A reader waiting for a frame's first byte.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where the next read goes (never empty: the rest of the header, then
    /// the rest of the payload), and where fds received with it go.
    pub fn next_read(&mut self) -> (&mut [u8], &mut Vec<OwnedFd>) {
        match self.header {
            None => (&mut self.head[self.got..], &mut self.fds),
            Some(_) => (&mut self.payload[self.got..], &mut self.fds),
        }
    }

    /// True before the first byte of a frame arrived.
    pub fn is_idle(&self) -> bool {
        self.header.is_none() && self.got == 0
    }

    /// Records that the last read put `n` bytes at the start of
    /// [`FrameReader::next_read`]'s buffer (`n == 0`: the peer closed).
    /// Returns the frame once it is complete; the reader is then ready for
    /// the next one.
    ///
    /// # Errors
    ///
    /// [`ProtoError::Closed`] at EOF before the first byte,
    /// [`ProtoError::UnexpectedEof`] at EOF inside the frame, the header's
    /// errors ([`ProtoError::BadVersion`], [`ProtoError::UnknownCode`],
    /// [`ProtoError::BadFlags`], [`ProtoError::PayloadTooLarge`]), and
    /// [`ProtoError::OutOfBounds`] when `n` is more than was asked for. After
    /// an error the stream is out of step: drop the reader.
    pub fn advance(&mut self, n: usize) -> Result<Option<Frame>, ProtoError> {
        let room = self.next_read().0.len();
        if n > room {
            return Err(ProtoError::OutOfBounds(format!(
                "a read reported {n} bytes into a {room}-byte buffer"
            )));
        }
        if n == 0 {
            return Err(if self.is_idle() {
                ProtoError::Closed
            } else {
                ProtoError::UnexpectedEof
            });
        }
        self.got += n;
        if self.header.is_none() {
            if self.got < HEADER_SIZE {
                return Ok(None);
            }
            let header = Header::decode(&self.head)?;
            // The size was bounded by `decode`, so this allocation is at most
            // MAX_PAYLOAD.
            self.payload = vec![0u8; header.size as usize];
            self.header = Some(header);
            self.got = 0;
        }
        Ok(self.take_if_complete())
    }

    /// Copies as much of `bytes` as the frame still needs and advances by
    /// it: for byte sources that are not sockets (tests, the fuzzer).
    /// Returns how many bytes were used, and what [`FrameReader::advance`]
    /// said (an empty `bytes` is EOF).
    pub fn feed(&mut self, bytes: &[u8]) -> (usize, Result<Option<Frame>, ProtoError>) {
        let (buf, _) = self.next_read();
        let n = buf.len().min(bytes.len());
        buf[..n].copy_from_slice(&bytes[..n]);
        (n, self.advance(n))
    }

    /// The bytes and fds of a frame begun but not complete (empty when
    /// idle), taken out: for a daemon handing the connection to its
    /// successor, which goes on with [`FrameReader::resume`]. The reader is
    /// idle afterwards.
    pub fn take_partial(&mut self) -> (Vec<u8>, Vec<OwnedFd>) {
        let mut bytes = Vec::new();
        match self.header {
            None => bytes.extend_from_slice(&self.head[..self.got]),
            Some(_) => {
                bytes.extend_from_slice(&self.head);
                bytes.extend_from_slice(&self.payload[..self.got]);
            }
        }
        let fds = std::mem::take(&mut self.fds);
        *self = Self::default();
        (bytes, fds)
    }

    /// A reader that goes on from [`FrameReader::take_partial`]'s bytes and
    /// fds (they are checked as if they had just arrived).
    ///
    /// # Errors
    ///
    /// The header's errors; [`ProtoError::OutOfBounds`] when the bytes are
    /// a whole frame or more (a partial frame never is).
    pub fn resume(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<Self, ProtoError> {
        let mut reader = Self::new();
        reader.fds = fds;
        let mut rest = bytes;
        while !rest.is_empty() {
            let (n, r) = reader.feed(rest);
            if r?.is_some() || n == 0 {
                return Err(ProtoError::OutOfBounds(
                    "a partial frame held a whole frame".into(),
                ));
            }
            rest = &rest[n..];
        }
        Ok(reader)
    }

    fn take_if_complete(&mut self) -> Option<Frame> {
        let header = self.header?;
        if self.got < self.payload.len() {
            return None;
        }
        self.header = None;
        self.got = 0;
        Some(Frame {
            header,
            payload: std::mem::take(&mut self.payload),
            fds: std::mem::take(&mut self.fds),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Code, Request};

    fn bytes_of(req: &Request, id: u32) -> Vec<u8> {
        let payload = req.encode();
        let mut b = Header::request(req.code(), id, payload.len())
            .expect("header")
            .encode()
            .to_vec();
        b.extend_from_slice(&payload);
        b
    }

    #[test]
    fn frames_come_out_whole_however_the_bytes_are_split() {
        let reqs = [
            Request::Free { alloc_id: 4 },
            Request::Stats,
            Request::Lock {
                alloc_id: 9,
                chunk: 1 << 20,
            },
        ];
        let mut stream = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            stream.extend(bytes_of(r, i as u32));
        }
        for piece in [1, 2, 3, 7, 16, 17, 1000] {
            let mut reader = FrameReader::new();
            let mut got = Vec::new();
            let mut rest = &stream[..];
            while !rest.is_empty() {
                let (used, r) = reader.feed(&rest[..piece.min(rest.len())]);
                rest = &rest[used..];
                if let Some(f) = r.expect("valid bytes") {
                    got.push(Request::decode(f.header.code, &f.payload).expect("decode"));
                }
            }
            assert_eq!(got, reqs, "pieces of {piece}");
            assert!(reader.is_idle());
            assert!(matches!(reader.feed(&[]).1, Err(ProtoError::Closed)));
        }
    }

    #[test]
    fn a_partial_frame_is_taken_out_and_resumed_at_every_split() {
        let bytes = bytes_of(
            &Request::Lock {
                alloc_id: 3,
                chunk: 7,
            },
            5,
        );
        for cut in 0..bytes.len() {
            let mut reader = FrameReader::new();
            let mut head = &bytes[..cut];
            while !head.is_empty() {
                let (n, r) = reader.feed(head);
                assert!(matches!(r, Ok(None)));
                head = &head[n..];
            }
            let (partial, fds) = reader.take_partial();
            assert_eq!(partial, bytes[..cut], "cut at {cut}");
            assert!(reader.is_idle());
            let mut resumed = FrameReader::resume(&partial, fds).expect("resume");
            let mut rest = &bytes[cut..];
            let frame = loop {
                let (n, r) = resumed.feed(rest);
                rest = &rest[n..];
                if let Some(f) = r.expect("valid") {
                    break f;
                }
            };
            assert_eq!(
                Request::decode(frame.header.code, &frame.payload).expect("decode"),
                Request::Lock {
                    alloc_id: 3,
                    chunk: 7
                }
            );
        }
        assert!(FrameReader::resume(&bytes, Vec::new()).is_err());
    }

    #[test]
    fn eof_inside_a_frame_and_bad_headers() {
        let bytes = bytes_of(&Request::Free { alloc_id: 4 }, 1);
        let mut reader = FrameReader::new();
        assert!(matches!(reader.feed(&bytes[..20]).1, Ok(None)));
        assert!(matches!(reader.feed(&[]).1, Err(ProtoError::UnexpectedEof)));
        let mut head = Header::request(Code::Free, 1, 8).expect("header").encode();
        head[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut reader = FrameReader::new();
        assert!(matches!(
            reader.feed(&head).1,
            Err(ProtoError::PayloadTooLarge(_))
        ));
        let mut reader = FrameReader::new();
        assert!(matches!(
            reader.advance(HEADER_SIZE + 1),
            Err(ProtoError::OutOfBounds(_))
        ));
    }
}
