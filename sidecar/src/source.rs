//! Where configurations come from. Every source hands checked documents to
//! [`crate::store::Store::install`] and failures to [`crate::store::Store::reject`].

use std::borrow::Cow;
use std::io::Read;

use rebound_policy::compiled::MAX_INFLATED_DOCUMENT_BYTES;

use crate::store::LoadError;

pub mod files;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;

/// The two bytes every gzip stream starts with; a JSON document never does.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The compiled document's JSON from what the ConfigMap key holds: the bytes as they are,
/// or, when they are gzip (the operator compresses a namespace's document that would not
/// fit a ConfigMap as plain text, into `binaryData` under the same key), the inflated
/// bytes, at most [`MAX_INFLATED_DOCUMENT_BYTES`]. Both watch and file mode read the key
/// through this, so either form loads the same way; the document's hash is over the JSON.
pub fn inflate<'a>(bytes: &'a [u8], origin: &str) -> Result<Cow<'a, [u8]>, LoadError> {
    if !bytes.starts_with(&GZIP_MAGIC) {
        return Ok(Cow::Borrowed(bytes));
    }
    let limit = MAX_INFLATED_DOCUMENT_BYTES as u64;
    let mut json = Vec::with_capacity(bytes.len().saturating_mul(8).min(limit as usize));
    flate2::read::GzDecoder::new(bytes)
        .take(limit + 1)
        .read_to_end(&mut json)
        .map_err(|e| LoadError::Source {
            origin: origin.to_owned(),
            message: format!("not a valid gzip document: {e}"),
        })?;
    if json.len() as u64 > limit {
        return Err(LoadError::Source {
            origin: origin.to_owned(),
            message: format!("the compressed document inflates past {limit} bytes"),
        });
    }
    Ok(Cow::Owned(json))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).expect("in memory");
        encoder.finish().expect("in memory")
    }

    #[test]
    fn plain_json_is_passed_through() {
        let inflated = inflate(b"{\"a\":1}", "o").expect("plain");
        assert!(matches!(inflated, Cow::Borrowed(b"{\"a\":1}")));
    }

    #[test]
    fn gzip_is_inflated() {
        let gz = gzip(b"{\"a\":1}");
        let inflated = inflate(&gz, "o").expect("gzip");
        assert_eq!(&*inflated, b"{\"a\":1}");
    }

    #[test]
    fn a_broken_or_oversize_stream_is_refused() {
        let mut broken = gzip(b"{\"a\":1}");
        broken.truncate(broken.len() - 6);
        assert!(matches!(
            inflate(&broken, "o"),
            Err(LoadError::Source { .. })
        ));
        // A bomb: far more zeros than the limit, compressed to a few KiB.
        let bomb = gzip(&vec![b' '; MAX_INFLATED_DOCUMENT_BYTES + 1]);
        assert!(bomb.len() < 64 * 1024);
        assert!(matches!(inflate(&bomb, "o"), Err(LoadError::Source { .. })));
    }
}
