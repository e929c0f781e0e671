//! No crate of the workspace has a cycle of `crate::` edges between its top-level modules
//! (see `rebound_tests::module_graph` for what counts as an edge).

use anyhow::{Context, Result, bail};
use rebound_tests::{module_graph::ModuleGraph, repo_root};

/// The `members = [...]` of the workspace's Cargo.toml.
fn workspace_members() -> Result<Vec<String>> {
    let path = repo_root().join("Cargo.toml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let Some(list) = text
        .lines()
        .map(str::trim)
        .find_map(|line| line.strip_prefix("members"))
        .and_then(|rest| rest.trim_start().strip_prefix('='))
    else {
        bail!("no `members = [...]` line in {}", path.display());
    };
    let members: Vec<String> = list
        .trim()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect();
    if members.is_empty() {
        bail!("`members` of {} is empty", path.display());
    }
    Ok(members)
}

#[test]
fn no_crate_has_a_module_cycle() -> Result<()> {
    let mut found = Vec::new();
    let mut modules = 0;
    for member in workspace_members()? {
        let src = repo_root().join(&member).join("src");
        let graph = ModuleGraph::from_src(&src)?;
        modules += graph.edges().len();
        for cycle in graph.cycles() {
            found.push(format!("{member}: {}", cycle.join(" -> ")));
        }
    }
    assert!(modules > 0, "no module found in any member's src/");
    no_cycles(&found)
}

/// The adapters' own modules: the Python package, Node `lib/`, Ruby `lib/rebound/` and the
/// Go module's packages (see `rebound_tests::client_modules` for what counts as an edge).
#[test]
fn no_client_has_a_module_cycle() -> Result<()> {
    use rebound_tests::client_modules::{go_module, node_lib, python_package, ruby_lib};
    let clients = repo_root().join("clients");
    let graphs = [
        (
            "python",
            python_package(&clients.join("python/src/rebound_celery"))?,
        ),
        ("node", node_lib(&clients.join("node/lib"))?),
        ("ruby", ruby_lib(&clients.join("ruby/lib/rebound"))?),
        ("go", go_module(&clients.join("go"))?),
    ];
    let mut found = Vec::new();
    for (client, graph) in &graphs {
        let edges: usize = graph.edges().values().map(|to| to.len()).sum();
        assert!(edges > 0, "{client}: no edge found between its modules");
        for cycle in graph.cycles() {
            found.push(format!("{client}: {}", cycle.join(" -> ")));
        }
    }
    no_cycles(&found)
}

/// One module convention in every crate: `name.rs` beside `name/` (the Rust 2018 form the
/// Rust reference recommends), never `name/mod.rs`. (A `tests/common/mod.rs` is Cargo's
/// idiom for code shared by integration tests and is not under `src/`.)
#[test]
fn no_crate_uses_mod_rs() -> Result<()> {
    fn find(dir: &std::path::Path, found: &mut Vec<String>) -> Result<()> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                find(&path, found)?;
            } else if path.file_name().is_some_and(|n| n == "mod.rs") {
                found.push(
                    path.strip_prefix(repo_root())
                        .unwrap_or(&path)
                        .display()
                        .to_string(),
                );
            }
        }
        Ok(())
    }
    let mut found = Vec::new();
    for member in workspace_members()? {
        find(&repo_root().join(&member).join("src"), &mut found)?;
    }
    assert!(
        found.is_empty(),
        "name/mod.rs files (move each to name.rs beside name/):\n  {}",
        found.join("\n  ")
    );
    Ok(())
}

/// Fails naming every cycle found (`<where>: a -> b -> a`).
fn no_cycles(found: &[String]) -> Result<()> {
    anyhow::ensure!(
        found.is_empty(),
        "module cycles (break each by moving what both sides need into a module below them):\n  {}",
        found.join("\n  ")
    );
    Ok(())
}
