//! At most `--max-connections` open gRPC connections (counted apart from HTTP's): a connection
//! accepted beyond it is closed at once, so idle connections cannot pile up without bound. Each
//! admitted connection holds a semaphore permit until it closes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted connection and its place in the limit.
pub struct Limited {
    io: TcpStream,
    _permit: OwnedSemaphorePermit,
}

/// The listener's connections, those beyond `max_connections` open at once closed on arrival.
pub fn limited(listener: TcpListener, max_connections: usize) -> impl Stream<Item = io::Result<Limited>> {
    let slots = Arc::new(Semaphore::new(max_connections.max(1)));
    TcpListenerStream::new(listener).filter_map(move |accepted| match accepted {
        Ok(io) => match slots.clone().try_acquire_owned() {
            Ok(permit) => Some(Ok(Limited { io, _permit: permit })),
            Err(_) => {
                tracing::warn!(max_connections, "gRPC connection refused: at the connection limit");
                None
            }
        },
        Err(e) => Some(Err(e)),
    })
}

impl Connected for Limited {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.io.connect_info()
    }
}

impl AsyncRead for Limited {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Limited {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
