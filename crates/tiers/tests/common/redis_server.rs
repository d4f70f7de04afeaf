//! A real `redis-server` for the Redis tests, shared by this crate's tests and the CLI's
//! tier tests (`crates/cli/tests/tiers_support`), which compile this file too.
//!
//! Which Redis a test gets (no silent skips):
//! - `PAGEKEEPER_TEST_REDIS=redis://host:port` set (CI sets it): that server; the test FAILS if
//!   it is unreachable.
//! - unset: a private `redis-server` on a free loopback port, started from PATH; the test FAILS
//!   if the binary is missing, saying to install it.
//!
//! Tests that stop and restart Redis always use a private server.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const REDIS_ENV: &str = "PAGEKEEPER_TEST_REDIS";

pub struct RedisServer {
    pub url: String,
    port: u16,
    child: Option<Child>,
    dir: Option<tempfile::TempDir>,
}

impl RedisServer {
    /// The CI server if `PAGEKEEPER_TEST_REDIS` is set, else a private one.
    pub fn shared_or_private() -> RedisServer {
        match std::env::var(REDIS_ENV) {
            Ok(url) => {
                if let Err(e) = ping(&url, Duration::from_secs(3)) {
                    panic!("{REDIS_ENV}={url} is set but Redis is unreachable there: {e}. Start redis-server (see .ci/run) or unset {REDIS_ENV}.");
                }
                RedisServer {
                    url,
                    port: 0,
                    child: None,
                    dir: None,
                }
            }
            Err(_) => RedisServer::private(),
        }
    }

    /// A server this test owns and may stop and restart.
    pub fn private() -> RedisServer {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = RedisServer {
            url: format!("redis://127.0.0.1:{port}"),
            port,
            child: None,
            dir: Some(tempfile::tempdir().unwrap()),
        };
        server.start();
        server
    }

    pub fn start(&mut self) {
        assert!(self.child.is_none(), "already running");
        let binary = redis_server_binary().unwrap_or_else(|| {
            panic!("redis-server not found on PATH: install it (apt-get install -y redis-server); the Redis tier tests need a real server")
        });
        let child = Command::new(binary)
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(
                self.dir
                    .as_ref()
                    .expect("only private servers are started")
                    .path(),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        if let Err(e) = ping(&self.url, Duration::from_secs(5)) {
            panic!(
                "redis-server started on port {} but does not answer: {e}",
                self.port
            );
        }
    }

    /// Kills the server (SIGKILL: an outage, not a clean shutdown).
    pub fn stop(&mut self) {
        let mut child = self
            .child
            .take()
            .expect("only a running private server can be stopped");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A plain connection for poking at the server behind the tier's back.
    pub fn raw(&self) -> redis::Connection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn redis_server_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/usr/sbin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file())
}

fn ping(url: &str, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    loop {
        let attempt = client
            .get_connection_with_timeout(Duration::from_millis(500))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
        match attempt {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e.to_string()),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
