//! Configuration from files: a mounted ConfigMap directory holding a compiled document, or
//! RetryPolicy YAML manifests compiled locally.
//!
//! Kubelet updates a ConfigMap volume atomically: it writes a new timestamped directory,
//! points a `..data_tmp` symlink at it and renames that over `..data`; the key itself is a
//! symlink through `..data`. Watching the directory (not the file, whose inode changes)
//! catches that rename. A slow poll backs the notifications up: it re-arms the watch after
//! the directory disappears and catches anything inotify missed (overflow, odd volumes).

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::{Arc, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use notify::{EventKind, RecursiveMode, Watcher};
use rebound_policy::CompiledDocument;

use crate::config::{self, LoadError, Store};

/// Quiet time that ends a burst of file events (kubelet's swap is five events).
const DEBOUNCE: Duration = Duration::from_millis(10);
/// A burst never delays a reload by more than this.
const MAX_DEBOUNCE_ROUNDS: u32 = 20;

/// What the files hold.
#[derive(Clone, Debug)]
pub enum FileKind {
    /// A compiled document (`<dir>/policies.json` of a mounted ConfigMap).
    Compiled { path: PathBuf },
    /// RetryPolicy manifests, compiled here for `namespace`.
    Manifests {
        paths: Vec<PathBuf>,
        namespace: String,
    },
}

/// A file-based configuration source.
#[derive(Clone, Debug)]
pub struct FileSource {
    kind: FileKind,
    watch_dirs: Vec<PathBuf>,
    poll: Duration,
}

/// A file watch that could not start.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("cannot start file notifications: {0}")]
    Notify(#[from] notify::Error),
    #[error("cannot start the configuration thread: {0}")]
    Thread(#[from] std::io::Error),
}

impl FileSource {
    /// A mounted ConfigMap: `dir` is the mount point, `key` the file in it.
    pub fn mounted_dir(dir: PathBuf, key: &str, poll: Duration) -> Self {
        Self {
            kind: FileKind::Compiled {
                path: dir.join(key),
            },
            watch_dirs: vec![dir],
            poll,
        }
    }

    /// RetryPolicy manifest files, compiled for `namespace`.
    pub fn manifests(paths: Vec<PathBuf>, namespace: String, poll: Duration) -> Self {
        let mut watch_dirs: Vec<PathBuf> = paths.iter().map(|p| parent_dir(p)).collect();
        watch_dirs.sort();
        watch_dirs.dedup();
        Self {
            kind: FileKind::Manifests { paths, namespace },
            watch_dirs,
            poll,
        }
    }

    /// Starts a thread that loads the configuration now and again on every change.
    pub fn spawn(self, store: Arc<Store>) -> Result<SourceHandle, SourceError> {
        let (tx, rx) = mpsc::channel();
        let events = tx.clone();
        let watcher = notify::recommended_watcher(move |event| {
            let _ = events.send(Msg::Fs(event));
        })?;
        let thread = std::thread::Builder::new()
            .name("rebound-config".to_owned())
            .spawn(move || {
                Loop {
                    loader: Loader::new(self.kind, store),
                    watch_dirs: self.watch_dirs,
                    poll: self.poll,
                    watcher,
                    armed: false,
                }
                .run(&rx)
            })?;
        Ok(SourceHandle {
            stop: tx,
            thread: Some(thread),
        })
    }
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

enum Msg {
    Fs(notify::Result<notify::Event>),
    Stop,
}

/// Stops the watching thread when dropped.
#[derive(Debug)]
pub struct SourceHandle {
    stop: mpsc::Sender<Msg>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for SourceHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(Msg::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Loop {
    loader: Loader,
    watch_dirs: Vec<PathBuf>,
    poll: Duration,
    watcher: notify::RecommendedWatcher,
    armed: bool,
}

impl Loop {
    fn run(mut self, rx: &mpsc::Receiver<Msg>) {
        self.arm();
        self.reload();
        loop {
            match rx.recv_timeout(self.poll) {
                Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
                Ok(Msg::Fs(event)) => {
                    self.note(&event);
                    for _ in 0..MAX_DEBOUNCE_ROUNDS {
                        match rx.recv_timeout(DEBOUNCE) {
                            Ok(Msg::Fs(event)) => self.note(&event),
                            Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
                            Err(mpsc::RecvTimeoutError::Timeout) => break,
                        }
                    }
                    self.reload();
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if !self.armed {
                        self.arm();
                    }
                    self.reload();
                }
            }
        }
    }

    fn reload(&mut self) {
        if self.loader.reload() {
            config::release_freed_memory();
        }
    }

    /// Notices a watched directory going away: its watch is gone and must be re-armed.
    fn note(&mut self, event: &notify::Result<notify::Event>) {
        match event {
            Ok(event) => {
                let gone = matches!(event.kind, EventKind::Remove(_))
                    && event.paths.iter().any(|p| self.watch_dirs.contains(p));
                if gone {
                    tracing::warn!(paths = ?event.paths, "watched directory removed");
                    self.armed = false;
                }
            }
            Err(error) => tracing::debug!(%error, "file notification error"),
        }
    }

    fn arm(&mut self) {
        self.armed = true;
        for dir in &self.watch_dirs {
            let _ = self.watcher.unwatch(dir);
            if let Err(error) = self.watcher.watch(dir, RecursiveMode::NonRecursive) {
                tracing::debug!(dir = %dir.display(), %error, "cannot watch yet; polling");
                self.armed = false;
            }
        }
    }
}

/// Reads, checks and installs; remembers what it last tried so an unchanged broken file
/// is reported once, not on every poll.
struct Loader {
    kind: FileKind,
    origin: String,
    store: Arc<Store>,
    last_input: Option<u64>,
    last_error: Option<String>,
}

impl Loader {
    fn new(kind: FileKind, store: Arc<Store>) -> Self {
        let origin = match &kind {
            FileKind::Compiled { path } => path.display().to_string(),
            FileKind::Manifests { paths, .. } => paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(","),
        };
        Self {
            kind,
            origin,
            store,
            last_input: None,
            last_error: None,
        }
    }

    /// Returns whether new input was parsed (and so memory churned).
    fn reload(&mut self) -> bool {
        let started = Instant::now();
        let inputs = match self.read() {
            Ok(inputs) => inputs,
            Err(e) => {
                self.last_input = None;
                self.fail(&e);
                return false;
            }
        };
        let mut hasher = DefaultHasher::new();
        inputs.hash(&mut hasher);
        let fingerprint = hasher.finish();
        if self.last_input == Some(fingerprint) {
            return false;
        }
        self.last_input = Some(fingerprint);
        match self.parse(&inputs) {
            Ok(doc) => {
                self.last_error = None;
                self.store.install(&doc, &self.origin, started);
            }
            Err(e) => self.fail(&e),
        }
        true
    }

    fn read(&self) -> Result<Vec<(PathBuf, Vec<u8>)>, LoadError> {
        let paths = match &self.kind {
            FileKind::Compiled { path } => std::slice::from_ref(path),
            FileKind::Manifests { paths, .. } => paths.as_slice(),
        };
        paths
            .iter()
            .map(|p| Ok((p.clone(), config::read_bounded(p)?)))
            .collect()
    }

    fn parse(&self, inputs: &[(PathBuf, Vec<u8>)]) -> Result<CompiledDocument, LoadError> {
        match &self.kind {
            FileKind::Compiled { .. } => {
                let bytes = inputs.first().map_or(&[][..], |(_, b)| b.as_slice());
                config::parse_compiled(bytes, &self.origin)
            }
            FileKind::Manifests { namespace, .. } => {
                let texts = inputs
                    .iter()
                    .map(|(path, bytes)| {
                        String::from_utf8(bytes.clone())
                            .map(|text| (path.clone(), text))
                            .map_err(|_| LoadError::Yaml {
                                path: path.clone(),
                                message: "not UTF-8".to_owned(),
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                config::compile_manifests(&texts, namespace)
            }
        }
    }

    fn fail(&mut self, error: &LoadError) {
        let message = error.to_string();
        if self.last_error.as_ref() != Some(&message) {
            self.store.reject(error);
            self.last_error = Some(message);
        }
    }
}
