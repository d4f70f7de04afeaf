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
    header_read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
    drain_deadline: Duration,
) -> bool {
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
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
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout);
        let service = TowerToHyperService::new(router.clone());
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, "connection closed with an error: {e}");
            }
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
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(serve_connections(
            listener,
            app(),
            Duration::from_millis(300),
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

    #[tokio::test]
    async fn stalled_request_heads_and_bodies_are_cut_off() {
        let (_stop, rx) = tokio::sync::oneshot::channel();
        let (addr, _task) = start(rx).await;

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
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 8\r\nConnection: close\r\n\r\n{\"a\": 1}",
        )
        .await
        .unwrap();
        let reply = read_to_close(&mut s).await;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
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
