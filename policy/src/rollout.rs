//! Progressive rollout of a policy change: which revision answers a job ([`assign`]) and
//! whether the evidence says the new revision harms ([`analysis`]). Pure, like the rest of
//! the crate; the operator drives the steps and the sidecars count the evidence.
//!
//! Data flows down: this module uses [`crate::decide`]'s hashes and nothing of
//! [`crate::compiled`], which builds on it.

pub mod analysis;
pub mod assign;
pub mod evidence;
pub mod machine;
