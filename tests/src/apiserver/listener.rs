//! The TCP listener and its connections, which can be shut down and re-bound on the same port.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};

use super::{http, Shared};

/// A bound listening socket with its accept loop. Dropping it aborts the loop and thereby every
/// connection; [`RunningListener::shut_down`] does the same but waits until all are closed.
pub struct RunningListener {
    shutdown: Option<oneshot::Sender<()>>,
    accept_loop: Option<JoinHandle<()>>,
}

impl RunningListener {
    pub fn bind(address: SocketAddr, shared: Arc<Shared>) -> io::Result<(Self, SocketAddr)> {
        let socket = if address.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        // Re-binding the same port right after closing it must not fail on TIME_WAIT leftovers.
        socket.set_reuseaddr(true)?;
        socket.bind(address)?;
        let listener = socket.listen(1024)?;
        let bound = listener.local_addr()?;
        let (shutdown, shutdown_requested) = oneshot::channel();
        let accept_loop = tokio::spawn(accept_connections(listener, shared, shutdown_requested));
        Ok((Self { shutdown: Some(shutdown), accept_loop: Some(accept_loop) }, bound))
    }

    /// Closes the listening socket and every connection, and waits until that is done.
    pub async fn shut_down(mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(accept_loop) = self.accept_loop.take() {
            let _ = accept_loop.await;
        }
    }
}

impl Drop for RunningListener {
    fn drop(&mut self) {
        if let Some(accept_loop) = self.accept_loop.take() {
            accept_loop.abort();
        }
    }
}

async fn accept_connections(listener: TcpListener, shared: Arc<Shared>, mut shutdown_requested: oneshot::Receiver<()>) {
    // Owning the connection tasks here means dropping this future closes them all.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut shutdown_requested => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    connections.spawn(serve_connection(stream, shared.clone()));
                }
                Err(error) => {
                    // Typically EMFILE; back off instead of spinning.
                    tracing::warn!(%error, "fake apiserver accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.shutdown().await;
}

async fn serve_connection(stream: TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let service = service_fn(move |request| http::handle(shared.clone(), request));
    if let Err(error) = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await {
        tracing::debug!(%error, "fake apiserver connection ended with an error");
    }
}
