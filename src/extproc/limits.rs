//! The connection cap on the gRPC listener: at most `max_connections` accepted connections are open at
//! once. At the cap the listener stops accepting, so further connections wait in the kernel's backlog
//! (and time out there) instead of each taking a file descriptor and a task.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::{Stream, StreamExt};
use prometheus::IntGauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::Connected;

/// `incoming`, accepting only while fewer than `max` of its connections are open; `open` counts them.
pub(super) fn limit_connections<S, IO>(
    incoming: S,
    max: usize,
    open: IntGauge,
) -> impl Stream<Item = io::Result<Counted<IO>>>
where
    S: Stream<Item = io::Result<IO>> + Unpin,
{
    let slots = Arc::new(Semaphore::new(max.max(1)));
    futures_util::stream::unfold(
        (incoming, slots, open),
        |(mut incoming, slots, open)| async move {
            // The semaphore is never closed.
            let permit = Arc::clone(&slots).acquire_owned().await.ok()?;
            let next = incoming.next().await?;
            let item = next.map(|io| {
                open.inc();
                Counted {
                    io,
                    _permit: permit,
                    open: open.clone(),
                }
            });
            Some((item, (incoming, slots, open)))
        },
    )
}

/// An accepted connection holding its place under the cap until it is dropped.
pub(super) struct Counted<IO> {
    io: IO,
    _permit: OwnedSemaphorePermit,
    open: IntGauge,
}

impl<IO> Drop for Counted<IO> {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl<IO: Connected> Connected for Counted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Counted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Counted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}
