//! A `pagekeeper serve` child process for the server benches: started, waited for until
//! healthy, and killed when dropped.
//!
//! The child's stderr is read by a thread for two reasons. The server announces the
//! address it bound (`pagekeeper: serving MODEL on http://ADDR`), so `--port 0` lets the
//! kernel pick a free port with no window between choosing and binding it; the replicas
//! bench used to take `--port + k` for replica k, which another process could hold. And a
//! server that exits before it is healthy (a flag it refuses, a port taken) is reported
//! with its last lines of stderr instead of a bare exit status.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How many of the child's last stderr lines an error quotes.
const STDERR_TAIL_LINES: usize = 20;
/// How long a server may take to load its model and become healthy.
const HEALTHY_DEADLINE: Duration = Duration::from_secs(180);

/// A running server; killed and reaped on drop.
pub(crate) struct Server {
    child: Child,
    /// The port the server bound (the one asked for, or the kernel's pick for `--port 0`).
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// Starts `pagekeeper` with `args` (a `serve` command line) and waits until its `/health`
/// answers 200. A server that exits first is an error at once, quoting its stderr.
pub(crate) fn start(
    http: &reqwest::blocking::Client,
    args: Vec<std::ffi::OsString>,
) -> Result<Server> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting the server")?;
    let stderr = child.stderr.take().expect("stderr was piped");
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let (port_tx, port_rx) = mpsc::channel();
    let reader_tail = tail.clone();
    std::thread::spawn(move || read_stderr(BufReader::new(stderr), &reader_tail, &port_tx));
    let mut server = Server { child, port: 0 };
    let t0 = Instant::now();
    loop {
        if server.port == 0 {
            if let Ok(port) = port_rx.recv_timeout(Duration::from_millis(100)) {
                server.port = port;
            }
        } else if healthy(http, &server) {
            return Ok(server);
        } else {
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(status) = server.child.try_wait()? {
            // Give the reader a moment to take the last lines the child wrote.
            std::thread::sleep(Duration::from_millis(200));
            let lines = tail.lock().unwrap().iter().cloned().collect::<Vec<_>>();
            bail!(
                "the server exited ({status}) before it was healthy; its last stderr lines:\n{}",
                lines.join("\n")
            );
        }
        if t0.elapsed() > HEALTHY_DEADLINE {
            bail!(
                "the server did not become healthy within {} s",
                HEALTHY_DEADLINE.as_secs()
            );
        }
    }
}

fn healthy(http: &reqwest::blocking::Client, server: &Server) -> bool {
    http.get(format!("{}/health", server.base_url()))
        .send()
        .map(|r| r.status().as_u16() == 200)
        .unwrap_or(false)
}

/// Reads the child's stderr to its end (so the child never blocks on a full pipe), keeps
/// the last lines, and sends the port from the server's announcement.
fn read_stderr(reader: impl BufRead, tail: &Mutex<VecDeque<String>>, port_tx: &mpsc::Sender<u16>) {
    for line in reader.lines().map_while(Result::ok) {
        if let Some(port) = announced_port(&line) {
            let _ = port_tx.send(port);
        }
        let mut tail = tail.lock().unwrap();
        if tail.len() == STDERR_TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line);
    }
}

/// The port in `pagekeeper: serving MODEL on http://HOST:PORT`, the server's first line.
fn announced_port(line: &str) -> Option<u16> {
    let rest = line.strip_prefix("pagekeeper: serving ")?;
    let (_, addr) = rest.rsplit_once(" on http://")?;
    addr.rsplit_once(':')?.1.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_read_from_the_servers_announcement() {
        assert_eq!(
            announced_port("pagekeeper: serving SmolLM2 on http://127.0.0.1:41234"),
            Some(41234)
        );
        assert_eq!(
            announced_port("pagekeeper: serving a model on x on http://[::1]:8471"),
            Some(8471)
        );
        assert_eq!(announced_port("pagekeeper: loading model"), None);
        assert_eq!(
            announced_port("pagekeeper: serving m on http://127.0.0.1:notaport"),
            None
        );
    }

    #[test]
    fn the_tail_keeps_the_last_lines_only() {
        let text: String = (0..50).map(|i| format!("line {i}\n")).collect();
        let tail = Mutex::new(VecDeque::new());
        let (tx, _rx) = mpsc::channel();
        read_stderr(text.as_bytes(), &tail, &tx);
        let tail = tail.into_inner().unwrap();
        assert_eq!(tail.len(), STDERR_TAIL_LINES);
        assert_eq!(tail.front().unwrap(), "line 30");
        assert_eq!(tail.back().unwrap(), "line 49");
    }
}
