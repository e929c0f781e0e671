//! Regenerates the cross-language vectors from `rebound_policy::vectors`:
//! `policy/testdata/decide-vectors.json` (the decision function) and
//! `policy/testdata/assign-vectors.json` (the rollout assignment).
//! Run after any change to either: `cargo run -p rebound-policy --example gen-vectors`.

use std::path::Path;

use rebound_policy::vectors;

fn main() -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path = dir.join("testdata/decide-vectors.json");
    let file = vectors::generate();
    std::fs::write(&path, file.to_json())?;
    println!("wrote {} cases to {}", file.cases.len(), path.display());
    let path = dir.join(vectors::assign::PATH);
    let file = vectors::assign::generate();
    std::fs::write(&path, file.to_json())?;
    println!("wrote {} cases to {}", file.cases.len(), path.display());
    Ok(())
}
