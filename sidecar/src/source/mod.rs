//! Where configurations come from. Every source hands checked documents to
//! [`crate::config::Store::install`] and failures to [`crate::config::Store::reject`].

pub mod files;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
