//! The msgpack pull parser under the decoder: a cursor over the payload that reads one header at a
//! time, bounds-checks every read and takes a declared length only as far as the bytes that are there.

use super::{DecodeError, MAX_DEPTH, Result};

/// A msgpack value's header; strings, bytes and extensions carry their payload slice.
#[derive(Clone, Copy, Debug)]
pub(super) enum Head<'a> {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(u32),
    Map(u32),
}

/// A cursor over the payload. Every read is bounds-checked; a declared length is only ever taken as
/// far as the bytes that are actually there.
#[derive(Clone, Copy)]
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    /// The bytes not read yet.
    pub(super) fn left(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub(super) fn truncated(&self) -> DecodeError {
        DecodeError::Truncated { offset: self.pos }
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.truncated())?;
        let bytes = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.truncated())?;
        self.pos = end;
        Ok(bytes)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(u8::from_be_bytes(self.array()?))
    }

    pub(super) fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    pub(super) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    pub(super) fn len32(&mut self) -> Result<usize> {
        usize::try_from(self.u32()?).map_err(|_| self.truncated())
    }

    /// Room to reserve for `n` declared elements: each takes at least one byte, so never more than
    /// the bytes left.
    pub(super) fn cap_for(&self, n: u32) -> usize {
        (n as usize).min(self.buf.len().saturating_sub(self.pos))
    }

    pub(super) fn peek(&self) -> Result<Head<'a>> {
        let mut copy = *self;
        copy.head()
    }

    pub(super) fn head(&mut self) -> Result<Head<'a>> {
        let at = self.pos;
        let marker = self.u8()?;
        Ok(match marker {
            0x00..=0x7f => Head::Uint(u64::from(marker)),
            0x80..=0x8f => Head::Map(u32::from(marker & 0x0f)),
            0x90..=0x9f => Head::Array(u32::from(marker & 0x0f)),
            0xa0..=0xbf => Head::Str(self.take(usize::from(marker & 0x1f))?),
            0xc0 => Head::Nil,
            0xc1 => {
                return Err(DecodeError::Malformed {
                    offset: at,
                    what: "the reserved marker 0xc1",
                });
            }
            0xc2 | 0xc3 => Head::Bool,
            0xc4 => {
                let n = self.u8()?;
                Head::Bin(self.take(usize::from(n))?)
            }
            0xc5 => {
                let n = self.u16()?;
                Head::Bin(self.take(usize::from(n))?)
            }
            0xc6 => {
                let n = self.len32()?;
                Head::Bin(self.take(n)?)
            }
            0xc7 => {
                let n = self.u8()?;
                self.take(1 + usize::from(n))?;
                Head::Ext
            }
            0xc8 => {
                let n = self.u16()?;
                self.take(1 + usize::from(n))?;
                Head::Ext
            }
            0xc9 => {
                let n = self.len32()?;
                self.take(n.saturating_add(1))?;
                Head::Ext
            }
            0xca => Head::Float(f64::from(f32::from_be_bytes(self.array()?))),
            0xcb => Head::Float(f64::from_be_bytes(self.array()?)),
            0xcc => Head::Uint(u64::from(self.u8()?)),
            0xcd => Head::Uint(u64::from(self.u16()?)),
            0xce => Head::Uint(u64::from(self.u32()?)),
            0xcf => Head::Uint(u64::from_be_bytes(self.array()?)),
            0xd0 => Head::Int(i64::from(i8::from_be_bytes(self.array()?))),
            0xd1 => Head::Int(i64::from(i16::from_be_bytes(self.array()?))),
            0xd2 => Head::Int(i64::from(i32::from_be_bytes(self.array()?))),
            0xd3 => Head::Int(i64::from_be_bytes(self.array()?)),
            0xd4..=0xd8 => {
                // fixext 1, 2, 4, 8, 16: a type byte and 2^k data bytes.
                self.take(1 + (1usize << (marker - 0xd4)))?;
                Head::Ext
            }
            0xd9 => {
                let n = self.u8()?;
                Head::Str(self.take(usize::from(n))?)
            }
            0xda => {
                let n = self.u16()?;
                Head::Str(self.take(usize::from(n))?)
            }
            0xdb => {
                let n = self.len32()?;
                Head::Str(self.take(n)?)
            }
            0xdc => Head::Array(u32::from(self.u16()?)),
            0xdd => Head::Array(self.u32()?),
            0xde => Head::Map(u32::from(self.u16()?)),
            0xdf => Head::Map(self.u32()?),
            0xe0..=0xff => Head::Int(i64::from(marker as i8)),
        })
    }

    /// A map key: its bytes when it is a string; any other key is skipped and reads as `None`.
    pub(super) fn key(&mut self, depth: usize) -> Result<Option<&'a [u8]>> {
        match self.peek()? {
            Head::Str(name) => {
                self.head()?;
                Ok(Some(name))
            }
            _ => {
                self.skip(depth)?;
                Ok(None)
            }
        }
    }

    /// Skips one value at nesting `depth`. Each element consumes at least one byte, so a declared
    /// count larger than the payload ends in `Truncated` after at most the payload's length in steps.
    pub(super) fn skip(&mut self, depth: usize) -> Result<()> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep { max: MAX_DEPTH });
        }
        match self.head()? {
            Head::Array(n) => self.skip_n(n, depth + 1),
            Head::Map(n) => {
                for _ in 0..n {
                    self.skip(depth + 1)?;
                    self.skip(depth + 1)?;
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    pub(super) fn skip_n(&mut self, n: u32, depth: usize) -> Result<()> {
        for _ in 0..n {
            self.skip(depth)?;
        }
        Ok(())
    }
}
