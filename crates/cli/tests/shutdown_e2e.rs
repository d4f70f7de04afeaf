//! Graceful shutdown of the real server binary: SIGTERM (what `kill`, systemd and
//! Kubernetes send) lets a running stream finish, then the process exits cleanly; before,
//! only Ctrl-C drained and SIGTERM killed streams mid-answer.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn model_path() -> std::path::PathBuf {
    let p = pk_engine::model_store::default_model_path();
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model` first",
        p.display()
    );
    p
}

/// The test also reads what the server said on stderr: its address in the words the benches
/// parse, and that the model is loaded, so that a load failing after the address is
/// printed is not taken for a server that was up.
#[test]
fn sigterm_lets_a_running_stream_finish() {
    let port = free_port();
    let log_path = std::env::temp_dir().join(format!("pk-shutdown-e2e-{port}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
        .args([
            "serve",
            "--port",
            &port.to_string(),
            "--threads",
            "2",
            "--kv-capacity-tokens",
            "2048",
        ])
        .arg("--model")
        .arg(model_path())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("starting pagekeeper serve");
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    while client
        .get(format!("{base}/health"))
        .send()
        .map(|r| r.status().as_u16())
        .ok()
        != Some(200)
    {
        assert!(
            child.try_wait().unwrap().is_none(),
            "server exited during start-up"
        );
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "server did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 96, "ignore_eos": true, "stream": true, "temperature": 0});
    let resp = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut lines = BufReader::new(resp).lines();
    // The first chunk proves the request is running; then the signal.
    let first = lines
        .by_ref()
        .map(|l| l.unwrap())
        .find(|l| l.starts_with("data: "))
        .expect("a first chunk");
    assert!(first.contains("text"), "{first}");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let mut chunks = 1;
    let mut done = false;
    for l in lines {
        let l = l.expect("the stream is not cut");
        if l == "data: [DONE]" {
            done = true;
            break;
        }
        if l.starts_with("data: ") {
            assert!(!l.contains("\"error\""), "{l}");
            chunks += 1;
        }
    }
    assert!(
        done,
        "the stream ended without [DONE] after {chunks} chunks"
    );
    // One chunk per token, perhaps fewer when a character spans tokens.
    assert!(chunks >= 80, "only {chunks} chunks of 96 tokens arrived");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not exit after draining"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status after SIGTERM: {status}");
    let said = std::fs::read_to_string(&log_path).unwrap();
    let _ = std::fs::remove_file(&log_path);
    eprintln!("{said}");
    assert!(
        said.lines().any(|l| l.starts_with("pagekeeper: serving ")
            && l.ends_with(&format!(" on http://127.0.0.1:{port}"))),
        "{said}"
    );
    assert!(said.contains(" loaded; serving requests"), "{said}");
    assert!(said.contains("pagekeeper: shutting down"), "{said}");
}
