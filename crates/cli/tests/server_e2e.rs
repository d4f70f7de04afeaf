//! Starts `pagekeeper serve` on the real default model and drives it with the official
//! `openai` Python client (tests/e2e/openai_client.py). CI installs the client with pip.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn get_status(port: u16, path: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split_whitespace().nth(1)?.parse().ok()
}

fn model_path() -> std::path::PathBuf {
    let home = std::env::var_os("PAGEKEEPER_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/pagekeeper")
        });
    let p = home.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model` first",
        p.display()
    );
    p
}

#[test]
fn openai_python_client_against_live_server() {
    let port = free_port();
    let server = Server(
        Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
            .args([
                "serve",
                "--port",
                &port.to_string(),
                "--kv-capacity-tokens",
                "16384",
                "--model",
            ])
            .arg(model_path())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the server"),
    );
    let t0 = Instant::now();
    loop {
        match get_status(port, "/health") {
            Some(200) => break,
            Some(503) | None => {}
            Some(s) => panic!("/health answered {s}"),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "server did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/e2e/openai_client.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{port}"))
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "the openai Python package is missing: pip install openai (CI does this in .ci/run)"
    );
    assert!(
        out.status.success(),
        "openai client checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all checks passed"));

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/e2e/load.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(format!("http://127.0.0.1:{port}"))
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "load test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("load: all checks passed"));
    eprintln!("{stdout}");
    drop(server);
}
