//! `--config FILE`: a TOML file with the settings a deployment keeps fixed (model, threads,
//! tiers), so that a command line need not repeat them. Precedence, per setting:
//! flag > environment variable > file > built-in default.
//!
//! Clap already applies flag > env; a setting the file may supply is therefore an `Option`
//! in the argument structs (`None` = neither flag nor env given), and `ModelArgs::resolved`
//! (args.rs) fills the `None`s from the file. Defaults are applied last, where the value is
//! used.
//!
//! A tier given by flag or env replaces the file's entry for that tier as a whole (the flag
//! form `DIR:SIZE` cannot say everything a file's `[tiers.disk]` table can;
//! `TierArgs::tier_configs` in tier_args.rs).
//!
//! This file is the file's format only, and names no flag: the argument structs read it.
//!
//! ```toml
//! model = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
//! threads = 8
//! [tiers]
//! chunk_tokens = 256
//! ram = "2GiB"
//! [tiers.disk]
//! path = "/var/cache/pagekeeper/kv"
//! capacity = "20GiB"
//! drop_page_cache = false
//! [tiers.redis]
//! url = "redis://127.0.0.1:6379"
//! capacity = "8GiB"
//! prefix = "pk:tiers:v1:"
//! ```

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use pk_tiers::{parse_byte_size, parse_key_prefix, TierConfig};
use serde::Deserialize;

/// The file's contents. Unknown keys are errors: a misspelt setting must not be ignored.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub model: Option<PathBuf>,
    pub threads: Option<usize>,
    #[serde(default)]
    pub tiers: TiersSection,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TiersSection {
    /// Tokens per stored chunk.
    pub chunk_tokens: Option<usize>,
    /// RAM tier capacity, e.g. "2GiB".
    pub ram: Option<String>,
    pub disk: Option<DiskSection>,
    pub redis: Option<RedisSection>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DiskSection {
    pub path: PathBuf,
    pub capacity: String,
    /// Drop entries from the OS page cache after writes and reads (cold-read benchmarks).
    #[serde(default)]
    pub drop_page_cache: bool,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RedisSection {
    pub url: String,
    pub capacity: Option<String>,
    /// Key namespace; servers that share chunks use the same one.
    pub prefix: Option<String>,
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        let config: FileConfig = toml::from_str(&text)
            .with_context(|| format!("parsing config file {}", path.display()))?;
        // Validate sizes and URLs now, so that a bad file fails before the model loads.
        config
            .tiers
            .tier_configs()
            .with_context(|| format!("in config file {}", path.display()))?;
        Ok(config)
    }

    /// The keys this file sets, each with the clap id of the flag it stands for, so that
    /// a key is refused wherever its flag would be (`flag_rules`).
    pub fn keys(&self) -> Vec<(&'static str, &'static str)> {
        let t = &self.tiers;
        [
            (self.model.is_some(), "model", "model"),
            (self.threads.is_some(), "threads", "threads"),
            (
                t.chunk_tokens.is_some(),
                "tiers.chunk_tokens",
                "tier_chunk_tokens",
            ),
            (t.ram.is_some(), "tiers.ram", "tier_ram"),
            (t.disk.is_some(), "tiers.disk", "tier_disk"),
            (t.redis.is_some(), "tiers.redis", "tier_redis"),
        ]
        .into_iter()
        .filter(|(set, _, _)| *set)
        .map(|(_, key, id)| (key, id))
        .collect()
    }
}

impl TiersSection {
    /// The file's tiers as `(flag name, config)`, fastest first.
    pub fn tier_configs(&self) -> Result<Vec<(&'static str, TierConfig)>> {
        let mut out = Vec::new();
        if let Some(ram) = &self.ram {
            out.push(("ram", TierConfig::parse_ram(ram).context("tiers.ram")?));
        }
        if let Some(d) = &self.disk {
            let capacity_bytes = parse_byte_size(&d.capacity).context("tiers.disk.capacity")?;
            out.push((
                "disk",
                TierConfig::Disk {
                    dir: d.path.clone(),
                    capacity_bytes,
                    drop_page_cache: d.drop_page_cache,
                },
            ));
        }
        if let Some(r) = &self.redis {
            let mut config = TierConfig::parse_redis(&r.url).context("tiers.redis.url")?;
            if let TierConfig::Redis {
                capacity_bytes,
                key_prefix,
                ..
            } = &mut config
            {
                // A value in both places would leave the reader guessing which one wins.
                let twice = |key: &str| {
                    anyhow!("tiers.redis.{key} is given twice, in tiers.redis.url ({}) and in tiers.redis.{key}; give it once", r.url)
                };
                if let Some(c) = &r.capacity {
                    if capacity_bytes.is_some() {
                        return Err(twice("capacity"));
                    }
                    *capacity_bytes = Some(parse_byte_size(c).context("tiers.redis.capacity")?);
                }
                if let Some(p) = &r.prefix {
                    if key_prefix.is_some() {
                        return Err(twice("prefix"));
                    }
                    let p = parse_key_prefix(p).map_err(|e| anyhow!("tiers.redis.prefix: {e}"))?;
                    *key_prefix = Some(p);
                }
            }
            out.push(("redis", config));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::ModelArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        model: ModelArgs,
    }

    const FILE: &str = r#"
model = "/from/file.gguf"
threads = 3
[tiers]
chunk_tokens = 128
ram = "1GiB"
[tiers.disk]
path = "/tmp/pk-disk"
capacity = "2GiB"
drop_page_cache = true
[tiers.redis]
url = "redis://127.0.0.1:6391"
capacity = "8GiB"
prefix = "team:"
"#;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pagekeeper.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn parse(args: &[&str]) -> ModelArgs {
        Cli::try_parse_from(std::iter::once("pk").chain(args.iter().copied()))
            .unwrap()
            .model
            .resolved()
            .unwrap()
    }

    /// Flag > env > file > default, for every setting the file can hold. The only test in
    /// this crate that sets `PAGEKEEPER_*` variables, so parallel tests cannot see them.
    #[test]
    fn precedence_flags_env_file_defaults() {
        let (_dir, path) = write(FILE);
        let path = path.to_str().unwrap();
        for var in [
            "PAGEKEEPER_MODEL",
            "PAGEKEEPER_TIER_RAM",
            "PAGEKEEPER_TIER_DISK",
            "PAGEKEEPER_TIER_REDIS",
            "PAGEKEEPER_TIER_CHUNK_TOKENS",
            "PAGEKEEPER_CONFIG",
        ] {
            std::env::remove_var(var);
        }
        // In this order, one step's environment being the next one's starting point.
        defaults_without_file_or_flags();
        file_only(path);
        env_over_file(path);
        flags_over_env_and_file();
    }

    fn defaults_without_file_or_flags() {
        let a = parse(&[]);
        assert_eq!(
            (a.model, a.threads, a.tiers.chunk_tokens()),
            (None, None, 256)
        );
        assert!(a.tiers.tier_configs().unwrap().is_empty());
    }

    fn file_only(path: &str) {
        let a = parse(&["--config", path]);
        assert_eq!(a.model.as_deref(), Some(Path::new("/from/file.gguf")));
        assert_eq!((a.threads, a.tiers.chunk_tokens()), (Some(3), 128));
        let tiers: Vec<_> = a
            .tiers
            .tier_configs()
            .unwrap()
            .into_iter()
            .map(|t| t.1)
            .collect();
        assert_eq!(
            tiers,
            vec![
                TierConfig::Ram {
                    capacity_bytes: 1 << 30
                },
                TierConfig::Disk {
                    dir: "/tmp/pk-disk".into(),
                    capacity_bytes: 2 << 30,
                    drop_page_cache: true
                },
                TierConfig::Redis {
                    url: "redis://127.0.0.1:6391".into(),
                    capacity_bytes: Some(8 << 30),
                    key_prefix: Some("team:".into())
                },
            ]
        );
    }

    /// Env over file; the config file itself may come from the environment too. Leaves
    /// these variables set for `flags_over_env_and_file`.
    fn env_over_file(path: &str) {
        std::env::set_var("PAGEKEEPER_TIER_RAM", "512MiB");
        std::env::set_var("PAGEKEEPER_MODEL", "/from/env.gguf");
        std::env::set_var("PAGEKEEPER_CONFIG", path);
        let a = parse(&[]);
        assert_eq!(a.model.as_deref(), Some(Path::new("/from/env.gguf")));
        assert_eq!(
            a.tiers.tier_configs().unwrap()[0].1,
            TierConfig::Ram {
                capacity_bytes: 512 << 20
            }
        );
        assert_eq!(
            a.threads,
            Some(3),
            "settings env leaves alone still come from the file"
        );
    }

    /// Flags over env and file; a flag replaces the file's whole tier entry. Clears what
    /// `env_over_file` set.
    fn flags_over_env_and_file() {
        let a = parse(&[
            "--tier-ram",
            "64MiB",
            "--model",
            "/from/flag.gguf",
            "--threads",
            "1",
            "--tier-chunk-tokens",
            "64",
            "--tier-disk",
            "/flag/dir:1GiB",
        ]);
        for var in [
            "PAGEKEEPER_MODEL",
            "PAGEKEEPER_TIER_RAM",
            "PAGEKEEPER_CONFIG",
        ] {
            std::env::remove_var(var);
        }
        assert_eq!(a.model.as_deref(), Some(Path::new("/from/flag.gguf")));
        assert_eq!((a.threads, a.tiers.chunk_tokens()), (Some(1), 64));
        let tiers = a.tiers.tier_configs().unwrap();
        assert_eq!(
            tiers.iter().map(|t| t.0.as_str()).collect::<Vec<_>>(),
            ["--tier-ram", "--tier-disk", "tiers.redis (config file)"]
        );
        assert_eq!(
            tiers[0].1,
            TierConfig::Ram {
                capacity_bytes: 64 << 20
            }
        );
        assert_eq!(
            tiers[1].1,
            TierConfig::Disk {
                dir: "/flag/dir".into(),
                capacity_bytes: 1 << 30,
                drop_page_cache: false
            }
        );
        assert!(
            matches!(&tiers[2].1, TierConfig::Redis { key_prefix: Some(p), .. } if p == "team:")
        );
    }

    #[test]
    fn bad_files_fail_clearly() {
        for (text, expect) in [
            ("treads = 3\n", "unknown field `treads`"),
            ("[tiers]\nram = \"2XB\"\n", "tiers.ram"),
            ("[tiers.disk]\npath = \"/x\"\n", "missing field `capacity`"),
            ("[tiers.redis]\nurl = \"http://x\"\n", "tiers.redis.url"),
            (
                "[tiers.redis]\nurl = \"redis://h:1\"\nprefix = \"\"\n",
                "tiers.redis.prefix: the key prefix is empty",
            ),
            (
                "[tiers.redis]\nurl = \"redis://h:1?prefix=a:\"\nprefix = \"b:\"\n",
                "tiers.redis.prefix is given twice, in tiers.redis.url (redis://h:1?prefix=a:) and in tiers.redis.prefix",
            ),
            (
                "[tiers.redis]\nurl = \"redis://h:1?capacity=1GiB\"\ncapacity = \"2GiB\"\n",
                "tiers.redis.capacity is given twice",
            ),
            ("threads = \n", "parsing config file"),
        ] {
            let (_dir, path) = write(text);
            let err = format!("{:#}", FileConfig::load(&path).unwrap_err());
            assert!(err.contains(expect), "{text:?}: {err}");
        }
        let err = format!(
            "{:#}",
            FileConfig::load(Path::new("/nonexistent/pk.toml")).unwrap_err()
        );
        assert!(
            err.contains("reading config file /nonexistent/pk.toml"),
            "{err}"
        );
    }

    #[test]
    fn the_example_file_parses() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/pagekeeper.toml"
        );
        let file = FileConfig::load(Path::new(path)).unwrap();
        assert_eq!(file.tiers.tier_configs().unwrap().len(), 3);
    }
}
