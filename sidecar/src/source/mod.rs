//! Where configurations come from. Every source hands checked documents to
//! [`crate::store::Store::install`] and failures to [`crate::store::Store::reject`].

pub mod files;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;
