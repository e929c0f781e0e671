//! The loaded configuration and its atomic replacement.
//!
//! A new configuration is parsed and indexed entirely off the request path, then swapped in
//! with one pointer store ([`ArcSwapOption`]); a request reads whichever table was current
//! when it started and never waits for a reload. Anything that fails to parse or validate
//! is rejected whole: the last good table stays.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use arc_swap::{ArcSwapOption, Guard};
use rebound_policy::{
    CompiledDocument, PolicySource, PolicyTable, compile,
    compiled::DocumentError,
    manifest::{self, ManifestDocument},
};
use tokio::sync::watch;

use crate::{
    answer::Snapshot,
    metrics::{ConfigState, ConfigView, Metrics},
    retry_budgets::Budgets,
};

/// Largest configuration file read. A ConfigMap holds at most 1 MiB; the margin lets a
/// local file of 10,000 policies load while still bounding memory.
pub const MAX_CONFIG_BYTES: u64 = 8 * 1024 * 1024;

/// One loaded, indexed compiled document, with where it came from.
#[derive(Debug)]
pub struct Loaded {
    /// What requests are answered from.
    pub snapshot: Snapshot,
    pub policies: usize,
    /// Where it came from, for logs and metrics: a path or `configmap/ns/name`.
    pub origin: String,
    /// 1 for the first configuration this process loaded, then +1 per change.
    pub sequence: u64,
    pub loaded_at: SystemTime,
}

impl Loaded {
    pub fn new(snapshot: Snapshot, origin: String, sequence: u64) -> Self {
        Self {
            policies: snapshot.table.len(),
            snapshot,
            origin,
            sequence,
            loaded_at: SystemTime::now(),
        }
    }

    pub fn hash(&self) -> &str {
        self.snapshot.table.hash()
    }

    pub fn namespace(&self) -> &str {
        self.snapshot.table.namespace()
    }

    /// What metrics report about it.
    pub fn view(&self) -> ConfigView<'_> {
        ConfigView {
            hash: self.hash(),
            origin: &self.origin,
            sequence: self.sequence,
            policies: self.policies,
            loaded_at: self.loaded_at,
        }
    }
}

/// Why a new configuration was not used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is {kind}, not a regular file; refusing to read it")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{path} is larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("{origin}: {source}")]
    Document {
        origin: String,
        source: DocumentError,
    },
    #[error("{path}: not valid YAML: {message}")]
    Yaml { path: PathBuf, message: String },
    #[error("{path}: document {index} ({name}): {problems}")]
    InvalidPolicy {
        path: PathBuf,
        index: usize,
        name: String,
        problems: String,
    },
    #[error(
        "{path}: RetryPolicy {name} is in namespace {found:?}, this sidecar serves {expected:?}"
    )]
    Namespace {
        path: PathBuf,
        name: String,
        found: String,
        expected: String,
    },
    #[error("{origin} has no key {key:?}")]
    MissingKey { origin: String, key: String },
    #[error("{origin} does not exist")]
    Missing { origin: String },
    #[error("{origin}: {message}")]
    Source { origin: String, message: String },
}

impl LoadError {
    /// Where the rejected configuration came from (a path, or the ConfigMap), for logs.
    pub fn origin(&self) -> String {
        match self {
            LoadError::Read { path, .. }
            | LoadError::NotRegular { path, .. }
            | LoadError::TooLarge { path }
            | LoadError::Yaml { path, .. }
            | LoadError::InvalidPolicy { path, .. }
            | LoadError::Namespace { path, .. } => path.display().to_string(),
            LoadError::Document { origin, .. }
            | LoadError::MissingKey { origin, .. }
            | LoadError::Missing { origin }
            | LoadError::Source { origin, .. } => origin.clone(),
        }
    }
}

/// Reads a regular file with the size bound. The file is opened without blocking and
/// checked through its open descriptor, so a FIFO, socket or device put where the
/// configuration belongs is refused instead of hanging the loader in `open` or `read`.
pub fn read_bounded(path: &Path) -> Result<Vec<u8>, LoadError> {
    use std::{io::Read, os::unix::fs::OpenOptionsExt};
    let read_err = |source| LoadError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    if !meta.file_type().is_file() {
        return Err(LoadError::NotRegular {
            path: path.to_owned(),
            kind: file_kind(&meta.file_type()),
        });
    }
    // Sized from the metadata (bounded) instead of grown by doubling: a 3 MiB document
    // is then read into one allocation, not copied through a dozen.
    let mut bytes = Vec::with_capacity(meta.len().min(MAX_CONFIG_BYTES) as usize + 1);
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(LoadError::TooLarge {
            path: path.to_owned(),
        });
    }
    Ok(bytes)
}

fn file_kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// Parses a compiled document straight into the table requests are answered from (format,
/// hash and every policy checked by the policy crate).
pub fn parse_compiled(bytes: &[u8], origin: &str) -> Result<PolicyTable, LoadError> {
    PolicyTable::from_json(bytes).map_err(|source| LoadError::Document {
        origin: origin.to_owned(),
        source,
    })
}

/// Compiles RetryPolicy manifests locally, as the operator would for `namespace`. Every
/// RetryPolicy in the files must be valid; one bad policy rejects the whole set.
pub fn compile_manifests(
    files: &[(PathBuf, String)],
    namespace: &str,
) -> Result<CompiledDocument, LoadError> {
    let mut sources = Vec::new();
    for (path, text) in files {
        let docs = manifest::parse_manifests(text).map_err(|e| LoadError::Yaml {
            path: path.clone(),
            message: e.to_string(),
        })?;
        for doc in docs {
            sources.push(manifest_source(path, doc, namespace)?);
        }
    }
    Ok(compile(namespace, sources).document)
}

fn manifest_source(
    path: &Path,
    doc: ManifestDocument,
    namespace: &str,
) -> Result<PolicySource, LoadError> {
    let name = doc.name.clone().unwrap_or_default();
    let (object, _) = doc.result.map_err(|errors| LoadError::InvalidPolicy {
        path: path.to_owned(),
        index: doc.index,
        name: name.clone(),
        problems: errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; "),
    })?;
    let found = object.metadata.namespace.as_deref().unwrap_or(namespace);
    if found != namespace {
        return Err(LoadError::Namespace {
            path: path.to_owned(),
            name,
            found: found.to_owned(),
            expected: namespace.to_owned(),
        });
    }
    Ok(PolicySource {
        name,
        namespace: namespace.to_owned(),
        uid: String::new(),
        generation: object.metadata.generation.unwrap_or(0),
        // Like the CLI: no creation times, so name order breaks pattern ties.
        created: None,
        spec: object.spec,
    })
}

/// The current configuration, shared by the service, the sources and the metrics.
#[derive(Debug)]
pub struct Store {
    current: ArcSwapOption<Loaded>,
    sequence: AtomicU64,
    /// The latest input was rejected while a configuration is loaded.
    stale: AtomicBool,
    metrics: Arc<Metrics>,
    /// `true` once a configuration is loaded; the health reporter follows it.
    loaded: watch::Sender<bool>,
}

impl Store {
    pub fn new(metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            current: ArcSwapOption::empty(),
            sequence: AtomicU64::new(0),
            stale: AtomicBool::new(false),
            metrics,
            loaded: watch::Sender::new(false),
        })
    }

    /// The configuration a request should use; cheap and wait-free.
    pub fn snapshot(&self) -> Guard<Option<Arc<Loaded>>> {
        self.current.load()
    }

    pub fn current(&self) -> Option<Arc<Loaded>> {
        self.current.load_full()
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Which configuration requests are answered from.
    pub fn state(&self) -> ConfigState {
        match self.current.load().as_deref() {
            None => ConfigState::None,
            Some(_) if self.stale.load(Ordering::Relaxed) => ConfigState::Stale,
            Some(c) if c.policies == 0 => ConfigState::Empty,
            Some(_) => ConfigState::Active,
        }
    }

    /// The Prometheus exposition of the counters and the current configuration.
    pub fn render_metrics(&self) -> String {
        let current = self.current();
        self.metrics
            .render(self.state(), current.as_deref().map(Loaded::view))
    }

    /// Becomes `true` when the first configuration is in place.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.loaded.subscribe()
    }

    /// Makes a checked table (or a document, indexed here) current. `started` is when the
    /// reload began (read + parse), for the reload-duration metric. Returns `false` when
    /// the table is the one already loaded.
    pub fn install(&self, table: impl Into<PolicyTable>, origin: &str, started: Instant) -> bool {
        let table = table.into();
        self.stale.store(false, Ordering::Relaxed);
        if let Some(current) = self.current.load().as_ref()
            && current.hash() == table.hash()
            && current.namespace() == table.namespace()
        {
            tracing::debug!(hash = %table.hash(), origin, "configuration unchanged");
            return false;
        }
        let sequence = self.sequence.fetch_add(1, Ordering::Relaxed) + 1;
        // Budgets carry over from the configuration being replaced; decision series are
        // handed over once it is retired.
        let budgets = Budgets::build(
            &table,
            self.current.load().as_deref().map(|c| &c.snapshot.budgets),
            &self.metrics,
        );
        let decisions = self.metrics.decisions().build(&table);
        let snapshot = Snapshot::with_series(table, budgets, decisions);
        let loaded = Arc::new(Loaded::new(snapshot, origin.to_owned(), sequence));
        let old = self.current.swap(Some(Arc::clone(&loaded)));
        let took = started.elapsed();
        self.metrics.reloaded(took);
        let state = if loaded.policies == 0 {
            ConfigState::Empty
        } else {
            ConfigState::Active
        };
        tracing::info!(
            hash = %loaded.hash(),
            namespace = %loaded.namespace(),
            policies = loaded.policies,
            state = state.as_str(),
            sequence,
            origin,
            took_ms = took.as_secs_f64() * 1e3,
            "configuration loaded"
        );
        self.loaded.send_replace(true);
        if let Some(old) = old {
            let old = drop_off_request_path(old);
            let new = &loaded.snapshot;
            self.metrics
                .decisions()
                .retire(&old.snapshot.decisions, &new.decisions, &new.table);
        }
        true
    }

    /// Records a rejected configuration; the current one stays.
    pub fn reject(&self, error: &LoadError) {
        self.metrics.reload_failed();
        self.stale.store(true, Ordering::Relaxed);
        match self.current.load().as_ref() {
            Some(current) => tracing::warn!(
                %error,
                origin = %error.origin(),
                state = ConfigState::Stale.as_str(),
                kept = %current.hash(),
                "configuration rejected; still answering from the last good one"
            ),
            None => tracing::warn!(
                %error,
                origin = %error.origin(),
                state = ConfigState::None.as_str(),
                "configuration rejected; no valid configuration yet"
            ),
        }
    }
}

/// Hands freed heap pages back to the OS after a reload. Parsing and checking a document
/// allocates several times the finished table (the bytes, the parsed document, the hash
/// input), and glibc would otherwise keep that high-water mark as resident memory.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers and only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Waits briefly for requests still holding the old table so that freeing 10,000 entries
/// happens on the loader's thread, not inside a request; the caller drops what it returns.
fn drop_off_request_path(old: Arc<Loaded>) -> Arc<Loaded> {
    for _ in 0..100 {
        if Arc::strong_count(&old) == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    old
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "apiVersion: rebound.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: a\nspec:\n  queues: [q]\n";

    #[test]
    fn manifests_compile_and_bad_ones_reject_the_set() {
        let ok = compile_manifests(&[(PathBuf::from("a.yaml"), YAML.to_owned())], "ns")
            .expect("compiles");
        assert_eq!(ok.policies.len(), 1);
        assert_eq!(ok.policies[0].identity(), "ns/a");

        let bad = format!("{YAML}---\n{}", YAML.replace("name: a", "name: B_"));
        let err = compile_manifests(&[(PathBuf::from("a.yaml"), bad)], "ns").unwrap_err();
        assert!(err.to_string().contains("metadata.name"), "{err}");

        let other = YAML.replace("name: a", "name: a\n  namespace: other");
        let err = compile_manifests(&[(PathBuf::from("a.yaml"), other)], "ns").unwrap_err();
        assert!(matches!(err, LoadError::Namespace { .. }), "{err}");
    }

    #[test]
    fn store_swaps_and_keeps_last_good() {
        let store = Store::new(Arc::new(Metrics::default()));
        assert!(store.current().is_none());
        let doc = compile_manifests(&[(PathBuf::from("a.yaml"), YAML.to_owned())], "ns")
            .expect("compiles");
        assert!(store.install(doc.clone(), "t", Instant::now()));
        assert!(
            !store.install(doc.clone(), "t", Instant::now()),
            "same hash is a no-op"
        );
        store.reject(&LoadError::Missing {
            origin: "x".to_owned(),
        });
        let current = store.current().expect("kept");
        assert_eq!((current.sequence, current.hash()), (1, doc.hash.as_str()));
        assert!(*store.subscribe().borrow());
    }

    /// A policy per name, each answering queue `q<name>`.
    fn policies(names: &[&str]) -> CompiledDocument {
        let text = names
            .iter()
            .map(|n| {
                YAML.replace("name: a", &format!("name: {n}"))
                    .replace("[q]", &format!("[q{n}]"))
            })
            .collect::<Vec<_>>()
            .join("---\n");
        compile_manifests(&[(PathBuf::from("p.yaml"), text)], "ns").expect("compiles")
    }

    /// The `decisions_total` series' policies.
    fn series_policies(store: &Store) -> Vec<String> {
        let samples =
            rebound_test_support::metrics::Samples::parse(&store.render_metrics()).expect("parsed");
        let mut policies: Vec<String> = samples
            .matching("rebound_sidecar_decisions_total", &[])
            .filter_map(|s| s.labels.get("policy").cloned())
            .collect();
        policies.sort();
        policies
    }

    #[test]
    fn a_series_kept_through_a_reload_without_decisions_goes_with_its_policy() {
        let store = Store::new(Arc::new(Metrics::default()));
        let decide = |queue: &str| {
            let current = store.current().expect("loaded");
            let req = crate::pb::server::DecideRequest {
                queue: queue.to_owned().into(),
                attempt: 1,
                ..Default::default()
            };
            crate::answer::decide_one(&current.snapshot, &req, 0).expect("answered");
        };
        assert!(store.install(policies(&["a", "b"]), "t", Instant::now()));
        decide("qa");
        decide("qb");
        // `a` stays and decides nothing while this one is loaded.
        assert!(store.install(policies(&["a", "b", "c"]), "t", Instant::now()));
        decide("qb");
        assert_eq!(series_policies(&store), ["ns/a", "ns/b"]);
        assert!(store.install(policies(&["b"]), "t", Instant::now()));
        assert_eq!(series_policies(&store), ["ns/b"]);
    }
}
