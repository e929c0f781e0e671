//! Configuration from files: a mounted ConfigMap directory holding a compiled document, or
//! RetryPolicy YAML manifests compiled locally.
//!
//! Kubelet updates a ConfigMap volume atomically: it writes a new timestamped directory,
//! points a `..data_tmp` symlink at it and renames that over `..data`; the key itself is a
//! symlink through `..data`. Watching the directory (not the file, whose inode changes)
//! catches that rename. A slow poll backs the notifications up: it re-arms the watch after
//! the directory disappears and catches anything inotify missed (overflow, odd volumes).
//!
//! At rest nothing is read: the loader's own `open` of a file shows up as an access
//! notification, which is ignored (reacting to it re-read the file forever), and the poll
//! compares the files' metadata (device, inode, size, change times; symlinks followed),
//! reading only when that changed.

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::{Arc, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use notify::{
    EventKind, RecursiveMode, Watcher,
    event::{AccessKind, AccessMode},
};
use rebound_policy::PolicyTable;

use crate::store::{self, LoadError, Store};

/// Quiet time that ends a burst of file events (kubelet's swap is five events).
const DEBOUNCE: Duration = Duration::from_millis(10);
/// A burst never delays a reload by more than this.
const MAX_DEBOUNCE_ROUNDS: u32 = 20;
/// How long shutdown waits for the loader thread before leaving it behind.
const STOP_WAIT: Duration = Duration::from_secs(2);

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
        let (done_tx, done) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("rebound-config".to_owned())
            .spawn(move || {
                let _done = done_tx;
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
            done,
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

/// Stops the watching thread when dropped. Waits at most [`STOP_WAIT`] for it: a loader
/// stuck in the kernel (a hung network volume) must not hold up the process's exit.
#[derive(Debug)]
pub struct SourceHandle {
    stop: mpsc::Sender<Msg>,
    /// Disconnects when the thread ends.
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for SourceHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(Msg::Stop);
        let Some(thread) = self.thread.take() else {
            return;
        };
        match self.done.recv_timeout(STOP_WAIT) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(wait = ?STOP_WAIT, "configuration thread did not stop; leaving it");
            }
            _ => {
                let _ = thread.join();
            }
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
                    if !self.note(&event) {
                        continue;
                    }
                    let mut swapped = self.load_on_swap(&event);
                    for _ in 0..MAX_DEBOUNCE_ROUNDS {
                        match rx.recv_timeout(DEBOUNCE) {
                            Ok(Msg::Fs(event)) => {
                                self.note(&event);
                                swapped |= self.load_on_swap(&event);
                            }
                            Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
                            Err(mpsc::RecvTimeoutError::Timeout) => break,
                        }
                    }
                    // After a swap the rest of the burst is kubelet removing the old
                    // directory: read again only if the files changed since.
                    if !swapped || self.loader.changed_on_disk() {
                        self.reload();
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if !self.armed {
                        self.arm();
                    }
                    if self.loader.changed_on_disk() {
                        self.reload();
                    }
                }
            }
        }
    }

    /// Kubelet renames `..data` last, once the new files are complete: loads them at once
    /// instead of after the burst's quiet time. Returns whether `event` was that rename.
    fn load_on_swap(&mut self, event: &notify::Result<notify::Event>) -> bool {
        let swapped = is_data_swap(event);
        if swapped {
            self.reload();
        }
        swapped
    }

    fn reload(&mut self) {
        if self.loader.reload() {
            store::release_freed_memory();
        }
    }

    /// Whether an event may mean new content; notices a watched directory going away (its
    /// watch is gone and must be re-armed). Opening or reading a file, which the loader
    /// itself does, changes nothing.
    fn note(&mut self, event: &notify::Result<notify::Event>) -> bool {
        match event {
            Ok(event) => {
                let gone = matches!(event.kind, EventKind::Remove(_))
                    && event.paths.iter().any(|p| self.watch_dirs.contains(p));
                if gone {
                    tracing::warn!(paths = ?event.paths, "watched directory removed");
                    self.armed = false;
                }
                match event.kind {
                    EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
                    EventKind::Access(_) => false,
                    _ => true,
                }
            }
            Err(error) => {
                // An overflow or backend error: something may have been missed.
                tracing::debug!(%error, "file notification error");
                true
            }
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

/// Whether `event` is kubelet's rename of `..data_tmp` over `..data`, the last step of a
/// ConfigMap volume update. inotify reports a rename three times (from, to, both); only
/// the arrival counts, so one swap loads once.
fn is_data_swap(event: &notify::Result<notify::Event>) -> bool {
    use notify::event::{ModifyKind, RenameMode};
    let Ok(event) = event else {
        return false;
    };
    matches!(
        event.kind,
        EventKind::Modify(ModifyKind::Name(RenameMode::To))
    ) && event
        .paths
        .iter()
        .any(|p| p.file_name().is_some_and(|n| n == "..data"))
}

/// Reads, checks and installs; remembers what it last tried so an unchanged broken file
/// is reported once, not on every poll.
struct Loader {
    kind: FileKind,
    origin: String,
    store: Arc<Store>,
    last_input: Option<u64>,
    /// The files' metadata when they were last read; the poll reads only when it changes.
    last_stat: Option<Vec<Option<FileStamp>>>,
    last_error: Option<String>,
}

/// What identifies one version of a file without reading it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    /// Follows symlinks, so kubelet's `..data` swap changes the stamp.
    fn of(path: &Path) -> Option<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(Self {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
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
            last_stat: None,
            last_error: None,
        }
    }

    fn paths(&self) -> &[PathBuf] {
        match &self.kind {
            FileKind::Compiled { path } => std::slice::from_ref(path),
            FileKind::Manifests { paths, .. } => paths.as_slice(),
        }
    }

    fn stamps(&self) -> Vec<Option<FileStamp>> {
        self.paths().iter().map(|p| FileStamp::of(p)).collect()
    }

    /// Whether the files' metadata differs from when they were last read (a `stat` per
    /// file, no read).
    fn changed_on_disk(&self) -> bool {
        self.last_stat.as_ref() != Some(&self.stamps())
    }

    /// Returns whether new input was parsed (and so memory churned).
    fn reload(&mut self) -> bool {
        let started = Instant::now();
        self.last_stat = Some(self.stamps());
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
            Ok(table) => {
                self.last_error = None;
                self.store.install(table, &self.origin, started);
            }
            Err(e) => self.fail(&e),
        }
        true
    }

    fn read(&self) -> Result<Vec<(PathBuf, Vec<u8>)>, LoadError> {
        self.store.metrics().read_input();
        self.paths()
            .iter()
            .map(|p| Ok((p.clone(), store::read_bounded(p)?)))
            .collect()
    }

    fn parse(&self, inputs: &[(PathBuf, Vec<u8>)]) -> Result<PolicyTable, LoadError> {
        match &self.kind {
            FileKind::Compiled { .. } => {
                let bytes = inputs.first().map_or(&[][..], |(_, b)| b.as_slice());
                let json = super::inflate(bytes, &self.origin)?;
                store::parse_compiled(&json, &self.origin)
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
                store::compile_manifests(&texts, namespace).map(PolicyTable::from_document)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The events of a real watch over a directory updated as kubelet updates a ConfigMap
    /// volume: exactly one of them is the swap, and nothing before it is.
    #[test]
    fn kubelets_rename_of_data_is_the_one_swap() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (tx, rx) = mpsc::channel();
        let mut watcher = notify::recommended_watcher(move |event| {
            let _ = tx.send(event);
        })
        .expect("watcher");
        watcher
            .watch(dir.path(), RecursiveMode::NonRecursive)
            .expect("watch");
        let version = dir.path().join("..2026_01_01_00_00_00.1");
        std::fs::create_dir(&version).expect("version dir");
        std::fs::write(version.join("policies.json"), "{}").expect("key file");
        let tmp = dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp).expect("..data_tmp");
        std::fs::rename(&tmp, dir.path().join("..data")).expect("rename");
        std::os::unix::fs::symlink("..data/policies.json", dir.path().join("policies.json"))
            .expect("key link");

        let mut events = Vec::new();
        while let Ok(event) = rx.recv_timeout(Duration::from_millis(500)) {
            events.push(event);
        }
        let swaps: Vec<usize> = (0..events.len())
            .filter(|&i| is_data_swap(&events[i]))
            .collect();
        assert_eq!(swaps.len(), 1, "{events:?}");
        assert!(
            swaps[0] > 0,
            "the new files come before the swap: {events:?}"
        );
    }
}
