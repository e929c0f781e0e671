//! Errors of one reconcile; each one leads to a requeue with backoff.

/// Why a namespace reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request to the API server failed (network, server error, forbidden, ...).
    #[error("{action}: {source}")]
    Api {
        action: String,
        #[source]
        source: kube::Error,
    },
    /// The object changed between our read and our write (precondition failed); the watch
    /// event of that change brings a fresh view.
    #[error("{0} changed while being written; retrying with a fresh view")]
    Conflict(String),
    /// Work on the blocking pool did not finish (the runtime is shutting down).
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn api(action: impl Into<String>, source: kube::Error) -> Self {
        Error::Api {
            action: action.into(),
            source,
        }
    }

    /// The API server's HTTP status code, if it answered (a structured log field).
    pub fn code(&self) -> Option<u16> {
        match self {
            Error::Api { source, .. } => status_code(source),
            Error::Conflict(_) => Some(409),
            Error::Internal(_) => None,
        }
    }

    /// Stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Api { .. } => "api",
            Error::Conflict(_) => "conflict",
            Error::Internal(_) => "internal",
        }
    }
}

/// The HTTP status code of an API error, if the server answered.
pub fn status_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// The HTTP status code behind a watch failure, if the server answered.
pub fn watch_status_code(error: &kube::runtime::watcher::Error) -> Option<u16> {
    use kube::runtime::watcher::Error as W;
    match error {
        W::InitialListFailed(e) | W::WatchStartFailed(e) | W::WatchFailed(e) => status_code(e),
        W::WatchError(status) => Some(status.code),
        W::NoResourceVersion => None,
    }
}
