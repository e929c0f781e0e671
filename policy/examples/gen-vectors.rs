//! Regenerates `policy/testdata/decide-vectors.json` from `rebound_policy::vectors`.
//! Run after any change to the decision function: `cargo run -p rebound-policy --example gen-vectors`.

use std::path::Path;

fn main() -> std::io::Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/decide-vectors.json");
    let file = rebound_policy::vectors::generate();
    std::fs::write(&path, file.to_json())?;
    println!("wrote {} cases to {}", file.cases.len(), path.display());
    Ok(())
}
