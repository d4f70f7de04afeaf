//! The flag walk's first half (issue 34): clap's command tree, walked, against the table in
//! `crates/cli/tests/flag_walk/table.rs`. Every flag of every subcommand must have an
//! entry, so a new flag fails here until it is classified; every rule of
//! [`crate::flag_rules::RULES`] must have a refusal there; every entry must parse. The
//! second half, `crates/cli/tests/flag_walk.rs`, runs the entries against the binary.

#[path = "../tests/flag_walk/table.rs"]
mod table;

use std::collections::BTreeSet;

use clap::{Command, CommandFactory, FromArgMatches};
use table::{How, TABLE};

/// The whole command tree without environment variables: config.rs's test sets some of
/// them while other tests run, and a walk must not depend on the environment.
fn tree() -> Command {
    fn strip(cmd: Command) -> Command {
        cmd.mut_args(|a| a.env(None)).mut_subcommands(strip)
    }
    let mut cmd = strip(crate::Cli::command());
    cmd.build();
    cmd
}

/// Every (subcommand path, long flag) of the tree; "" is `pagekeeper` itself.
fn walk(cmd: &Command, path: &str, out: &mut BTreeSet<(String, String)>) {
    for arg in cmd.get_arguments() {
        let flag = arg
            .get_long()
            .map_or_else(|| arg.get_id().to_string(), |l| format!("--{l}"));
        out.insert((path.to_owned(), flag));
    }
    for sub in cmd.get_subcommands() {
        let name = sub.get_name();
        let sub_path = if path.is_empty() {
            name.to_owned()
        } else {
            format!("{path} {name}")
        };
        walk(sub, &sub_path, out);
    }
}

fn classified() -> BTreeSet<(String, String)> {
    TABLE
        .iter()
        .map(|e| (e.command.to_owned(), e.flag.to_owned()))
        .collect()
}

/// The subcommand at `path` ("bench perf").
fn find<'a>(root: &'a Command, path: &str) -> &'a Command {
    path.split_whitespace().fold(root, |cmd, name| {
        cmd.find_subcommand(name)
            .unwrap_or_else(|| panic!("no subcommand {path:?}"))
    })
}

#[test]
fn every_flag_of_every_subcommand_is_classified() {
    let mut flags = BTreeSet::new();
    walk(&tree(), "", &mut flags);
    let table = classified();
    let missing: Vec<_> = flags.difference(&table).collect();
    assert!(
        missing.is_empty(),
        "flags with no entry in tests/flag_walk/table.rs (say how each is honoured or refused): {missing:?}"
    );
    let stale: Vec<_> = table.difference(&flags).collect();
    assert!(
        stale.is_empty(),
        "entries for flags that do not exist: {stale:?}"
    );
}

/// Each refusal of the rules table is run by the flag walk, and its conditions name
/// arguments that the command has.
#[test]
fn every_rule_has_a_refusal_in_the_table() {
    let root = tree();
    for rule in crate::flag_rules::RULES {
        let cmd = find(&root, rule.command);
        let long = |id: &str| {
            let arg = cmd.get_arguments().find(|a| a.get_id() == id);
            let arg = arg.unwrap_or_else(|| panic!("`{}` has no argument {id}", rule.command));
            format!("--{}", arg.get_long().expect("a flag"))
        };
        for when in rule.when {
            use crate::flag_rules::When::*;
            let (Given(id) | NotGiven(id) | Is(id, _) | IsNot(id, _)) = *when;
            long(id);
        }
        for id in rule.args {
            let flag = long(id);
            let refused = TABLE.iter().any(|e| {
                e.command == rule.command
                    && e.flag == flag
                    && matches!(e.how, How::Refused { .. } | How::RefusedEnv { .. })
            });
            assert!(refused, "no Refused entry for `{}` {flag}", rule.command);
        }
    }
}

/// The arguments an entry runs, each list with what it must contain.
fn runs(how: &How) -> Vec<&'static [&'static str]> {
    match how {
        How::Output { base, with } | How::Json { base, with, .. } => vec![base, with],
        How::Reuse { args, without: [] } => vec![args],
        How::Reuse { args, without } => vec![args, without],
        How::Refused { args } | How::RefusedEnv { args, .. } | How::Read { args, .. } => {
            vec![args]
        }
        How::Clap | How::Test { .. } | How::SameAs { .. } | How::Unchecked { .. } => vec![],
    }
}

/// Whether `args` gives `flag` (as `--flag` or `--flag=value`).
fn gives(args: &[&str], flag: &str) -> bool {
    args.iter()
        .any(|a| *a == flag || a.strip_prefix(flag).is_some_and(|r| r.starts_with('=')))
}

/// Every entry's arguments parse, name its command and give its flag; where a rule of
/// `flag_rules` refuses them, its message names the flag.
#[test]
fn every_entry_parses_and_gives_its_flag() {
    let root = tree();
    for e in TABLE {
        let runs = runs(&e.how);
        for (i, args) in runs.iter().enumerate() {
            let words: Vec<&str> = e.command.split_whitespace().collect();
            assert!(args.starts_with(&words), "{e:?}: not `{}`", e.command);
            let parsed = root
                .clone()
                .try_get_matches_from(std::iter::once("pagekeeper").chain(args.iter().copied()));
            let matches = match (parsed, &e.how) {
                (Ok(m), _) => m,
                // clap itself refuses it (a conflict): the error must be the one expected.
                (Err(err), How::Read { error, .. }) if err.to_string().contains(error) => continue,
                (Err(err), _) => panic!("{e:?}: {args:?} does not parse: {err}"),
            };
            crate::Cli::from_arg_matches(&matches).unwrap();
            let refusal = crate::flag_rules::check(&root, &matches);
            let placeholders = args.iter().any(|a| a.contains('{'));
            if let (Err(err), false) = (refusal, placeholders) {
                assert!(err.to_string().contains(e.flag), "{e:?}: {err}");
            }
            // The first list (the "with" run, or the only one) gives the flag, directly
            // or through a config file's key; `RefusedEnv` gives it through its variable.
            let with = match e.how {
                How::RefusedEnv { .. } => continue,
                How::Output { with, .. } | How::Json { with, .. } => with,
                _ if i == 0 => args,
                _ => continue,
            };
            let given = gives(with, e.flag) || gives(with, "--config");
            assert!(given, "{e:?}: {with:?} does not give the flag");
        }
        check_fields(e);
    }
}

/// What each kind of entry says beyond its arguments is well formed.
fn check_fields(e: &table::Entry) {
    match e.how {
        How::Output { base, with } => assert_ne!(base, with, "{e:?}"),
        How::Json {
            base,
            with,
            pointer,
        } => {
            assert_ne!(base, with, "{e:?}");
            assert!(pointer.starts_with('/'), "{e:?}: not a JSON pointer");
        }
        How::RefusedEnv { var, value, .. } => {
            // The variable is the flag's own (the tree in `root` has them stripped).
            let real = crate::Cli::command();
            let cmd = find(&real, e.command);
            let long = e.flag.trim_start_matches("--");
            let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long));
            let env = arg.and_then(|a| a.get_env()).map(|v| v.to_string_lossy());
            assert_eq!(env.as_deref(), Some(var), "{e:?}");
            assert!(!value.is_empty(), "{e:?}");
        }
        How::Read { error, .. } => assert!(!error.is_empty(), "{e:?}"),
        How::Unchecked { why } => assert!(why.len() > 20, "{e:?}: say why"),
        _ => {}
    }
}

/// A pointer names a test that exists; `SameAs` names a command whose entry for the same
/// flag shows it honoured.
#[test]
fn every_pointer_leads_somewhere() {
    for e in TABLE {
        match e.how {
            How::Test { file, name } => {
                let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|err| panic!("{e:?}: {}: {err}", path.display()));
                assert!(
                    text.contains(&format!("fn {name}(")),
                    "{e:?}: no test {name}"
                );
            }
            How::SameAs { command } => {
                let shown = TABLE.iter().any(|o| {
                    o.command == command
                        && o.flag == e.flag
                        && matches!(
                            o.how,
                            How::Output { .. }
                                | How::Json { .. }
                                | How::Reuse { .. }
                                | How::Test { .. }
                        )
                });
                assert!(shown, "{e:?}: `{command}` shows nothing for {}", e.flag);
            }
            _ => {}
        }
    }
}
