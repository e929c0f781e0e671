//! The one content hash of the crate: `sha256:<hex>` over bytes. The compiled document's
//! hash and a rollout's revision ids are both this, so they read and check alike.

use sha2::{Digest, Sha256};

/// Length of an id: `sha256:` and 64 hex digits.
pub const ID_LEN: usize = 7 + 64;

/// `sha256:` followed by the lowercase hex SHA-256 of `bytes`.
pub fn sha256_id(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let digest = Sha256::digest(bytes);
    let mut hex = String::with_capacity(ID_LEN);
    hex.push_str("sha256:");
    for b in digest {
        // Writing to a String cannot fail.
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

/// Whether `id` has the form [`sha256_id`] writes (lowercase hex, exact length).
pub fn is_sha256_id(id: &str) -> bool {
    id.len() == ID_LEN
        && id.starts_with("sha256:")
        && id[7..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_well_formed_and_checked() {
        let id = sha256_id(b"");
        assert_eq!(
            id,
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert!(is_sha256_id(&id));
        assert!(!is_sha256_id(&id.to_uppercase()));
        assert!(!is_sha256_id(&id[..70]));
        assert!(!is_sha256_id(&format!("sha512:{}", &id[7..])));
        assert!(!is_sha256_id(&format!("{}g", &id[..70])));
    }
}
