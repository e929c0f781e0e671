//! Rebound operator (placeholder until the operator lands).
