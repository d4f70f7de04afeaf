//! What the examples' argument parsing shares (the engine's examples and `pk-eval`'s
//! `task_probe`, which compiles this file too).

/// A comma-separated list given as one argument (`4096,8192`), for clap's `value_parser`: a
/// field typed `::std::vec::Vec<T>` with this parser takes one argument, where a plain
/// `Vec` positional would swallow the arguments after it.
pub fn comma_list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, String>
where
    T::Err: std::fmt::Display,
{
    s.split(',')
        .map(|x| x.parse().map_err(|e| format!("{x:?}: {e}")))
        .collect()
}
