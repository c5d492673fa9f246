//! What can go wrong loading the configuration, and where each problem comes from.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    // The reason is in the message too: the binary prints only the top-level message.
    #[error("cannot read configuration file {}: {source}", .path.display())]
    Read { path: PathBuf, source: io::Error },
    /// Every problem found, in phase order: single values, then cross-field checks, then structure.
    #[error("invalid configuration in {file}:{}", lines(.problems))]
    Invalid {
        file: String,
        problems: Vec<Problem>,
    },
}

fn lines(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|problem| format!("\n  {problem}"))
        .collect()
}

/// One thing wrong with the configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub at: Origin,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.at, self.message)
    }
}

/// Where a value (or a problem) comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The file: a YAML path such as `pools[0].workers[1].endpoint` (empty for the whole document) and
    /// its 1-based line.
    Yaml { path: String, line: usize },
    /// A command-line flag such as `--worker-queue-limit`.
    Flag(&'static str),
    /// Given nowhere: the built-in default.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Yaml { path, line } if path.is_empty() => write!(f, "line {line}"),
            Origin::Yaml { path, line } => write!(f, "{path} (line {line})"),
            Origin::Flag(flag) => f.write_str(flag),
            Origin::Default => f.write_str("(default)"),
        }
    }
}

/// Problems are listed by phase, so that the root cause of a later check's failure comes first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// A value on its own: syntax, type, range, unknown and missing keys.
    Value,
    /// Values that must agree with each other.
    Cross,
    /// The shape of the pools: non-empty, unique, servable.
    Structure,
}

/// The problems found so far; loading succeeds only if there are none.
#[derive(Debug, Default)]
pub struct Problems(Vec<(Phase, Problem)>);

/// Proof that a problem has been recorded, so a value that failed its check can be skipped by the
/// checks depending on it without going unexplained.
#[derive(Clone, Copy, Debug)]
pub struct Reported(());

/// A value, or the news that its problem is already recorded.
pub type Res<T> = Result<T, Reported>;

impl Problems {
    pub fn report(&mut self, phase: Phase, at: Origin, message: impl Into<String>) -> Reported {
        let message = message.into();
        self.0.push((phase, Problem { at, message }));
        Reported(())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// In phase order; within a phase, flags first, then in document order.
    pub fn into_sorted(mut self) -> Vec<Problem> {
        self.0.sort_by_key(|(phase, problem)| match problem.at {
            Origin::Yaml { line, .. } => (*phase, line),
            Origin::Flag(_) | Origin::Default => (*phase, 0),
        });
        self.0.into_iter().map(|(_, problem)| problem).collect()
    }
}
