//! The HTTP accept loop: the axum router served by hyper with the read limits `axum::serve`
//! does not set, and a graceful drain.
//!
//! NOTE 1 (half-open connections): `axum::serve` gives hyper no timer, so a client that
//! opens a connection and sends half a request line holds a connection task forever. Here
//! each connection gets `HEADER_READ_TIMEOUT` to deliver its request head (also between
//! keep-alive requests), and a request body must make progress at least every
//! `BODY_READ_TIMEOUT` (`tower_http`'s body timeout; the handlers answer 408). Responses,
//! streams included, have no such limit: a long generation is not a stalled client.
//! NOTE 2 (drain): on shutdown the listener closes, connections are told to finish their
//! current request and close, and the loop waits for them at most the drain deadline.
//! NOTE 3 (idle connections, and how many): connections speak HTTP/1.1 only, as vLLM's
//! server does. hyper-util's automatic version detection first reads the client's preface
//! with no timer, so a connection that never sent a byte was held forever, and 3,000 of
//! them held 3,000 descriptors; served as HTTP/1 from the start, such a connection is
//! closed after `HEADER_READ_TIMEOUT` like any other that sends no head. At most
//! `max_connections` are served at once: past it the loop stops accepting, and new
//! clients wait in the kernel's backlog until one closes.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

/// Time a connection has to send a complete request head (NOTE 1).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest pause allowed while a request body is being received (NOTE 1).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections served at once (NOTE 3): far above what the engine's queue holds (each
/// waiting or running request holds one), far below the descriptor limit.
pub const MAX_CONNECTIONS: usize = 4096;

/// What one connection may take (NOTE 1, NOTE 3).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// Adds the request-body timeout to `router` (NOTE 1).
pub fn with_body_timeout(router: Router, body_read_timeout: Duration) -> Router {
    router.layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        body_read_timeout,
    ))
}

/// Accepts connections on `listener` until `shutdown` resolves, then drains for at most
/// `drain_deadline` (NOTE 2). Returns whether every connection finished in time.
pub async fn serve_connections(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
    drain_deadline: Duration,
) -> bool {
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let mut builder = auto::Builder::new(TokioExecutor::new()).http1_only();
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout);
        let service = TowerToHyperService::new(router.clone());
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, "connection closed with an error: {e}");
            }
            drop(slot);
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => true,
        () = tokio::time::sleep(drain_deadline) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::rejection::JsonRejection;
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    use axum::Json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A router like the server's: a JSON endpoint whose rejections go through `ApiError`,
    /// and a slow endpoint to drain.
    fn app() -> Router {
        let echo = |body: Result<Json<serde_json::Value>, JsonRejection>| async move {
            match body {
                Ok(Json(v)) => Json(v).into_response(),
                Err(r) => crate::handlers::ApiError::from(r).into_response(),
            }
        };
        let slow = || async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            "done"
        };
        let router = Router::new()
            .route("/echo", post(echo))
            .route("/slow", get(slow));
        with_body_timeout(router, Duration::from_millis(300))
    }

    async fn start(
        shutdown: tokio::sync::oneshot::Receiver<()>,
    ) -> (std::net::SocketAddr, tokio::task::JoinHandle<bool>) {
        start_with(shutdown, MAX_CONNECTIONS).await
    }

    async fn start_with(
        shutdown: tokio::sync::oneshot::Receiver<()>,
        max_connections: usize,
    ) -> (std::net::SocketAddr, tokio::task::JoinHandle<bool>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_millis(300),
            max_connections,
        };
        let task = tokio::spawn(serve_connections(
            listener,
            app(),
            limits,
            async move {
                let _ = shutdown.await;
            },
            Duration::from_secs(5),
        ));
        (addr, task)
    }

    /// Reads until the server closes the connection (or 3 s pass: a failure).
    async fn read_to_close(stream: &mut tokio::net::TcpStream) -> String {
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut out));
        match read.await {
            Ok(_) => String::from_utf8_lossy(&out).into_owned(),
            Err(_) => panic!("the server kept a stalled connection open: {out:?}"),
        }
    }

    /// A whole JSON request to `/echo` on a new connection; the reply as text.
    async fn post_echo(addr: std::net::SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 8\r\nConnection: close\r\n\r\n{\"a\": 1}",
        )
        .await
        .unwrap();
        read_to_close(&mut s).await
    }

    #[tokio::test]
    async fn stalled_request_heads_and_bodies_are_cut_off() {
        let (_stop, rx) = tokio::sync::oneshot::channel();
        let (addr, _task) = start(rx).await;

        // Connected, then silence from the start: closed as well (NOTE 3).
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let started = std::time::Instant::now();
        read_to_close(&mut s).await;
        assert!(started.elapsed() < Duration::from_secs(2));

        // Half a request head, then silence: the connection is closed.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let started = std::time::Instant::now();
        read_to_close(&mut s).await;
        assert!(started.elapsed() < Duration::from_secs(2));

        // A head promising 100 bytes of body, 10 sent, then silence: 408 with a message.
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{\"a\": 1, ",
        )
        .await
        .unwrap();
        let reply = read_to_close(&mut s).await;
        assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
        assert!(reply.contains("stalled"), "{reply}");

        // A whole request is answered.
        let reply = post_echo(addr).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    }

    /// With one connection allowed, a second client is served once the first (idle) one
    /// is closed, not before.
    #[tokio::test]
    async fn connections_past_the_limit_wait_for_one_to_close() {
        let (_stop, rx) = tokio::sync::oneshot::channel();
        let (addr, _task) = start_with(rx, 1).await;
        let _idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = std::time::Instant::now();
        let reply = post_echo(addr).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "served only after the idle connection's 300 ms header timeout: {:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn shutdown_drains_a_running_request() {
        let (stop, rx) = tokio::sync::oneshot::channel();
        let (addr, task) = start(rx).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(()).unwrap();
        let reply = read_to_close(&mut s).await;
        assert!(
            reply.starts_with("HTTP/1.1 200") && reply.ends_with("done"),
            "{reply}"
        );
        assert!(task.await.unwrap(), "drained within the deadline");
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "listener closed"
        );
    }
}
