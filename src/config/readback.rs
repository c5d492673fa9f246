//! The configuration as an operator reads it back from a running picker: the effective configuration
//! with anything secret redacted (`GET /debug/config`, the admin API's `Config`), and what a reload
//! changed, key by key, old → new.
//!
//! Both work on [`Config::to_yaml`]'s tree, so every key the file can set (defaults and derived values
//! included) is shown and compared without a list to keep in step with the schema.

use serde_yaml::Value;

use super::Config;

/// What replaces a secret.
pub const REDACTED: &str = "REDACTED";

/// Keys whose values are secrets wherever they appear. None of today's keys holds one (credentials
/// are read from files, whose paths are shown); the list guards what a new key might carry.
const SECRET_KEYS: [&str; 6] = [
    "password",
    "secret",
    "token",
    "api_key",
    "authorization",
    "bearer",
];

/// One key a reload changed, with its values as YAML scalars (`(unset)` where a side lacks the key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyChange {
    /// Dotted path with list indexes: `pools[0].policy.worker_queue_limit`.
    pub key: String,
    pub old: String,
    pub new: String,
}

impl Config {
    /// [`Config::to_yaml`] with secrets redacted: URL credentials and query strings (a worker's
    /// `metrics_url` may carry either), and the value of any key named like a secret.
    pub fn to_redacted_yaml(&self) -> String {
        let mut tree = self.tree();
        redact(&mut tree, None);
        serde_yaml::to_string(&tree)
            .unwrap_or_else(|error| format!("# cannot render the configuration: {error}\n"))
    }

    /// The effective configuration as a YAML tree, secrets redacted.
    fn tree(&self) -> Value {
        serde_yaml::from_str(&self.to_yaml()).unwrap_or(Value::Null)
    }
}

/// Every key whose value differs between `old` and `new`, in the order of `new`'s file (keys only
/// `old` has last); values redacted as in [`Config::to_redacted_yaml`].
pub fn changed_keys(old: &Config, new: &Config) -> Vec<KeyChange> {
    let (mut old_tree, mut new_tree) = (old.tree(), new.tree());
    redact(&mut old_tree, None);
    redact(&mut new_tree, None);
    let (mut before, mut after) = (Vec::new(), Vec::new());
    flatten(&old_tree, String::new(), &mut before);
    flatten(&new_tree, String::new(), &mut after);
    let unset = || "(unset)".to_owned();
    let value_of = |leaves: &[(String, String)], key: &str| {
        leaves
            .iter()
            .find(|(other, _)| other == key)
            .map(|(_, value)| value.clone())
    };
    let mut changes: Vec<KeyChange> = after
        .iter()
        .filter_map(|(key, new)| {
            let old = value_of(&before, key);
            (old.as_ref() != Some(new)).then(|| KeyChange {
                key: key.clone(),
                old: old.unwrap_or_else(unset),
                new: new.clone(),
            })
        })
        .collect();
    changes.extend(
        before
            .iter()
            .filter(|(key, _)| value_of(&after, key).is_none())
            .map(|(key, old)| KeyChange {
                key: key.clone(),
                old: old.clone(),
                new: unset(),
            }),
    );
    changes
}

fn redact(value: &mut Value, key: Option<&str>) {
    match value {
        Value::Mapping(mapping) => {
            for (name, child) in mapping.iter_mut() {
                redact(child, name.as_str());
            }
        }
        Value::Sequence(items) => items.iter_mut().for_each(|item| redact(item, key)),
        Value::String(text) => {
            if key.is_some_and(|key| SECRET_KEYS.contains(&key)) {
                *text = REDACTED.to_owned();
            } else if text.contains("://") {
                *text = redact_url(text);
            }
        }
        _ => {}
    }
}

/// `scheme://user:pass@host/path?query` → `scheme://REDACTED@host/path?REDACTED`.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((_, host)) => format!("{REDACTED}@{host}"),
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, _)) => format!("{path}?{REDACTED}"),
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

/// Every scalar leaf of `value` with its dotted path; an empty list or map is a leaf of its own.
fn flatten(value: &Value, path: String, out: &mut Vec<(String, String)>) {
    match value {
        Value::Mapping(mapping) if !mapping.is_empty() => {
            for (name, child) in mapping {
                let name = name.as_str().map_or_else(|| scalar(name), str::to_owned);
                let path = if path.is_empty() {
                    name
                } else {
                    format!("{path}.{name}")
                };
                flatten(child, path, out);
            }
        }
        Value::Sequence(items) if !items.is_empty() => {
            for (position, item) in items.iter().enumerate() {
                flatten(item, format!("{path}[{position}]"), out);
            }
        }
        leaf => out.push((path, scalar(leaf))),
    }
}

fn scalar(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => serde_yaml::to_string(other)
            .map(|text| text.trim_end().to_owned())
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{self, Overrides};

    fn config(yaml: &str) -> Config {
        config::parse(yaml, "test.yaml", &Overrides::default()).expect("valid config")
    }

    const FLEET: &str = "pools:\n  - model: m\n    engine: vllm\n    workers:\n      - {endpoint: \"10.0.0.1:8000\", metrics_url: \"http://scraper:s3cret@10.0.0.1:8000/metrics?key=abc\"}\n";

    #[test]
    fn url_credentials_and_queries_are_redacted_and_nothing_else() {
        let yaml = config(FLEET).to_redacted_yaml();
        assert!(!yaml.contains("s3cret") && !yaml.contains("abc"), "{yaml}");
        assert!(
            yaml.contains("http://REDACTED@10.0.0.1:8000/metrics?REDACTED"),
            "{yaml}"
        );
        // Everything else is the effective configuration as `check` prints it.
        assert!(yaml.contains("endpoint: 10.0.0.1:8000"), "{yaml}");
        assert!(yaml.contains("worker_queue_limit") || yaml.contains("policy:"));
        assert_eq!(
            redact_url("http://10.0.0.1:8000/metrics"),
            "http://10.0.0.1:8000/metrics"
        );
        let mut secret =
            serde_yaml::from_str::<Value>("auth: {token: hunter2, token_file: /t}").unwrap();
        redact(&mut secret, None);
        assert_eq!(secret["auth"]["token"], Value::from(REDACTED));
        assert_eq!(secret["auth"]["token_file"], Value::from("/t"));
    }

    #[test]
    fn a_reload_names_each_changed_key_old_to_new() {
        let old = config(FLEET);
        let new = config(
            &FLEET
                .replace(
                    "engine: vllm\n",
                    "engine: vllm\n    policy: {mode: cache_aware, worker_queue_limit: 9}\n",
                )
                .replace(
                    "      - {endpoint: \"10.0.0.1:8000\"",
                    "      - {endpoint: \"10.0.0.2:8000\"}\n      - {endpoint: \"10.0.0.1:8000\"",
                ),
        );
        let changes = changed_keys(&old, &new);
        assert!(changes.iter().all(|change| change.old != change.new));
        let limit = changes
            .iter()
            .find(|change| change.key.ends_with("worker_queue_limit"))
            .unwrap_or_else(|| panic!("{changes:?}"));
        assert_eq!(limit.new, "9");
        assert!(
            changes
                .iter()
                .any(|change| change.key == "pools[0].workers[1].endpoint"
                    && change.old == "(unset)"
                    && change.new == "10.0.0.1:8000"),
            "{changes:?}"
        );
        // Credentials stay out of the log too.
        assert!(
            changes
                .iter()
                .all(|change| !change.old.contains("s3cret") && !change.new.contains("s3cret"))
        );
        assert_eq!(changed_keys(&old, &config(FLEET)), Vec::new());
    }
}
