//! Which revision of a policy in rollout answers a job.
