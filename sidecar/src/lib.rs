//! Rebound sidecar (placeholder until the sidecar lands).
