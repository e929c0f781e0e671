//! Generated policy tables, a reproduction of kubelet's ConfigMap volume updates, and a
//! raw HTTP/2 client that leaves calls half-sent, shared by the integration tests and the
//! benchmarks so both exercise the same inputs.

pub mod flood;
pub mod process;

use std::{
    io,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use rebound_policy::{
    CompiledDocument, PolicySource, compile,
    duration::KubeDuration,
    spec::{Backoff, Jitter, JitterKind, RetryPolicySpec, Strategy, Terminal, TerminalAction},
};

fn duration(text: &str) -> Option<KubeDuration> {
    KubeDuration::parse(text).ok()
}

/// A deterministic, varied policy: every strategy, jitter kind and terminal action occurs
/// as `i` runs through a few dozen values. Serves queue `q{i}` and pattern `g{i}.*`.
pub fn spec(i: usize) -> RetryPolicySpec {
    let strategy = [
        Strategy::Exponential,
        Strategy::Linear,
        Strategy::Constant,
        Strategy::Decorrelated,
        Strategy::Schedule,
    ][i % 5];
    let jitter = match strategy {
        Strategy::Decorrelated => None,
        _ => match (i / 5) % 4 {
            0 => None,
            1 => Some(Jitter {
                kind: JitterKind::None,
                ratio: None,
            }),
            2 => Some(Jitter {
                kind: JitterKind::Equal,
                ratio: None,
            }),
            _ => Some(Jitter {
                kind: JitterKind::Proportional,
                ratio: Some(0.25),
            }),
        },
    };
    let schedule = (strategy == Strategy::Schedule).then(|| {
        ["1s", "5s", "30s", "2m"]
            .iter()
            .filter_map(|d| duration(d))
            .collect()
    });
    RetryPolicySpec {
        queues: vec![format!("q{i}"), format!("g{i}.*")],
        backoff: Some(Backoff {
            strategy: Some(strategy),
            base: (strategy != Strategy::Schedule)
                .then(|| duration(["100ms", "1s", "5s"][i % 3]))
                .flatten(),
            multiplier: (strategy == Strategy::Exponential).then_some(1.5 + (i % 3) as f64),
            cap: duration(["2m", "10m", "1h"][i % 3]),
            jitter,
            schedule,
        }),
        max_attempts: Some(1 + (i % 17) as u32),
        max_retry_duration: i.is_multiple_of(3).then(|| duration("30m")).flatten(),
        non_retryable_errors: if i.is_multiple_of(2) {
            vec!["Fatal".to_owned(), "http.4*".to_owned()]
        } else {
            Vec::new()
        },
        terminal: (i % 4 == 1).then(|| Terminal {
            action: TerminalAction::DeadLetter,
            dead_letter_queue: Some(format!("dead-{i}")),
        }),
        retry_budget: None,
        rollout: None,
    }
}

/// A compiled document of `n` generated policies in `namespace`; `salt` changes every
/// policy's generation, and so the hash, without changing the answers' shape.
pub fn document(namespace: &str, n: usize, salt: i64) -> CompiledDocument {
    let sources = (0..n)
        .map(|i| PolicySource {
            name: format!("policy-{i}"),
            namespace: namespace.to_owned(),
            uid: format!("uid-{i}"),
            generation: 1 + salt,
            created: Some(i as i64),
            spec: spec(i),
        })
        .collect();
    compile(namespace, sources).document
}

/// `doc` with every policy in rollout: the new revision allows one more attempt, and one
/// step of weight 50 started at `started_unix_ms`. For the benchmarks' rollout figures.
pub fn in_rollout(doc: CompiledDocument, started_unix_ms: u64) -> CompiledDocument {
    use rebound_policy::{
        compiled::CompiledRollout,
        rollout::assign::{Step, revision_id},
    };
    let policies = doc
        .policies
        .into_iter()
        .map(|mut p| {
            let mut canary = p.params.clone();
            canary.max_attempts += 1;
            p.rollout = Some(CompiledRollout {
                revision: revision_id(&canary),
                stable_revision: revision_id(&p.params),
                canary,
                steps: vec![Step {
                    weight: 50,
                    start_unix_ms: started_unix_ms,
                }],
            });
            p
        })
        .collect();
    CompiledDocument::new(doc.namespace, policies)
}

/// Reproduces kubelet's atomic writer for a ConfigMap volume mounted at `dir`:
/// files go into a fresh `..<timestamp>` directory, a `..data_tmp` symlink to it is renamed
/// over `..data`, each key is a symlink through `..data`, and the old directory is removed.
pub struct AtomicWriter {
    dir: PathBuf,
    counter: AtomicU64,
}

impl AtomicWriter {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            counter: AtomicU64::new(0),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Publishes `files` (name, content) as one atomic update.
    pub fn write(&self, files: &[(&str, &[u8])]) -> io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let stamp = format!("..2026_01_01_00_00_00.{:09}", n);
        let fresh = self.dir.join(&stamp);
        std::fs::create_dir(&fresh)?;
        for (name, content) in files {
            std::fs::write(fresh.join(name), content)?;
        }
        let data = self.dir.join("..data");
        let old = std::fs::read_link(&data).ok();
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&stamp, &tmp)?;
        std::fs::rename(&tmp, &data)?;
        for (name, _) in files {
            let link = self.dir.join(name);
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(Path::new("..data").join(name), &link)?;
            }
        }
        if let Some(old) = old {
            std::fs::remove_dir_all(self.dir.join(old))?;
        }
        Ok(())
    }

    /// The real file behind `name` right now (inside the current timestamped directory).
    pub fn current_file(&self, name: &str) -> io::Result<PathBuf> {
        let target = std::fs::read_link(self.dir.join("..data"))?;
        Ok(self.dir.join(target).join(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_documents_are_valid_and_complete() {
        let doc = document("ns", 60, 0);
        assert_eq!(doc.policies.len(), 60);
        let parsed = CompiledDocument::from_json(doc.to_json().as_bytes()).expect("valid");
        assert_eq!(parsed.hash, doc.hash);
        assert_ne!(document("ns", 60, 1).hash, doc.hash);
    }
}
