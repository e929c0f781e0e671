//! The module graphs of the adapters under `clients/`, one per language, for the same cycle
//! check as the Rust crates ([`ModuleGraph::cycles`]).
//!
//! An edge is any way one module of a package reaches another, eager or lazy (an import
//! inside a function is still an edge):
//! - Python (a package directory): `from .b import …`, `from . import b`,
//!   `from ..b import …`, `import pkg.b`, `from pkg.b import …`; a module is a top-level
//!   `.py` file or subpackage; `__init__.py` and `__main__.py` are roots, outside the graph.
//! - Node (a `lib/` directory): `require('./b')` and `from './b.js'`.
//! - Ruby (a `lib/<gem>/` directory): `require "<gem>/b"`, `require_relative "b"`, and
//!   a reference to a class or module that only `b` defines (Ruby resolves constants at
//!   run time, so `B.call` with no require is still a dependency).
//! - Go (a module directory): imports of the module's own packages; `_test.go` files are
//!   left out, as `#[cfg(test)]` code is for Rust.
//!
//! Comments are ignored, and so are string literals where a language's import takes no
//! string (Ruby constant references).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::module_graph::ModuleGraph;

/// A source file: its module in the graph and its text.
struct Source {
    module: String,
    text: String,
}

/// Files with one of `extensions` under `dir`, sorted, each with the first component of its
/// path under `dir` (without the extension) as its module.
fn sources(dir: &Path, extensions: &[&str]) -> Result<Vec<Source>> {
    let mut files = Vec::new();
    collect(dir, extensions, &mut files)?;
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let relative = path.strip_prefix(dir).unwrap_or(&path);
        let Some(first) = relative.components().next() else {
            continue;
        };
        let first = Path::new(first.as_os_str());
        let module = if relative.components().count() == 1 {
            first.file_stem()
        } else {
            first.file_name()
        };
        let Some(module) = module.and_then(|m| m.to_str()) else {
            continue;
        };
        out.push(Source {
            module: module.to_owned(),
            text,
        });
    }
    if out.is_empty() {
        bail!("no {extensions:?} file under {}", dir.display());
    }
    Ok(out)
}

fn collect(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') || name == "node_modules" || name == "__pycache__" {
            continue;
        }
        if path.is_dir() {
            collect(&path, extensions, out)?;
        } else if extensions.iter().any(|e| name.ends_with(e)) {
            out.push(path);
        }
    }
    Ok(())
}

/// A graph with every module of `sources` and an edge for each `(from, to)` between two of
/// them (self edges and names that are not modules are dropped).
fn graph_of(sources: &[Source], edges: impl IntoIterator<Item = (String, String)>) -> ModuleGraph {
    let modules: BTreeSet<&str> = sources.iter().map(|s| s.module.as_str()).collect();
    let mut graph = ModuleGraph::default();
    for module in &modules {
        graph.add_module(module);
    }
    for (from, to) in edges {
        if from != to && modules.contains(from.as_str()) && modules.contains(to.as_str()) {
            graph.add_edge(&from, &to);
        }
    }
    graph
}

/// Lines of code without `#` comments (Python, Ruby) or `//` comments (JavaScript, Go).
fn code_lines<'a>(text: &'a str, comment: &'a str) -> impl Iterator<Item = &'a str> {
    text.lines()
        .map(str::trim)
        .filter(move |line| !line.starts_with(comment))
}

/// The first identifier-like word of `text` (letters, digits, `_`).
fn word(text: &str) -> &str {
    let end = text
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(text.len());
    &text[..end]
}

/// The Python package at `package_dir` (its directory name is the package name).
pub fn python_package(package_dir: &Path) -> Result<ModuleGraph> {
    let package = package_dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("a package directory has a name")?;
    let sources: Vec<Source> = sources(package_dir, &[".py"])?
        .into_iter()
        .filter(|s| s.module != "__init__" && s.module != "__main__")
        .collect();
    let mut edges = Vec::new();
    for source in &sources {
        for line in code_lines(&source.text, "#") {
            let targets: Vec<String> = if let Some(rest) = line.strip_prefix("from ") {
                let (from, names) = rest.split_once(" import ").unwrap_or((rest, ""));
                let from = from.trim();
                let dotted = from.trim_start_matches('.');
                if from.starts_with('.') && dotted.is_empty() {
                    // `from . import a, b as c`
                    names
                        .trim_matches(|c| c == '(' || c == ')' || c == ' ')
                        .split(',')
                        .map(|n| word(n.trim()).to_owned())
                        .collect()
                } else if from.starts_with('.') {
                    vec![word(dotted).to_owned()]
                } else if let Some(inner) = from.strip_prefix(&format!("{package}.")) {
                    vec![word(inner).to_owned()]
                } else {
                    Vec::new()
                }
            } else if let Some(rest) = line.strip_prefix("import ") {
                rest.split(',')
                    .filter_map(|m| m.trim().strip_prefix(&format!("{package}.")))
                    .map(|inner| word(inner).to_owned())
                    .collect()
            } else {
                Vec::new()
            };
            edges.extend(targets.into_iter().map(|t| (source.module.clone(), t)));
        }
    }
    Ok(graph_of(&sources, edges))
}

/// The string argument right after `open` in `line` (`'./b'` → `./b`), if any.
fn quoted_after<'a>(line: &'a str, open: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find(open) {
        let after = &rest[at + open.len()..];
        let Some(quote) = after
            .chars()
            .next()
            .filter(|c| matches!(c, '\'' | '"' | '`'))
        else {
            rest = after;
            continue;
        };
        let body = &after[1..];
        let Some(end) = body.find(quote) else { break };
        out.push(&body[..end]);
        rest = &body[end..];
    }
    out
}

/// Every `"…"` string of a line (Go import paths have no escapes).
fn double_quoted(line: &str) -> Vec<&str> {
    line.split('"').skip(1).step_by(2).collect()
}

/// The Node modules in `lib_dir` (CommonJS `require` or ES `import`).
pub fn node_lib(lib_dir: &Path) -> Result<ModuleGraph> {
    let sources = sources(lib_dir, &[".js", ".mjs", ".cjs"])?;
    let mut edges = Vec::new();
    for source in &sources {
        for line in code_lines(&source.text, "//") {
            let specs = quoted_after(line, "require(")
                .into_iter()
                .chain(quoted_after(line, "from "))
                .chain(quoted_after(line, "import("));
            for spec in specs {
                if let Some(local) = spec.strip_prefix("./") {
                    let stem = local.split('/').next().unwrap_or(local);
                    let stem = stem.split('.').next().unwrap_or(stem);
                    edges.push((source.module.clone(), stem.to_owned()));
                }
            }
        }
    }
    Ok(graph_of(&sources, edges))
}

/// Ruby code of a line with string literals and a trailing comment removed.
fn ruby_code(line: &str) -> String {
    let mut out = String::new();
    let mut quote = None;
    let mut escaped = false;
    for c in line.chars() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                    out.push(c);
                }
            }
            None if c == '#' => break,
            None => {
                if c == '"' || c == '\'' {
                    quote = Some(c);
                }
                out.push(c);
            }
        }
    }
    out
}

/// The Ruby files of a gem under `gem_dir` (`lib/<gem>/`; its name is the require prefix).
pub fn ruby_lib(gem_dir: &Path) -> Result<ModuleGraph> {
    let gem = gem_dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("a gem directory has a name")?;
    let sources = sources(gem_dir, &[".rb"])?;
    // Classes and modules defined by exactly one module of the graph.
    let mut defined_in: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for source in &sources {
        for line in code_lines(&source.text, "#") {
            for keyword in ["class ", "module "] {
                if let Some(rest) = line.strip_prefix(keyword) {
                    let name = rest.split("::").last().unwrap_or(rest);
                    let name = word(name.trim());
                    if name.starts_with(char::is_uppercase) {
                        defined_in
                            .entry(name.to_owned())
                            .or_default()
                            .insert(source.module.clone());
                    }
                }
            }
        }
    }
    let owner: BTreeMap<&str, &str> = defined_in
        .iter()
        .filter(|(_, modules)| modules.len() == 1)
        .filter_map(|(name, modules)| Some((name.as_str(), modules.first()?.as_str())))
        .collect();
    let mut edges = Vec::new();
    for source in &sources {
        for line in code_lines(&source.text, "#") {
            for spec in quoted_after(line, "require ") {
                if let Some(inner) = spec.strip_prefix(&format!("{gem}/")) {
                    edges.push((source.module.clone(), word(inner).to_owned()));
                }
            }
            for spec in quoted_after(line, "require_relative ") {
                edges.push((source.module.clone(), word(spec).to_owned()));
            }
            let code = ruby_code(line);
            for token in code.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                if let Some(module) = owner.get(token) {
                    edges.push((source.module.clone(), (*module).to_owned()));
                }
            }
        }
    }
    Ok(graph_of(&sources, edges))
}

/// The packages of the Go module at `module_dir` (its `go.mod` names the module path).
pub fn go_module(module_dir: &Path) -> Result<ModuleGraph> {
    let go_mod = module_dir.join("go.mod");
    let text = std::fs::read_to_string(&go_mod)
        .with_context(|| format!("reading {}", go_mod.display()))?;
    let Some(path) = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("module "))
        .map(str::trim)
    else {
        bail!("no `module` line in {}", go_mod.display());
    };
    let mut files = Vec::new();
    collect(module_dir, &[".go"], &mut files)?;
    files.sort();
    let mut packages = Vec::new();
    let mut edges = Vec::new();
    for file in files {
        if file.to_string_lossy().ends_with("_test.go") {
            continue;
        }
        let dir = file.parent().unwrap_or(module_dir);
        let package = match dir.strip_prefix(module_dir) {
            Ok(p) if p.as_os_str().is_empty() => ".".to_owned(),
            Ok(p) => p.to_string_lossy().into_owned(),
            Err(_) => continue,
        };
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        for line in code_lines(&text, "//") {
            for import in double_quoted(line) {
                if import == path {
                    edges.push((package.clone(), ".".to_owned()));
                } else if let Some(inner) = import.strip_prefix(&format!("{path}/")) {
                    edges.push((package.clone(), inner.to_owned()));
                }
            }
        }
        packages.push(Source {
            module: package,
            text: String::new(),
        });
    }
    Ok(graph_of(&packages, edges))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, files: &[(&str, &str)]) {
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
    }

    fn cycles(graph: &ModuleGraph) -> Vec<Vec<String>> {
        graph.cycles()
    }

    fn tempdir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("client-modules-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_lazy_python_import_closes_a_cycle() {
        let root = tempdir("py");
        let pkg = root.join("pkg");
        write(
            &pkg,
            &[
                ("__init__.py", "from .a import A\nfrom .b import B\n"),
                (
                    "a.py",
                    "# from .c import nothing\nimport os\nfrom .core import x\n",
                ),
                ("b.py", "def f():\n    from . import a, core\n"),
                ("core.py", "import pkg.b\n"),
            ],
        );
        let graph = python_package(&pkg).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        // b -> a -> core -> b and b -> core -> b.
        assert_eq!(
            cycles(&graph),
            vec![
                vec!["a".to_owned(), "core".into(), "b".into(), "a".into()],
                vec!["b".to_owned(), "core".into(), "b".into()],
            ]
        );
        assert!(graph.edges()["a"].contains("core"));
        assert!(!graph.edges().contains_key("__init__"));
    }

    #[test]
    fn node_requires_and_imports_are_edges() {
        let root = tempdir("node");
        write(
            &root,
            &[
                ("a.js", "const { x } = require('./b');\n// require('./c')\n"),
                ("b.js", "import { y } from './c.js';\n"),
                ("c.js", "const fs = require('fs');\n"),
            ],
        );
        let graph = node_lib(&root).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        assert!(cycles(&graph).is_empty());
        assert!(graph.edges()["a"].contains("b"));
        assert!(graph.edges()["b"].contains("c"));
        assert!(!graph.edges()["a"].contains("c"));
    }

    #[test]
    fn a_ruby_constant_without_require_is_an_edge() {
        let root = tempdir("rb");
        let gem = root.join("gem");
        write(
            &gem,
            &[
                (
                    "a.rb",
                    "require \"gem/b\"\nmodule Gem\n  class A; end\nend\n",
                ),
                (
                    "b.rb",
                    "module Gem\n  class B\n    def f = A.new # A.again\n    def g = \"C\"\n  end\nend\n",
                ),
                ("c.rb", "module Gem\n  class C; end\nend\n"),
            ],
        );
        let graph = ruby_lib(&gem).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            cycles(&graph),
            vec![vec!["a".to_owned(), "b".into(), "a".into()]]
        );
        assert!(
            !graph.edges()["b"].contains("c"),
            "a string is not a reference"
        );
    }

    #[test]
    fn go_imports_of_the_module_are_edges_and_tests_are_left_out() {
        let root = tempdir("go");
        write(
            &root,
            &[
                ("go.mod", "module example.com/m\n\ngo 1.26\n"),
                (
                    "m.go",
                    "package m\n\nimport (\n\t\"fmt\"\n\t\"example.com/m/sub\"\n)\n",
                ),
                ("sub/sub.go", "package sub\n"),
                (
                    "sub/sub_test.go",
                    "package sub\n\nimport \"example.com/m\"\n",
                ),
            ],
        );
        let graph = go_module(&root).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        assert!(cycles(&graph).is_empty());
        assert!(graph.edges()["."].contains("sub"));
    }
}
