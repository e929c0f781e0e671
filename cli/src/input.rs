//! Reading manifests as `kubectl apply -f` does: files, directories (`-R` for their
//! subdirectories) and `-` for stdin, every read bounded.

use std::{
    io::Read,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use rebound_policy::manifest::{self, MAX_MANIFEST_BYTES, ManifestDocument, YamlError};

use crate::args::Inputs;

/// Extensions read from directories (an explicitly named file is read whatever its name).
const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// One file (or stdin) to read, named as the user wrote it.
pub struct Source {
    pub name: String,
    pub text: Result<String, anyhow::Error>,
}

/// What a source gave: its documents, a YAML error (a finding), or an I/O error.
pub enum Parsed {
    Documents(Vec<ManifestDocument>),
    NotYaml(YamlError),
    Unreadable(anyhow::Error),
}

impl Source {
    pub fn parse(self) -> (String, Parsed) {
        let parsed = match self.text {
            Err(e) => Parsed::Unreadable(e),
            Ok(text) => match manifest::parse_manifests(&text) {
                Ok(docs) => Parsed::Documents(docs),
                Err(e) => Parsed::NotYaml(e),
            },
        };
        (self.name, parsed)
    }
}

/// Every source the arguments name, in order; directory entries sorted by name. Errors
/// (a missing path, an unreadable directory) are kept per source so one bad path does not
/// hide the rest.
pub fn sources(inputs: &Inputs) -> Result<Vec<Source>> {
    let stdin_uses = inputs.files.iter().filter(|p| p.as_os_str() == "-").count();
    if stdin_uses > 1 {
        bail!("-f - (stdin) can be given only once");
    }
    let mut out = Vec::new();
    for path in &inputs.files {
        if path.as_os_str() == "-" {
            out.push(Source {
                name: "-".to_owned(),
                text: read_bounded(std::io::stdin().lock()).context("cannot read stdin"),
            });
        } else if path.is_dir() {
            walk(path, inputs.recursive, &mut out);
        } else {
            out.push(read_file(path));
        }
    }
    Ok(out)
}

fn read_file(path: &Path) -> Source {
    let text = std::fs::File::open(path)
        .map_err(anyhow::Error::from)
        .and_then(read_bounded)
        .with_context(|| format!("cannot read {}", path.display()));
    Source {
        name: path.display().to_string(),
        text,
    }
}

fn walk(dir: &Path, recursive: bool, out: &mut Vec<Source>) {
    let mut entries: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) => {
            out.push(Source {
                name: dir.display().to_string(),
                text: Err(anyhow::Error::from(e)
                    .context(format!("cannot read directory {}", dir.display()))),
            });
            return;
        }
    };
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if recursive {
                walk(&path, recursive, out);
            }
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| EXTENSIONS.contains(&e))
        {
            out.push(read_file(&path));
        }
    }
}

/// Reads at most one byte more than the manifest limit, so a huge (or endless) input
/// costs bounded memory and is refused by the parser's own size check.
fn read_bounded(reader: impl Read) -> Result<String> {
    let mut bytes = Vec::new();
    reader
        .take(MAX_MANIFEST_BYTES as u64 + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() > MAX_MANIFEST_BYTES {
        bail!("more than {MAX_MANIFEST_BYTES} bytes; a policy file never needs that much");
    }
    String::from_utf8(bytes).context("not UTF-8 text")
}
