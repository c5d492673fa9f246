//! The client end of ZMTP 3.0 over TCP with the NULL mechanism: just what a SUB and a DEALER socket
//! need to read the engines' KV event streams, with a byte limit on every frame and every message.
//!
//! A ZMTP frame declares its length in its header, before its body. The limit is checked there: a
//! frame over it is refused before a byte of its body is buffered, and the connection is closed (a
//! stream cannot skip a frame without reading it, and a publisher that sends one is not to be trusted
//! with the next). A frame within the limit is read into a buffer of exactly its length, so nothing
//! outlives the message that needed it.
//!
//! One connection is one peer: no reconnection, no queue, no background task. The subscriber
//! reconnects by opening a new one, so a peer that went away is seen at once (a read fails) instead
//! of being reconnected to silently.
//!
//! Commands the peer sends after the handshake are read within the same limit: a PING is answered
//! with a PONG (ZMTP 3.1 heartbeats), others are skipped. A `SUBSCRIBE` is sent as ZMTP 3.0's
//! message with a leading 1 byte, which every ZMTP 3.x publisher accepts.

use std::net::SocketAddr;

use bytes::Bytes;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// A command's body is a name and a few properties: anything longer is not a peer worth reading.
const MAX_COMMAND_BYTES: usize = 64 << 10;
/// Frames in one message: the engines send 2 to 4 (delimiter, topic, sequence, payload).
const MAX_FRAMES: usize = 16;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

#[derive(Debug, Error)]
pub enum ZmtpError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a ZMTP 3 peer: {0}")]
    Handshake(&'static str),
    #[error("a frame of {len} bytes; the limit is {max}")]
    FrameTooLarge { len: u64, max: usize },
    #[error("a message of more than {max} bytes")]
    MessageTooLarge { max: usize },
    #[error("a message of more than {MAX_FRAMES} frames")]
    TooManyFrames,
    #[error("a command of {len} bytes; the limit is {MAX_COMMAND_BYTES}")]
    CommandTooLarge { len: u64 },
}

impl ZmtpError {
    /// The peer sent more than the limits allow (rather than breaking the connection).
    pub fn is_oversized(&self) -> bool {
        matches!(
            self,
            ZmtpError::FrameTooLarge { .. }
                | ZmtpError::MessageTooLarge { .. }
                | ZmtpError::TooManyFrames
                | ZmtpError::CommandTooLarge { .. }
        )
    }
}

/// The socket type this end announces.
#[derive(Clone, Copy, Debug)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn as_bytes(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }
}

/// One ZMTP connection to one peer.
pub struct Connection {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
    /// The most bytes one message (all its frames) may hold; a frame is limited by the same.
    max_message: usize,
}

impl Connection {
    /// Connects to `addr` and completes the handshake as `socket_type`. The caller bounds the time.
    pub async fn connect(
        addr: SocketAddr,
        socket_type: SocketType,
        max_message: usize,
    ) -> Result<Connection, ZmtpError> {
        let stream = TcpStream::connect(addr).await?;
        let _ = stream.set_nodelay(true);
        let (read, write) = stream.into_split();
        let mut connection = Connection {
            read: BufReader::with_capacity(64 << 10, read),
            write,
            max_message,
        };
        connection.handshake(socket_type).await?;
        Ok(connection)
    }

    async fn handshake(&mut self, socket_type: SocketType) -> Result<(), ZmtpError> {
        let mut greeting = [0_u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[11] = 0;
        greeting[12..16].copy_from_slice(b"NULL");
        self.write.write_all(&greeting).await?;
        self.send_command(&ready(socket_type)).await?;

        let mut peer = [0_u8; 64];
        self.read.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] != 0x7f {
            return Err(ZmtpError::Handshake("bad greeting signature"));
        }
        if peer[10] < 3 {
            return Err(ZmtpError::Handshake("a ZMTP version before 3.0"));
        }
        if &peer[12..16] != b"NULL" || peer[16..32].iter().any(|&byte| byte != 0) {
            return Err(ZmtpError::Handshake("a security mechanism other than NULL"));
        }
        // The peer's READY (or ERROR) comes first.
        let (flags, body) = self.read_frame(MAX_COMMAND_BYTES, true).await?;
        if flags & FLAG_COMMAND == 0 {
            return Err(ZmtpError::Handshake("no READY command"));
        }
        match command_name(&body) {
            Some(b"READY") => Ok(()),
            Some(b"ERROR") => Err(ZmtpError::Handshake("the peer refused the connection")),
            _ => Err(ZmtpError::Handshake("no READY command")),
        }
    }

    /// Asks a publisher for the messages whose first frame starts with `topic`.
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut body = Vec::with_capacity(topic.len() + 1);
        body.push(1);
        body.extend_from_slice(topic);
        self.send(&[&body]).await
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        let mut out = Vec::new();
        for (position, frame) in frames.iter().enumerate() {
            let more = position + 1 < frames.len();
            encode_frame(&mut out, if more { FLAG_MORE } else { 0 }, frame);
        }
        self.write.write_all(&out).await?;
        Ok(())
    }

    async fn send_command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let mut out = Vec::with_capacity(body.len() + 9);
        encode_frame(&mut out, FLAG_COMMAND, body);
        self.write.write_all(&out).await?;
        Ok(())
    }

    /// The next message, its frames in order. Commands between messages are handled and skipped.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        let mut total = 0_usize;
        loop {
            let room = self.max_message.saturating_sub(total);
            let (flags, body) = self.read_frame(room, frames.is_empty()).await?;
            if flags & FLAG_COMMAND != 0 {
                if command_name(&body) == Some(b"PING") {
                    self.send_command(&pong(&body)).await?;
                }
                continue;
            }
            total = total.saturating_add(body.len());
            frames.push(Bytes::from(body));
            if flags & FLAG_MORE == 0 {
                return Ok(frames);
            }
            if frames.len() >= MAX_FRAMES {
                return Err(ZmtpError::TooManyFrames);
            }
        }
    }

    /// One frame: its flags and body. A body longer than `room` (or than a command may be) is refused
    /// from its header, unread. `first` says whether a command may come here (between messages).
    async fn read_frame(&mut self, room: usize, first: bool) -> Result<(u8, Vec<u8>), ZmtpError> {
        let flags = self.read.read_u8().await?;
        let len = if flags & FLAG_LONG != 0 {
            self.read.read_u64().await?
        } else {
            u64::from(self.read.read_u8().await?)
        };
        if flags & FLAG_COMMAND != 0 {
            if !first {
                return Err(ZmtpError::Handshake("a command inside a message"));
            }
            if len > MAX_COMMAND_BYTES as u64 {
                return Err(ZmtpError::CommandTooLarge { len });
            }
        } else if len > self.max_message as u64 {
            return Err(ZmtpError::FrameTooLarge {
                len,
                max: self.max_message,
            });
        } else if len > room as u64 {
            return Err(ZmtpError::MessageTooLarge {
                max: self.max_message,
            });
        }
        let len = usize::try_from(len).map_err(|_| ZmtpError::FrameTooLarge {
            len,
            max: self.max_message,
        })?;
        let mut body = vec![0_u8; len];
        self.read.read_exact(&mut body).await?;
        Ok((flags, body))
    }
}

fn encode_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > usize::from(u8::MAX) {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// A command's name: its first byte is the name's length.
fn command_name(body: &[u8]) -> Option<&[u8]> {
    let (&len, rest) = body.split_first()?;
    rest.get(..usize::from(len))
}

/// `READY` with the one property a NULL handshake needs.
fn ready(socket_type: SocketType) -> Vec<u8> {
    let name = b"Socket-Type";
    let value = socket_type.as_bytes();
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value);
    body
}

/// The `PONG` answering a `PING`: the ping's context echoed (ZMTP 3.1, RFC 37).
fn pong(ping: &[u8]) -> Vec<u8> {
    // name (1 + 4 bytes), TTL (2 bytes), then the context.
    let context = ping.get(7..).unwrap_or_default();
    let mut body = vec![4];
    body.extend_from_slice(b"PONG");
    body.extend_from_slice(context);
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_encoded_short_and_long() {
        let mut out = Vec::new();
        encode_frame(&mut out, FLAG_MORE, b"ab");
        assert_eq!(out, [FLAG_MORE, 2, b'a', b'b']);
        let mut out = Vec::new();
        encode_frame(&mut out, 0, &[7; 300]);
        assert_eq!(out[0], FLAG_LONG);
        assert_eq!(&out[1..9], &300_u64.to_be_bytes());
        assert_eq!(out.len(), 9 + 300);
    }

    /// A publisher that completes the handshake, then writes `after` and keeps the connection open.
    async fn peer(after: Vec<u8>) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut greeting = [0_u8; 64];
            stream.read_exact(&mut greeting).await.unwrap();
            let mut ours = [0_u8; 64];
            ours[0] = 0xff;
            ours[9] = 0x7f;
            ours[10] = 3;
            ours[12..16].copy_from_slice(b"NULL");
            let mut out = ours.to_vec();
            encode_frame(&mut out, FLAG_COMMAND, &ready(SocketType::Sub));
            out.extend_from_slice(&after);
            stream.write_all(&out).await.unwrap();
            // Held open, never sending the body it declared: a reader that waited for it would hang.
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest).await;
        });
        addr
    }

    #[tokio::test]
    async fn a_frame_over_the_limit_is_refused_from_its_header() {
        let mut header = vec![FLAG_LONG];
        header.extend_from_slice(&(1_u64 << 40).to_be_bytes());
        let mut connection = Connection::connect(peer(header).await, SocketType::Sub, 1024)
            .await
            .unwrap();
        assert!(matches!(
            connection.recv().await,
            Err(ZmtpError::FrameTooLarge { len, max: 1024 }) if len == 1 << 40
        ));
    }

    #[tokio::test]
    async fn frames_of_one_message_share_its_limit() {
        let mut frames = Vec::new();
        encode_frame(&mut frames, FLAG_MORE, &[1; 600]);
        encode_frame(&mut frames, 0, &[2; 600]);
        let mut connection = Connection::connect(peer(frames).await, SocketType::Sub, 1000)
            .await
            .unwrap();
        let error = connection.recv().await.unwrap_err();
        assert!(
            matches!(error, ZmtpError::MessageTooLarge { max: 1000 }),
            "{error}"
        );
        assert!(error.is_oversized());

        let mut frames = Vec::new();
        encode_frame(&mut frames, FLAG_COMMAND, b"\x04PING\x00\x00");
        encode_frame(&mut frames, FLAG_MORE, b"topic");
        encode_frame(&mut frames, 0, &[3; 300]);
        let mut connection = Connection::connect(peer(frames).await, SocketType::Sub, 1000)
            .await
            .unwrap();
        let message = connection.recv().await.unwrap();
        assert_eq!(message.len(), 2);
        assert_eq!(&message[0][..], b"topic");
        assert_eq!(message[1].len(), 300);
    }

    #[test]
    fn commands_are_named_by_their_length_prefix() {
        assert_eq!(command_name(&ready(SocketType::Sub)), Some(&b"READY"[..]));
        assert_eq!(command_name(b"\x09PIN"), None);
        assert_eq!(command_name(b""), None);
        assert_eq!(pong(b"\x04PING\x00\x10ctx"), b"\x04PONGctx");
    }
}
