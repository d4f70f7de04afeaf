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

/// `pagekeeper serve` on `model` with `args`, on a free port, once `/health` answers 200.
/// A port found free can be taken before the server binds it, so a server that exits
/// during start-up is started again on another port, three times at most.
fn start_server(model: &std::path::Path, args: &[&str]) -> (Server, u16) {
    for attempt in 1.. {
        match try_start_server(model, args) {
            Ok(started) => return started,
            Err(status) if attempt < 3 => eprintln!("serve exited during start-up ({status})"),
            Err(status) => panic!("pagekeeper serve exited during start-up: {status}"),
        }
    }
    unreachable!()
}

fn try_start_server(
    model: &std::path::Path,
    args: &[&str],
) -> Result<(Server, u16), std::process::ExitStatus> {
    let port = free_port();
    let mut server = Server(
        Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
            .args(["serve", "--port", &port.to_string(), "--model"])
            .arg(model)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting the server"),
    );
    let t0 = Instant::now();
    while get_status(port, "/health") != Some(200) {
        if let Some(status) = server.0.try_wait().unwrap() {
            return Err(status);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "server did not become healthy"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok((server, port))
}

/// A JSON POST over a fresh connection; the status and the parsed body.
fn post_json(port: u16, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    let status = buf.split_whitespace().nth(1).unwrap().parse().unwrap();
    let json = buf.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (
        status,
        serde_json::from_str(json).unwrap_or(serde_json::Value::Null),
    )
}

/// Qwen3's thinking switch through vLLM's `chat_template_kwargs`, on the random-weight
/// Qwen3-0.6B-shaped GGUF the conformance tests use (its real chat template): with
/// `enable_thinking: false` the prompt gains the template's empty think block (4 tokens).
#[test]
fn qwen3_thinking_switch_through_chat_template_kwargs() {
    let model = model_path().with_file_name("conformance/qwen3-0.6b-2l.gguf");
    assert!(
        model.exists(),
        "{} is missing: scripts/test.sh generates it",
        model.display()
    );
    let (_server, port) = start_server(&model, &["--kv-capacity-tokens", "4096"]);
    let ask = |kwargs: Option<serde_json::Value>| {
        let mut body = serde_json::json!({
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0
        });
        if let Some(k) = kwargs {
            body["chat_template_kwargs"] = k;
        }
        post_json(port, "/v1/chat/completions", &body)
    };
    let (status, plain) = ask(None);
    assert_eq!(status, 200, "{plain}");
    let (status, no_think) = ask(Some(serde_json::json!({"enable_thinking": false})));
    assert_eq!(status, 200, "{no_think}");
    let tokens = |v: &serde_json::Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        tokens(&no_think),
        tokens(&plain) + 4,
        "<think>, \\n\\n, </think>, \\n\\n"
    );
    let (status, err) = ask(Some(serde_json::json!({"frobnicate": 1})));
    assert_eq!(status, 400);
    assert_eq!(err["error"]["param"], "chat_template_kwargs", "{err}");
}

/// The body of a GET.
fn get_body(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    buf.split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string())
}

/// A gauge's value from a Prometheus text body (the first series of that name).
fn gauge(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
}

/// `serve --disable-hybrid-kv-cache-manager` reaches the engine (issue 34: it was parsed
/// and dropped): on Gemma-3-270M, a 3,000-token prompt holds every layer of every token
/// without KV cache groups, and only the windowed layers' last 512 tokens (plus the chunk
/// in flight) with them: measured 73 % of the pool against 32 % at its peak.
#[test]
fn serve_honours_disable_hybrid_kv_cache_manager() {
    let model = model_path().with_file_name("gemma-3-270m-q4_k_m.gguf");
    assert!(
        model.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all`",
        model.display()
    );
    let peak_fraction = |flag: Option<&str>| {
        let mut args = vec!["--kv-capacity-tokens", "4096"];
        args.extend(flag);
        let (_server, port) = start_server(&model, &args);
        let prompt: Vec<u32> = (0..3000).map(|i| 1000 + (i % 5000)).collect();
        let (status, body) = post_json(
            port,
            "/v1/completions",
            &serde_json::json!({"prompt": prompt, "max_tokens": 1}),
        );
        assert_eq!(status, 200, "{body}");
        let m = get_body(port, "/metrics");
        gauge(&m, "pagekeeper:kv_blocks_in_use_peak") / gauge(&m, "pagekeeper:kv_pool_blocks")
    };
    let grouped = peak_fraction(None);
    let flat = peak_fraction(Some("--disable-hybrid-kv-cache-manager"));
    eprintln!("peak share of the pool: groups {grouped:.3}, one table {flat:.3}");
    assert!(
        flat > 1.5 * grouped,
        "the flag changed nothing: {grouped} vs {flat}"
    );
}

/// vLLM's `add_special_tokens` on a model whose tokenizer adds BOS (Gemma 3): by default
/// the prompt is BOS + its text, with `false` exactly its text, one token fewer.
#[test]
fn add_special_tokens_false_leaves_out_the_bos() {
    let model = model_path().with_file_name("gemma-3-270m-q4_k_m.gguf");
    assert!(model.exists(), "{} is missing", model.display());
    let (_server, port) = start_server(&model, &["--kv-capacity-tokens", "2048"]);
    let prompt_tokens = |extra: serde_json::Value| {
        let mut body = serde_json::json!({"prompt": "The capital of France is", "max_tokens": 1});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, body) = post_json(port, "/v1/completions", &body);
        assert_eq!(status, 200, "{body}");
        body["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let with_bos = prompt_tokens(serde_json::json!({}));
    assert_eq!(
        prompt_tokens(serde_json::json!({"add_special_tokens": true})),
        with_bos
    );
    assert_eq!(
        prompt_tokens(serde_json::json!({"add_special_tokens": false})),
        with_bos - 1
    );
}

/// `/metrics` as vLLM names its series (issue 34): after streamed and whole requests, one
/// of them with two choices, the inter-token latency histogram holds one observation per
/// gap between consecutive tokens of each choice served; every counter's name ends in
/// `_total`; every series carries the served model's `model_name`; and every name has the
/// `vllm:` or `pagekeeper:` prefix (never `pagekeeper_`).
#[test]
fn metrics_count_every_token_gap_and_follow_vllm_names() {
    let (_server, port) = start_server(
        &model_path(),
        &[
            "--kv-capacity-tokens",
            "4096",
            "--served-model-name",
            "metrics-test",
        ],
    );
    let client = reqwest::blocking::Client::new();
    let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
    // Completion tokens of a request (every choice's), from its body or, streamed, from
    // the usage chunk that `include_usage` adds before `[DONE]`.
    let completion_tokens = |path: &str, body: serde_json::Value| -> u64 {
        let stream = body["stream"] == true;
        let response = client.post(url(path)).json(&body).send().unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let text = response.text().unwrap();
        let usage = match stream {
            false => serde_json::from_str::<serde_json::Value>(&text).unwrap()["usage"].clone(),
            true => text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter(|d| *d != "[DONE]")
                .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
                .find(|chunk| !chunk["usage"].is_null())
                .expect("a usage chunk")["usage"]
                .clone(),
        };
        usage["completion_tokens"].as_u64().unwrap()
    };
    // (path, stream, choices, max_tokens): `ignore_eos` makes every choice generate exactly
    // `max_tokens` tokens, so a choice of k tokens is k - 1 gaps.
    let requests = [
        ("/v1/completions", false, 1, 9),
        ("/v1/completions", true, 1, 7),
        ("/v1/chat/completions", false, 2, 6),
        ("/v1/chat/completions", true, 2, 5),
        ("/v1/completions", false, 1, 1),
    ];
    let mut gaps = 0;
    let mut choices = 0;
    for (path, stream, n, max_tokens) in requests {
        let mut body = serde_json::json!({
            "max_tokens": max_tokens, "n": n, "ignore_eos": true, "temperature": 0.7, "seed": 3,
        });
        match path {
            "/v1/completions" => body["prompt"] = "The river flows".into(),
            _ => body["messages"] = serde_json::json!([{"role": "user", "content": "Hi"}]),
        }
        if stream {
            body["stream"] = true.into();
            body["stream_options"] = serde_json::json!({"include_usage": true});
        }
        let tokens = completion_tokens(path, body);
        assert_eq!(tokens, n * max_tokens, "{path} stream={stream} n={n}");
        gaps += n * (max_tokens - 1);
        choices += n;
    }
    let metrics = client.get(url("/metrics")).send().unwrap().text().unwrap();
    let model = "model_name=\"metrics-test\"";
    assert_eq!(
        gauge(&metrics, "vllm:inter_token_latency_seconds_count"),
        gaps as f64,
        "one observation per gap between consecutive tokens:\n{metrics}"
    );
    for histogram in [
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ] {
        assert_eq!(
            gauge(&metrics, &format!("{histogram}_count")),
            choices as f64,
            "one per choice"
        );
    }
    assert_eq!(
        gauge(&metrics, "vllm:request_success_total"),
        choices as f64
    );
    assert!(metrics.contains("finished_reason=\"length\""), "{metrics}");
    let mut counters = 0;
    for line in metrics.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let (name, kind) = declared.rsplit_once(' ').unwrap();
            if kind == "counter" {
                counters += 1;
                assert!(name.ends_with("_total"), "counter {name}");
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        assert!(line.contains(model), "no {model}: {line}");
        assert!(
            line.starts_with("vllm:") || line.starts_with("pagekeeper:"),
            "one prefix per family: {line}"
        );
    }
    assert!(counters >= 6, "{metrics}");
    assert!(!metrics.contains("pagekeeper_"), "{metrics}");
}

/// Every grammar the server is given (`response_format`, vLLM's `guided_*`, a forced
/// `tool_choice`, a list of prompts sharing one) is compiled on its blocking pool, never on
/// the engine thread, where a compilation stalls every running stream (issue 34): the
/// engine's count of its own compilations stays 0 while the outputs still follow the
/// grammars, and a grammar that cannot compile is still a 400 naming its field.
#[test]
fn grammars_are_compiled_off_the_engine_thread() {
    let (_server, port) = start_server(&model_path(), &[]);
    let chat = |extra: serde_json::Value| {
        let mut body = serde_json::json!({
            "messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 48, "temperature": 0
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        post_json(port, "/v1/chat/completions", &body)
    };
    let schema = serde_json::json!({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]});
    let (status, body) = chat(
        serde_json::json!({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}),
    );
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let answer: serde_json::Value = serde_json::from_str(content).expect("JSON as the schema says");
    assert!(answer["city"].is_string(), "{answer}");
    let weather = serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": schema}});
    let (status, body) = chat(
        serde_json::json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let (status, body) = post_json(
        port,
        "/v1/completions",
        &serde_json::json!({"prompt": ["Is fire hot? Answer:", "Is ice hot? Answer:"], "max_tokens": 4, "guided_choice": ["yes", "no"]}),
    );
    assert_eq!(status, 200, "{body}");
    for c in body["choices"].as_array().unwrap() {
        assert!(matches!(c["text"].as_str(), Some("yes" | "no")), "{c}");
    }
    for (bad, param) in [
        (
            serde_json::json!({"guided_regex": "(unclosed"}),
            "guided_regex",
        ),
        (
            serde_json::json!({"guided_choice": ["a"], "ignore_eos": true}),
            "guided_choice",
        ),
    ] {
        let (status, body) = chat(bad);
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
    }
    let m = get_body(port, "/metrics");
    assert_eq!(
        gauge(&m, "pagekeeper:engine_thread_grammar_compilations_total"),
        0.0
    );
}

/// Issue 34's bar, literally: under `serve --kv-budget 128`, `n: 2` is refused naming `n`
/// (the forked choices would share blocks that eviction rewrites), and a request that opts
/// out of eviction (`kv_policy: full`) still gets its two choices.
#[test]
fn n_choices_under_the_servers_default_budget_are_refused_by_name() {
    let (_server, port) = start_server(
        &model_path(),
        &["--kv-capacity-tokens", "4096", "--kv-budget", "128"],
    );
    let body = |extra: serde_json::Value| {
        let mut b = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 4, "n": 2});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let (status, err) = post_json(port, "/v1/completions", &body(serde_json::json!({})));
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "n", "{err}");
    let (status, ok) = post_json(
        port,
        "/v1/completions",
        &body(serde_json::json!({"kv_policy": "full"})),
    );
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["choices"].as_array().unwrap().len(), 2, "{ok}");
}

/// A completion's list of prompts is queued all or none: more prompts than the queue holds
/// is a 400 naming `prompt` (no retry could cure it), and a list that fits is served whole.
/// Queued one by one, five prompts against a queue of two were a 429 after the first two
/// had been computed and thrown away.
#[test]
fn a_list_of_prompts_is_queued_all_or_none() {
    let (_server, port) = start_server(&model_path(), &["--max-waiting-requests", "2"]);
    let prompts =
        |n: usize| serde_json::json!({"prompt": vec!["Once upon a time"; n], "max_tokens": 2});
    let (status, err) = post_json(port, "/v1/completions", &prompts(5));
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["param"], "prompt", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-waiting-requests"),
        "{err}"
    );
    let (status, ok) = post_json(port, "/v1/completions", &prompts(2));
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["choices"].as_array().unwrap().len(), 2, "{ok}");
}
