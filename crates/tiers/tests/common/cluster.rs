//! A real Redis Cluster for tests: three masters and three replicas on loopback ports, started
//! from `redis-server` and `redis-cli` on PATH (`scripts/test.sh` puts them there), created with
//! `redis-cli --cluster create`, killed when dropped. Shared by the tier tests and the
//! server end-to-end tests (`#[path]`-included there).
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisCluster {
    pub ports: Vec<u16>,
    children: Vec<Option<Child>>,
    _dir: tempfile::TempDir,
}

/// Ports handed out in this process: tests start clusters concurrently, and a port another
/// cluster picked may not be bound yet when this one checks it.
static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());

/// A loopback port that is free, and whose cluster bus port (+10,000) is free too. Both lie
/// below Linux's ephemeral range (32,768 and up by default): a port in it can be taken by
/// any outgoing connection between this check and the server's bind, which was seen to
/// leave a node unable to start (its bus port taken).
fn free_cluster_port() -> u16 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let seed = u64::from(std::process::id()) ^ nanos;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut handed_out = HANDED_OUT.lock().unwrap();
    loop {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let port = 12_000 + (x % 10_000) as u16;
        if handed_out.contains(&port) {
            continue;
        }
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            handed_out.push(port);
            return port;
        }
    }
}

fn binary(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} not found on PATH: run the tests through scripts/test.sh, which fetches it"
            )
        })
}

impl RedisCluster {
    /// Starts six nodes and creates the cluster; returns once every slot is served and every
    /// master has a replica in sync.
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().unwrap();
        let ports: Vec<u16> = (0..6).map(|_| free_cluster_port()).collect();
        let server = binary("redis-server");
        let children = ports
            .iter()
            .map(|port| {
                let child = Command::new(&server)
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--cluster-enabled", "yes"])
                    .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                    // Failover after about a second of silence (the default is 15 s).
                    .args(["--cluster-node-timeout", "1000"])
                    .args(["--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(dir.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("spawn redis-server");
                Some(child)
            })
            .collect();
        let cluster = RedisCluster {
            ports,
            children,
            _dir: dir,
        };
        for &port in &cluster.ports {
            wait_until(Duration::from_secs(10), || cluster.node(port).map(|_| ()))
                .unwrap_or_else(|| panic!("cluster node on port {port} does not answer"));
        }
        let mut create = Command::new(binary("redis-cli"));
        create.arg("--cluster").arg("create");
        for port in &cluster.ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_healthy(Duration::from_secs(30));
        cluster
    }

    /// `redis+cluster://` URL with every node as a seed.
    pub fn url(&self) -> String {
        let seeds: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    fn node(&self, port: u16) -> Option<redis::Connection> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
        let mut conn = client
            .get_connection_with_timeout(Duration::from_millis(300))
            .ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        redis::cmd("PING").query::<String>(&mut conn).ok()?;
        Some(conn)
    }

    fn info(&self, port: u16, command: &[&str]) -> Option<String> {
        let mut conn = self.node(port)?;
        let mut cmd = redis::cmd(command[0]);
        for arg in &command[1..] {
            cmd.arg(*arg);
        }
        cmd.query::<String>(&mut conn).ok()
    }

    /// Ports of the running masters.
    pub fn masters(&self) -> Vec<u16> {
        self.running()
            .into_iter()
            .filter(|&p| {
                self.info(p, &["INFO", "replication"])
                    .is_some_and(|i| i.contains("role:master"))
            })
            .collect()
    }

    fn running(&self) -> Vec<u16> {
        self.ports
            .iter()
            .zip(&self.children)
            .filter(|(_, c)| c.is_some())
            .map(|(&p, _)| p)
            .collect()
    }

    /// Waits until every running node reports `cluster_state:ok` and every running replica's
    /// link to its master is up.
    pub fn wait_healthy(&self, within: Duration) {
        let healthy = || {
            self.running()
                .into_iter()
                .all(|p| {
                    let ok = self
                        .info(p, &["CLUSTER", "INFO"])
                        .is_some_and(|i| i.contains("cluster_state:ok"));
                    let repl = self.info(p, &["INFO", "replication"]).unwrap_or_default();
                    ok && (repl.contains("role:master") || repl.contains("master_link_status:up"))
                })
                .then_some(())
        };
        wait_until(within, healthy).unwrap_or_else(|| {
            panic!("the Redis Cluster did not become healthy within {within:?}")
        });
    }

    /// `CLUSTER MYID` of a node.
    pub fn node_id(&self, port: u16) -> String {
        self.info(port, &["CLUSTER", "MYID"]).expect("CLUSTER MYID")
    }

    /// Keys stored on a node.
    pub fn dbsize(&self, port: u16) -> u64 {
        let mut conn = self.node(port).expect("node answers");
        redis::cmd("DBSIZE").query(&mut conn).unwrap()
    }

    /// Visible tier entries under `prefix` (metadata keys) on the running masters.
    pub fn entries(&self, prefix: &str) -> usize {
        let pattern = format!("{prefix}*m:*");
        self.masters()
            .into_iter()
            .filter_map(|port| self.node(port))
            .map(|mut conn| {
                let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(&mut conn).unwrap();
                keys.len()
            })
            .sum()
    }

    /// Moves `slots` hash slots from one master to another with `redis-cli --cluster reshard`
    /// (keys travel by MIGRATE while clients keep working).
    pub fn reshard(&self, from: u16, to: u16, slots: u32) {
        let out = Command::new(binary("redis-cli"))
            .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
            .args(["--cluster-from", &self.node_id(from)])
            .args(["--cluster-to", &self.node_id(to)])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster reshard");
        assert!(
            out.status.success(),
            "redis-cli --cluster reshard failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Kills a master (SIGKILL: an outage); returns its port.
    pub fn kill_a_master(&mut self) -> u16 {
        let port = self.masters()[0];
        let i = self.ports.iter().position(|&p| p == port).unwrap();
        let mut child = self.children[i].take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        port
    }

    /// Waits for the killed master's replica to take over (every slot served again).
    pub fn wait_failover(&self, within: Duration) {
        let done = || {
            let live = self.running();
            let ok = live.iter().all(|&p| {
                self.info(p, &["CLUSTER", "INFO"])
                    .is_some_and(|i| i.contains("cluster_state:ok"))
            });
            (ok && self.masters().len() == 3).then_some(())
        };
        wait_until(within, done).unwrap_or_else(|| panic!("no failover within {within:?}"));
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn wait_until<T>(within: Duration, mut probe: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = probe() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
