//! What each engine reports, read into per-rank load samples.
//!
//! vLLM and SGLang name their gauges differently and label data-parallel ranks differently (vLLM's
//! `engine`, SGLang's `dp_rank`). Within one DP rank, tensor- and pipeline-parallel schedulers repeat the
//! same numbers — under DP attention SGLang labels each with its global `tp_rank`, so rank 1 of a tp=4,
//! dp=2 server reports as `tp_rank` 2 and 3 — and the series with the lowest `(tp_rank, pp_rank)` is read.
//! A series without a rank label is rank 0: a worker configured with `dp_size > 1` whose engine
//! publishes one aggregate series therefore never has a complete reading, which is the honest answer —
//! configure `dp_size: 1` for such an engine. A rank at or beyond `dp_size` is an error rather than
//! something to skip: dropping it would make a worker with a too-small `dp_size` look idler than it is.
use serde::Deserialize;
use thiserror::Error;

use super::prom;
use crate::worker::Engine;

/// One data-parallel rank's numbers from one scrape.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankLoad {
    pub waiting: u64,
    pub running: u64,
    pub waiting_uncached_tokens: Option<u64>,
    pub used_tokens: Option<u64>,
    /// KV-cache usage in `[0, 1]`, as the engine reports it.
    pub kv_usage: Option<f64>,
    /// KV-cache capacity in tokens.
    pub max_total_tokens: Option<u64>,
    pub max_running: Option<u64>,
    /// The engine's KV block (vLLM's `block_size`, SGLang's `page_size` in `cache_config_info`): it
    /// reuses a cached prefix in whole blocks only.
    pub block_size: Option<u64>,
}

/// The ranks one scrape reported, indexed by rank; `None` for a rank the response did not cover.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub ranks: Vec<Option<RankLoad>>,
    /// Lines or entries that could not be read.
    pub malformed: usize,
    /// What tells one run of the engine from the next.
    pub identity: Identity,
    /// Cumulative prefill counters, summed over every series, from which the prefill rate is learned.
    pub progress: Progress,
}

/// An engine's cumulative prefill counters, summed over its ranks: prompt tokens, the part of them the
/// prefix cache served, and requests that produced their first token. Every replica scraping the worker
/// sees the same numbers, so what is learned from them is shared without talking to one another.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Progress {
    /// `prompt_tokens_total` (vLLM V1 counts a prompt when its prefill completes).
    pub prompt_tokens: Option<f64>,
    /// Prompt tokens the prefix cache served: vLLM's `prefix_cache_hits_total`, SGLang's
    /// `cached_tokens_total`.
    pub cached_tokens: Option<f64>,
    /// `time_to_first_token_seconds_count`: requests whose prefill completed.
    pub first_tokens: Option<f64>,
    /// vLLM's `prefix_cache_queries_total`: prompt tokens looked up when a request is scheduled. vLLM
    /// counts `prompt_tokens_total` when the prefill completes, so the difference is the prompt tokens
    /// of the prefills in progress.
    pub queried_tokens: Option<f64>,
    /// The engine's own measure of its prefills, observed when each request finishes (vLLM ≥ 0.13):
    /// the seconds from first scheduled to first token (`request_prefill_time_seconds`), summed and
    /// counted, and the uncached tokens those prefills computed (`request_prefill_kv_computed_tokens`).
    pub prefill: Histograms,
    /// The time finished requests waited in the engine's queue (`request_queue_time_seconds`).
    pub queue: Histograms,
}

/// A histogram pair's `_sum` and `_count` (and, for the prefill, the computed tokens' `_sum`), summed
/// over every series; `None` where the engine has no such series.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Histograms {
    pub seconds: Option<f64>,
    pub requests: Option<f64>,
    /// Prefill only: uncached tokens computed.
    pub tokens: Option<f64>,
}

impl Progress {
    /// Prompt tokens the engine had to compute: prompt minus cached, when both are reported.
    pub fn uncached_tokens(&self) -> Option<f64> {
        Some(self.prompt_tokens? - self.cached_tokens?)
    }

    /// Prompt tokens of the requests whose prefill is under way (cached part included), where the
    /// engine counts lookups at scheduling and prompts at completion (vLLM).
    pub fn prefilling_tokens(&self) -> Option<f64> {
        Some((self.queried_tokens? - self.prompt_tokens?).max(0.0))
    }
}

/// What tells one run of an engine from the next: a restart resets both.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Identity {
    /// `process_start_time_seconds` (the Prometheus client's process collector), the latest of them.
    pub start_time: Option<f64>,
    /// The engine's prompt-token counter, summed over its series: it only grows while the engine runs.
    pub served: Option<f64>,
}

impl Identity {
    /// Folds in one series of the start time (`start`) or of the prompt-token counter; a value that is
    /// not a number is ignored.
    fn note(&mut self, start: bool, value: f64) {
        if !value.is_finite() {
            return;
        }
        let field = if start {
            &mut self.start_time
        } else {
            &mut self.served
        };
        *field = Some(match *field {
            // The latest start: a worker's API server may outlive its engine core.
            Some(kept) if start => f64::max(kept, value),
            Some(kept) => kept + value,
            None => value,
        });
    }

    /// Whether `self`, read after `earlier`, is another run of the engine: its start time moved, or its
    /// counter went backwards.
    pub fn restarted_since(&self, earlier: &Identity) -> bool {
        let moved = matches!((earlier.start_time, self.start_time),
            (Some(before), Some(now)) if (now - before).abs() > START_TIME_JITTER);
        let went_back = matches!((earlier.served, self.served),
            (Some(before), Some(now)) if now < before);
        moved || went_back
    }
}

/// Start times are floats computed from `/proc`; the same process reports the same value, but a
/// scrape through another process's collector may round differently.
const START_TIME_JITTER: f64 = 1e-3;

/// The process collector's series, the same for every engine.
const START_TIME: &str = "process_start_time_seconds";

#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ExtractError {
    /// The response parsed, but no rank has both its waiting and its running count.
    #[error("no rank reports both {waiting} and {running}")]
    MissingSeries {
        waiting: &'static str,
        running: &'static str,
    },
    #[error("invalid /v1/loads JSON: {0}")]
    Json(String),
    #[error(
        "reports data-parallel rank {rank} but dp_size is {dp_size}: set dp_size to the number of ranks \
         this endpoint reports"
    )]
    UnexpectedRank { rank: u64, dp_size: u32 },
}

/// The series names of one engine's `/metrics`.
struct Names {
    waiting: &'static str,
    running: &'static str,
    /// KV usage in [0, 1]; the first present one wins.
    kv_usage: &'static [&'static str],
    used_tokens: Option<&'static str>,
    max_total_tokens: Option<&'static str>,
    max_running: Option<&'static str>,
    /// `cache_config_info`, and the labels whose product is the KV capacity in tokens.
    cache_info: &'static str,
    cache_info_labels: (&'static str, &'static str),
    /// Labels naming the data-parallel rank, tried in order.
    rank_labels: &'static [&'static str],
    /// A counter that grows while the engine runs and starts from zero with it: prompt tokens.
    served: &'static str,
    /// The prompt tokens served from the prefix cache.
    cached: &'static str,
    /// The first-token histogram's count.
    first_tokens: &'static str,
    /// Prompt tokens looked up in the prefix cache at scheduling, where the engine reports them.
    queried: Option<&'static str>,
    /// The per-request prefill histograms' `_sum` and `_count`, and the computed tokens' `_sum`.
    prefill: Option<HistogramNames>,
    /// The per-request queue-time histogram's `_sum` and `_count`.
    queue: Option<(&'static str, &'static str)>,
}

/// Where an engine reports its prefills per request.
struct HistogramNames {
    seconds: &'static str,
    requests: &'static str,
    tokens: &'static str,
}

const VLLM: Names = Names {
    waiting: "vllm:num_requests_waiting",
    running: "vllm:num_requests_running",
    // `gpu_cache_usage_perc` is the deprecated name older releases still emit.
    kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    used_tokens: None,
    max_total_tokens: None,
    max_running: None,
    cache_info: "vllm:cache_config_info",
    cache_info_labels: ("block_size", "num_gpu_blocks"),
    rank_labels: &["engine", "dp_rank"],
    served: "vllm:prompt_tokens_total",
    cached: "vllm:prefix_cache_hits_total",
    first_tokens: "vllm:time_to_first_token_seconds_count",
    queried: Some("vllm:prefix_cache_queries_total"),
    prefill: Some(HistogramNames {
        seconds: "vllm:request_prefill_time_seconds_sum",
        requests: "vllm:request_prefill_time_seconds_count",
        tokens: "vllm:request_prefill_kv_computed_tokens_sum",
    }),
    queue: Some((
        "vllm:request_queue_time_seconds_sum",
        "vllm:request_queue_time_seconds_count",
    )),
};

const SGLANG: Names = Names {
    waiting: "sglang:num_queue_reqs",
    running: "sglang:num_running_reqs",
    kv_usage: &["sglang:token_usage"],
    used_tokens: Some("sglang:num_used_tokens"),
    max_total_tokens: Some("sglang:max_total_num_tokens"),
    max_running: Some("sglang:max_running_requests"),
    cache_info: "sglang:cache_config_info",
    cache_info_labels: ("page_size", "num_pages"),
    rank_labels: &["dp_rank"],
    served: "sglang:prompt_tokens_total",
    cached: "sglang:cached_tokens_total",
    first_tokens: "sglang:time_to_first_token_seconds_count",
    queried: None,
    // SGLang times its prefill per stage of a request (`per_stage_req_latency_seconds`), not per
    // request from schedule to first token; its rate is learned from its queue's drain.
    prefill: None,
    queue: Some((
        "sglang:queue_time_seconds_sum",
        "sglang:queue_time_seconds_count",
    )),
};

impl Names {
    fn of(engine: Engine) -> &'static Names {
        match engine {
            Engine::Vllm => &VLLM,
            Engine::Sglang => &SGLANG,
        }
    }

    /// The `Progress` field a summed counter or histogram series goes to, if `name` is one.
    fn summed<'p>(&self, name: &str, progress: &'p mut Progress) -> Option<&'p mut Option<f64>> {
        if name == self.cached {
            return Some(&mut progress.cached_tokens);
        }
        if name == self.first_tokens {
            return Some(&mut progress.first_tokens);
        }
        if Some(name) == self.queried {
            return Some(&mut progress.queried_tokens);
        }
        if let Some(prefill) = &self.prefill {
            if name == prefill.seconds {
                return Some(&mut progress.prefill.seconds);
            }
            if name == prefill.requests {
                return Some(&mut progress.prefill.requests);
            }
            if name == prefill.tokens {
                return Some(&mut progress.prefill.tokens);
            }
        }
        match self.queue {
            Some((seconds, _)) if name == seconds => Some(&mut progress.queue.seconds),
            Some((_, requests)) if name == requests => Some(&mut progress.queue.requests),
            _ => None,
        }
    }

    fn wants(&self, name: &str) -> bool {
        self.summed(name, &mut Progress::default()).is_some()
            || name == self.waiting
            || name == self.running
            || self.kv_usage.contains(&name)
            || Some(name) == self.used_tokens
            || Some(name) == self.max_total_tokens
            || Some(name) == self.max_running
            || name == self.cache_info
            || name == self.served
            || name == START_TIME
    }
}

/// Which copy of a rank's numbers a series is: `(tp_rank, pp_rank)`, absent labels as 0. The lowest wins.
impl Partial {
    /// The info metric's capacity (block size × blocks, from the `(block, blocks)` labels) and block
    /// size; a block of 0 or a label that is not a number says nothing.
    fn note_cache_info(
        &mut self,
        sample: &prom::Sample<'_>,
        (block, blocks): (&str, &str),
        replica: Replica,
    ) {
        let size = sample
            .label(block)
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|size| *size > 0);
        let tokens = size
            .zip(sample.label(blocks).and_then(|v| v.parse::<u64>().ok()))
            .map(|(size, count)| size.saturating_mul(count));
        if let Some(tokens) = tokens {
            keep(&mut self.cache_info_tokens, replica, tokens);
        }
        if let Some(size) = size {
            keep(&mut self.block_size, replica, size);
        }
    }
}

type Replica = (u64, u64);

/// A value and the copy it came from; a lower-ordered copy replaces it.
type Kept<T> = Option<(Replica, T)>;

fn keep<T>(field: &mut Kept<T>, replica: Replica, value: T) {
    if field.as_ref().is_none_or(|(kept, _)| replica < *kept) {
        *field = Some((replica, value));
    }
}

/// Per-rank values gathered from the series, before the required ones are checked.
#[derive(Clone, Copy, Debug, Default)]
struct Partial {
    waiting: Kept<u64>,
    running: Kept<u64>,
    used_tokens: Kept<u64>,
    /// Keyed by the name's position in `kv_usage` first: the current name beats the deprecated one.
    kv_usage: Option<((usize, Replica), f64)>,
    max_total_tokens: Kept<u64>,
    cache_info_tokens: Kept<u64>,
    block_size: Kept<u64>,
    max_running: Kept<u64>,
}

/// Reads an engine's Prometheus exposition into the ranks `0..dp_size`.
pub fn from_metrics(engine: Engine, text: &str, dp_size: u32) -> Result<Report, ExtractError> {
    let names = Names::of(engine);
    let mut partial = vec![Partial::default(); dp_size as usize];
    let mut samples = prom::samples(text, |name| names.wants(name));
    let mut malformed = 0;
    let mut identity = Identity::default();
    let mut progress = Progress::default();
    for sample in samples.by_ref() {
        if let Some(field) = names.summed(sample.name, &mut progress) {
            if sample.value.is_finite() && sample.value >= 0.0 {
                *field = Some(field.unwrap_or(0.0) + sample.value);
            }
            continue;
        }
        if sample.name == START_TIME || sample.name == names.served {
            identity.note(sample.name == START_TIME, sample.value);
            continue;
        }
        let number = |label: &str| sample.label(label).map(|value| value.parse::<u64>().ok());
        let rank = match names.rank_labels.iter().find_map(|label| number(label)) {
            None => 0,
            Some(Some(rank)) => rank,
            Some(None) => {
                malformed += 1;
                continue;
            }
        };
        let Some(slot) = usize::try_from(rank)
            .ok()
            .and_then(|rank| partial.get_mut(rank))
        else {
            return Err(ExtractError::UnexpectedRank { rank, dp_size });
        };
        let replica = (
            number("tp_rank").flatten().unwrap_or(0),
            number("pp_rank").flatten().unwrap_or(0),
        );
        let name = sample.name;
        if name == names.cache_info {
            slot.note_cache_info(&sample, names.cache_info_labels, replica);
            continue;
        }
        if let Some(priority) = names.kv_usage.iter().position(|n| *n == name) {
            let key = (priority, replica);
            if sample.value.is_finite() && slot.kv_usage.is_none_or(|(kept, _)| key < kept) {
                slot.kv_usage = Some((key, sample.value.clamp(0.0, 1.0)));
            }
            continue;
        }
        let Some(count) = count(sample.value) else {
            malformed += 1;
            continue;
        };
        let field = if name == names.waiting {
            &mut slot.waiting
        } else if name == names.running {
            &mut slot.running
        } else if Some(name) == names.used_tokens {
            &mut slot.used_tokens
        } else if Some(name) == names.max_total_tokens {
            &mut slot.max_total_tokens
        } else {
            &mut slot.max_running
        };
        // Several series of one copy (another model name, say): the first is kept.
        keep(field, replica, count);
    }
    malformed += samples.malformed();

    let ranks: Vec<Option<RankLoad>> = partial.iter().map(complete_rank).collect();
    if ranks.iter().all(Option::is_none) {
        return Err(ExtractError::MissingSeries {
            waiting: names.waiting,
            running: names.running,
        });
    }
    progress.prompt_tokens = identity.served;
    // SGLang creates `cached_tokens_total` at its first cache hit: until then a worker reporting prompt
    // tokens has had none cached, not an unknown number (its rate is learnable from the start).
    if engine == Engine::Sglang && progress.prompt_tokens.is_some() {
        progress.cached_tokens.get_or_insert(0.0);
    }
    Ok(Report {
        ranks,
        malformed,
        identity,
        progress,
    })
}

fn complete_rank(partial: &Partial) -> Option<RankLoad> {
    let value = |kept: Kept<u64>| kept.map(|(_, value)| value);
    let max_total_tokens = value(partial.max_total_tokens).or(value(partial.cache_info_tokens));
    let kv_usage = partial.kv_usage.map(|(_, usage)| usage);
    let used_tokens = value(partial.used_tokens).or_else(|| {
        let (usage, capacity) = kv_usage.zip(max_total_tokens)?;
        Some((usage * capacity as f64).round() as u64)
    });
    Some(RankLoad {
        waiting: value(partial.waiting)?,
        running: value(partial.running)?,
        waiting_uncached_tokens: None,
        used_tokens,
        kv_usage,
        max_total_tokens,
        max_running: value(partial.max_running),
        block_size: value(partial.block_size),
    })
}

/// A gauge read as a count: finite and non-negative, rounded.
fn count(value: f64) -> Option<u64> {
    (value.is_finite() && value >= 0.0).then(|| value.round() as u64)
}

/// One rank of SGLang's `/v1/loads`. Fields are optional because releases differ in what they include.
#[derive(Deserialize)]
struct LoadsRank {
    dp_rank: Option<u64>,
    num_waiting_reqs: Option<f64>,
    num_running_reqs: Option<f64>,
    num_waiting_uncached_tokens: Option<f64>,
    num_used_tokens: Option<f64>,
    max_total_num_tokens: Option<f64>,
    max_running_requests: Option<f64>,
    token_usage: Option<f64>,
}

/// `/v1/loads` is a per-rank array, bare or under `loads` depending on the release.
#[derive(Deserialize)]
#[serde(untagged)]
enum LoadsBody {
    Ranks(Vec<LoadsRank>),
    Wrapped { loads: Vec<LoadsRank> },
}

/// Reads SGLang's `/v1/loads` JSON into the ranks `0..dp_size`. It carries the uncached-token queue depth
/// the metrics endpoint lacks.
pub fn from_loads_json(body: &[u8], dp_size: u32) -> Result<Report, ExtractError> {
    let parsed: LoadsBody =
        serde_json::from_slice(body).map_err(|error| ExtractError::Json(error.to_string()))?;
    let entries = match parsed {
        LoadsBody::Ranks(ranks) | LoadsBody::Wrapped { loads: ranks } => ranks,
    };
    let mut ranks = vec![None; dp_size as usize];
    let mut malformed = 0;
    for (position, entry) in entries.iter().enumerate() {
        let rank = entry.dp_rank.unwrap_or(position as u64);
        if rank >= u64::from(dp_size) {
            return Err(ExtractError::UnexpectedRank { rank, dp_size });
        }
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        let load = entry
            .num_waiting_reqs
            .and_then(count)
            .zip(entry.num_running_reqs.and_then(count));
        match (ranks.get_mut(rank), load) {
            (Some(slot @ None), Some((waiting, running))) => {
                *slot = Some(RankLoad {
                    waiting,
                    running,
                    waiting_uncached_tokens: entry.num_waiting_uncached_tokens.and_then(count),
                    used_tokens: entry.num_used_tokens.and_then(count),
                    kv_usage: entry
                        .token_usage
                        .filter(|usage| usage.is_finite())
                        .map(|usage| usage.clamp(0.0, 1.0)),
                    max_total_tokens: entry.max_total_num_tokens.and_then(count),
                    max_running: entry.max_running_requests.and_then(count),
                    block_size: None,
                });
            }
            _ => malformed += 1,
        }
    }
    if ranks.iter().all(Option::is_none) {
        return Err(ExtractError::MissingSeries {
            waiting: "num_waiting_reqs",
            running: "num_running_reqs",
        });
    }
    // `/v1/loads` carries no process identity; restarts of such workers are seen by their KV events.
    Ok(Report {
        ranks,
        malformed,
        identity: Identity::default(),
        progress: Progress::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_falls_back_to_the_deprecated_kv_usage_name() {
        let text = "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.5\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\n";
        let report = from_metrics(Engine::Vllm, text, 1).unwrap();
        let rank = report.ranks[0].unwrap();
        assert_eq!(
            (rank.kv_usage, rank.used_tokens, rank.max_total_tokens),
            (Some(0.5), Some(800), Some(1600))
        );
    }

    #[test]
    fn the_current_kv_usage_name_wins_over_the_deprecated_one_in_either_order() {
        for text in [
            "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.2\n",
            "vllm:kv_cache_usage_perc 0.2\nvllm:gpu_cache_usage_perc 0.9\n",
        ] {
            let text = format!("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n{text}");
            let report = from_metrics(Engine::Vllm, &text, 1).unwrap();
            assert_eq!(report.ranks[0].unwrap().kv_usage, Some(0.2));
        }
    }

    #[test]
    fn an_unreadable_rank_or_a_negative_gauge_is_counted_as_malformed() {
        let text = "sglang:num_queue_reqs{dp_rank=\"0\"} 1\nsglang:num_running_reqs{dp_rank=\"0\"} 1\n\
                    sglang:num_running_reqs{dp_rank=\"x\"} 1\nsglang:num_used_tokens{dp_rank=\"0\"} -5\n";
        let report = from_metrics(Engine::Sglang, text, 1).unwrap();
        assert_eq!(report.malformed, 2);
        assert_eq!(report.ranks[0].unwrap().used_tokens, None);
    }

    #[test]
    fn a_rank_beyond_dp_size_is_an_error_not_a_partial_load() {
        let text = "vllm:num_requests_waiting{engine=\"0\"} 1\nvllm:num_requests_running{engine=\"0\"} 1\n\
                    vllm:num_requests_waiting{engine=\"1\"} 50\nvllm:num_requests_running{engine=\"1\"} 1\n";
        let error = from_metrics(Engine::Vllm, text, 1).unwrap_err();
        assert_eq!(
            error,
            ExtractError::UnexpectedRank {
                rank: 1,
                dp_size: 1
            }
        );
        assert!(error.to_string().contains("set dp_size"));
        let json = br#"[{"dp_rank": 3, "num_waiting_reqs": 1, "num_running_reqs": 1}]"#;
        assert!(matches!(
            from_loads_json(json, 2),
            Err(ExtractError::UnexpectedRank {
                rank: 3,
                dp_size: 2
            })
        ));
    }

    #[test]
    fn under_dp_attention_each_rank_is_read_from_its_lowest_tensor_parallel_scheduler() {
        // tp=4, dp=2 with DP attention: rank 1's schedulers carry global tp_rank 2 and 3.
        let mut text = String::new();
        for (dp, tp, queued) in [(1, 3, 9), (0, 0, 2), (0, 1, 2), (1, 2, 5)] {
            let labels = format!("dp_rank=\"{dp}\",tp_rank=\"{tp}\"");
            text.push_str(&format!(
                "sglang:num_queue_reqs{{{labels}}} {queued}\nsglang:num_running_reqs{{{labels}}} 1\n"
            ));
        }
        let report = from_metrics(Engine::Sglang, &text, 2).unwrap();
        assert_eq!(report.ranks[0].unwrap().waiting, 2);
        assert_eq!(
            report.ranks[1].unwrap().waiting,
            5,
            "tp_rank 2 wins over 3 in any order"
        );
    }

    #[test]
    fn sglang_without_a_cache_hit_yet_has_cached_none_of_its_prompt_tokens() {
        let text = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\n\
                    sglang:prompt_tokens_total{model_name=\"m\"} 5000\n";
        let progress = from_metrics(Engine::Sglang, text, 1).unwrap().progress;
        assert_eq!(progress.uncached_tokens(), Some(5000.0));
        let hit = format!("{text}sglang:cached_tokens_total{{model_name=\"m\"}} 1200\n");
        let progress = from_metrics(Engine::Sglang, &hit, 1).unwrap().progress;
        assert_eq!(progress.uncached_tokens(), Some(3800.0));
        // vLLM always writes its hit counter: one missing means the reading cannot say.
        let vllm = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:prompt_tokens_total 5000\n";
        let progress = from_metrics(Engine::Vllm, vllm, 1).unwrap().progress;
        assert_eq!(progress.uncached_tokens(), None);
    }

    #[test]
    fn sglang_capacity_comes_from_cache_config_info_when_the_gauge_is_missing() {
        let text = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\nsglang:token_usage 0.25\n\
                    sglang:cache_config_info{page_size=\"1\",num_pages=\"4000\"} 1\n";
        let rank = from_metrics(Engine::Sglang, text, 1).unwrap().ranks[0].unwrap();
        assert_eq!(
            (rank.max_total_tokens, rank.used_tokens),
            (Some(4000), Some(1000))
        );
    }

    #[test]
    fn a_rank_missing_either_count_is_absent_and_none_at_all_is_an_error() {
        let text = "vllm:num_requests_waiting{engine=\"0\"} 1\nvllm:num_requests_running{engine=\"0\"} 1\n\
                    vllm:num_requests_waiting{engine=\"1\"} 1\n";
        let report = from_metrics(Engine::Vllm, text, 2).unwrap();
        assert!(report.ranks[0].is_some() && report.ranks[1].is_none());
        assert!(matches!(
            from_metrics(Engine::Vllm, "vllm:num_requests_waiting 1\n", 1),
            Err(ExtractError::MissingSeries { .. })
        ));
    }

    #[test]
    fn loads_json_is_read_bare_or_wrapped_and_positions_stand_in_for_missing_ranks() {
        let bare = br#"[{"num_waiting_reqs": 2, "num_running_reqs": 1}, {"num_waiting_reqs": 3, "num_running_reqs": 4}]"#;
        let report = from_loads_json(bare, 2).unwrap();
        assert_eq!(report.ranks[1].unwrap().waiting, 3);
        let wrapped = br#"{"loads": [{"dp_rank": 1, "num_waiting_reqs": 5, "num_running_reqs": 0}], "version": 2}"#;
        let report = from_loads_json(wrapped, 2).unwrap();
        assert!(report.ranks[0].is_none());
        assert_eq!(report.ranks[1].unwrap().waiting, 5);
    }

    #[test]
    fn loads_json_duplicates_and_incomplete_entries_are_malformed_and_garbage_is_an_error() {
        let body = br#"[{"dp_rank": 0, "num_waiting_reqs": 1, "num_running_reqs": 1},
                        {"dp_rank": 0, "num_waiting_reqs": 9, "num_running_reqs": 9},
                        {"dp_rank": 1, "num_waiting_reqs": 1}]"#;
        let report = from_loads_json(body, 2).unwrap();
        assert_eq!((report.ranks[0].unwrap().waiting, report.malformed), (1, 2));
        assert!(matches!(
            from_loads_json(b"<html>", 1),
            Err(ExtractError::Json(_))
        ));
        assert!(matches!(
            from_loads_json(b"[]", 1),
            Err(ExtractError::MissingSeries { .. })
        ));
    }

    #[test]
    fn vllm_0_32_s_prefill_and_queue_histograms_and_its_block_size_are_read() {
        // As vLLM 0.32 (the CPU build) writes them; two DP ranks' series are summed.
        let text = "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 0.0\n\
                    vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 1.0\n\
                    vllm:cache_config_info{block_size=\"128\",engine=\"0\",num_gpu_blocks=\"8192\"} 1.0\n\
                    vllm:request_prefill_time_seconds_sum{engine=\"0\",model_name=\"tiny\"} 0.84\n\
                    vllm:request_prefill_time_seconds_count{engine=\"0\",model_name=\"tiny\"} 2.0\n\
                    vllm:request_prefill_time_seconds_bucket{engine=\"0\",le=\"0.3\",model_name=\"tiny\"} 1.0\n\
                    vllm:request_prefill_kv_computed_tokens_sum{engine=\"0\",model_name=\"tiny\"} 2270.0\n\
                    vllm:request_prefill_kv_computed_tokens_sum{engine=\"1\",model_name=\"tiny\"} 30.0\n\
                    vllm:request_queue_time_seconds_sum{engine=\"0\",model_name=\"tiny\"} 0.5\n\
                    vllm:request_queue_time_seconds_count{engine=\"0\",model_name=\"tiny\"} 2.0\n";
        let report = from_metrics(Engine::Vllm, text, 2).unwrap();
        let progress = report.progress;
        assert_eq!(
            (
                progress.prefill.seconds,
                progress.prefill.requests,
                progress.prefill.tokens
            ),
            (Some(0.84), Some(2.0), Some(2300.0))
        );
        assert_eq!(
            (progress.queue.seconds, progress.queue.requests),
            (Some(0.5), Some(2.0))
        );
        let rank = report.ranks[0].unwrap();
        assert_eq!(
            (rank.block_size, rank.max_total_tokens),
            (Some(128), Some(1_048_576))
        );
        // An engine without them (SGLang's metrics name no per-request prefill time).
        let sglang = from_metrics(
            Engine::Sglang,
            "sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\n",
            1,
        );
        assert_eq!(sglang.unwrap().progress.prefill, Histograms::default());
    }
}
