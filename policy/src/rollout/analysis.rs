//! The anytime-valid test that decides whether a new revision harms.
