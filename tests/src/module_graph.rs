//! The graph of `crate::` edges between the top-level modules of a crate, and its cycles.
//!
//! A file belongs to the top-level module its path under `src/` starts with
//! (`src/source/files.rs` is in `source`); the crate roots (`lib.rs`, `main.rs`, `bin/`)
//! are not modules of the graph. An edge `a -> b` is any `crate::b` path in a file of `a`,
//! in `use` items (`use crate::{b, c::d}`) and in expressions, types and attributes alike;
//! `crate::Name` re-exported by the root with `pub use b::…` counts as an edge to `b`.
//! Code under `#[cfg(test)]` is left out: a module's tests may use whatever sits above it.
//! Comments and string literals are ignored.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Component, Path};

use anyhow::{Context, Result};

/// Modules and the modules each one names with `crate::`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModuleGraph {
    edges: BTreeMap<String, BTreeSet<String>>,
}

impl ModuleGraph {
    /// A graph of the given edges (and of the modules they name).
    pub fn from_edges<'a>(edges: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut graph = Self::default();
        for (from, to) in edges {
            graph.add_edge(from, to);
        }
        graph
    }

    /// Reads every `.rs` file under a crate's `src/` directory.
    pub fn from_src(src: &Path) -> Result<Self> {
        let mut files = Vec::new();
        collect_rs_files(src, &mut files)?;
        files.sort();

        let mut modules = BTreeSet::new();
        let mut roots = Vec::new();
        let mut sources = Vec::new();
        for path in files {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let relative = path.strip_prefix(src).unwrap_or(&path).to_path_buf();
            match top_level_module(&relative) {
                Some(module) => {
                    modules.insert(module.clone());
                    sources.push((relative, module, text));
                }
                None => roots.push(text),
            }
        }

        let mut reexports = BTreeMap::new();
        for root in &roots {
            let code = without_test_items(&strip_comments_and_literals(root)).0;
            for (name, module) in root_reexports(&code) {
                if modules.contains(&module) {
                    reexports.insert(name, module);
                }
            }
        }

        // Files declared `#[cfg(test)] mod name;` by their parent, and everything below.
        let mut test_only: BTreeSet<std::path::PathBuf> = BTreeSet::new();
        let mut code_of = Vec::new();
        for (relative, module, text) in &sources {
            let (code, test_mods) = without_test_items(&strip_comments_and_literals(text));
            let dir = child_module_dir(relative);
            for name in test_mods {
                test_only.insert(dir.join(format!("{name}.rs")));
                test_only.insert(dir.join(&name));
            }
            code_of.push((relative.clone(), module.clone(), code));
        }

        let mut graph = Self::default();
        for module in &modules {
            graph.edges.entry(module.clone()).or_default();
        }
        for (relative, module, code) in code_of {
            if test_only.iter().any(|t| relative.starts_with(t)) {
                continue;
            }
            for name in crate_path_heads(&code) {
                let target = if modules.contains(&name) {
                    Some(name)
                } else {
                    reexports.get(&name).cloned()
                };
                if let Some(target) = target
                    && target != module
                {
                    graph.add_edge(&module, &target);
                }
            }
        }
        Ok(graph)
    }

    /// A module, with no edge yet.
    pub fn add_module(&mut self, module: &str) {
        self.edges.entry(module.to_owned()).or_default();
    }

    pub fn add_edge(&mut self, from: &str, to: &str) {
        self.edges
            .entry(from.to_owned())
            .or_default()
            .insert(to.to_owned());
        self.edges.entry(to.to_owned()).or_default();
    }

    pub fn edges(&self) -> &BTreeMap<String, BTreeSet<String>> {
        &self.edges
    }

    /// The cycles, each written `[a, b, c, a]` from its first module by name: for every
    /// module in a strongly connected component, the shortest cycle through it (so
    /// `a <-> b` and `a -> c -> d -> a` in one component are two cycles), without repeats.
    pub fn cycles(&self) -> Vec<Vec<String>> {
        let mut cycles = BTreeSet::new();
        for component in self.components() {
            for module in &component {
                if let Some(mut path) = self.shortest_cycle(module, &component) {
                    path.pop();
                    let first = path
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, m)| *m)
                        .map_or(0, |(k, _)| k);
                    path.rotate_left(first);
                    if let Some(start) = path.first().cloned() {
                        path.push(start);
                    }
                    cycles.insert(path);
                }
            }
        }
        cycles.into_iter().collect()
    }

    /// Tarjan's strongly connected components, each sorted by name.
    fn components(&self) -> Vec<BTreeSet<String>> {
        struct State<'g> {
            graph: &'g ModuleGraph,
            next_index: usize,
            index: BTreeMap<&'g str, usize>,
            low: BTreeMap<&'g str, usize>,
            stack: Vec<&'g str>,
            on_stack: BTreeSet<&'g str>,
            found: Vec<BTreeSet<String>>,
        }
        fn visit<'g>(s: &mut State<'g>, v: &'g str) {
            s.index.insert(v, s.next_index);
            s.low.insert(v, s.next_index);
            s.next_index += 1;
            s.stack.push(v);
            s.on_stack.insert(v);
            for w in s.graph.edges.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let low = s.low[v].min(s.low[w]);
                    s.low.insert(v, low);
                } else if s.on_stack.contains(w) {
                    let low = s.low[v].min(s.index[w]);
                    s.low.insert(v, low);
                }
            }
            if s.low[v] == s.index[v] {
                let mut component = BTreeSet::new();
                while let Some(w) = s.stack.pop() {
                    s.on_stack.remove(w);
                    component.insert(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                s.found.push(component);
            }
        }
        let mut state = State {
            graph: self,
            next_index: 0,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on_stack: BTreeSet::new(),
            found: Vec::new(),
        };
        for v in self.edges.keys() {
            if !state.index.contains_key(v.as_str()) {
                visit(&mut state, v);
            }
        }
        state.found.sort();
        state.found
    }

    /// Breadth-first from `start` back to it, inside its component.
    fn shortest_cycle(&self, start: &String, component: &BTreeSet<String>) -> Option<Vec<String>> {
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = VecDeque::from([start.as_str()]);
        while let Some(v) = queue.pop_front() {
            for w in self.edges.get(v).into_iter().flatten() {
                if !component.contains(w) {
                    continue;
                }
                if w == start {
                    let mut path = vec![start.clone()];
                    let mut at = v;
                    while at != start {
                        path.push(at.to_owned());
                        at = came_from.get(at)?;
                    }
                    path.push(start.clone());
                    path.reverse();
                    return Some(path);
                }
                if !came_from.contains_key(w.as_str()) {
                    came_from.insert(w, v);
                    queue.push_back(w);
                }
            }
        }
        None
    }
}

fn collect_rs_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry
            .with_context(|| format!("reading {}", dir.display()))?
            .path();
        if path.is_dir() {
            collect_rs_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// `answer.rs` and `source/files.rs` are in `answer` and `source`; the roots in none.
fn top_level_module(relative: &Path) -> Option<String> {
    let mut components = relative.components();
    let Some(Component::Normal(first)) = components.next() else {
        return None;
    };
    let first = first.to_str()?;
    let nested = components.next().is_some();
    if nested {
        return (first != "bin").then(|| first.to_owned());
    }
    let stem = first.strip_suffix(".rs")?;
    (!matches!(stem, "lib" | "main")).then(|| stem.to_owned())
}

/// Where the files of a file's child modules live: `a.rs` and `a/mod.rs` keep them in `a/`.
fn child_module_dir(relative: &Path) -> std::path::PathBuf {
    let parent = relative.parent().unwrap_or(Path::new(""));
    match relative.file_stem().and_then(|s| s.to_str()) {
        Some("mod") | None => parent.to_path_buf(),
        Some(stem) => parent.join(stem),
    }
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The code with comments, string literals and char literals replaced by spaces (newlines
/// kept), so that only real paths and braces remain.
pub fn strip_comments_and_literals(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let prev_is_ident = i > 0 && is_ident_char(chars[i - 1]);
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if c == 'r' && !prev_is_ident && matches!(next, Some('"' | '#')) {
            // A raw string r"…" or r#"…"#; `r#ident` is a raw identifier.
            let mut j = i + 1;
            while chars.get(j) == Some(&'#') {
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            j += 1;
            while j < chars.len() {
                if chars[j] == '"' && (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &skipped in &chars[i..j.min(chars.len())] {
                blank(&mut out, skipped);
            }
            i = j;
        } else if c == '"' {
            blank(&mut out, c);
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
                if let Some(&skipped) = chars.get(i) {
                    blank(&mut out, skipped);
                }
                i += 1;
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{1F600}'), or else a lifetime ('a).
            let end = if next == Some('\\') {
                (i + 2..chars.len()).find(|&j| chars[j] == '\'')
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    for _ in i..=end {
                        out.push(' ');
                    }
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Blanks every item under `#[cfg(test)]`; also returns the names of the modules so
/// declared in other files (`#[cfg(test)] mod tests;`).
pub fn without_test_items(code: &str) -> (String, Vec<String>) {
    const ATTRIBUTE: &str = "#[cfg(test)]";
    let mut out: Vec<char> = code.chars().collect();
    let mut test_mods = Vec::new();
    let text: String = out.iter().collect();
    let mut search_from = 0;
    while let Some(found) = text[search_from..].find(ATTRIBUTE) {
        let start = search_from + found;
        // Work in chars: the stripped code may hold non-ASCII identifiers.
        let start_char = text[..start].chars().count();
        let mut i = start_char + ATTRIBUTE.chars().count();
        // Skip further attributes.
        loop {
            while out.get(i).is_some_and(|c| c.is_whitespace()) {
                i += 1;
            }
            if out.get(i) == Some(&'#') && out.get(i + 1) == Some(&'[') {
                let mut depth = 0usize;
                while let Some(&c) = out.get(i) {
                    i += 1;
                    match c {
                        '[' => depth += 1,
                        ']' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                }
            } else {
                break;
            }
        }
        // The item ends at a `;` before any brace, or at the brace closing its first one.
        let item_start = i;
        let mut depth = 0usize;
        while let Some(&c) = out.get(i) {
            i += 1;
            match c {
                ';' if depth == 0 => break,
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
        }
        let item: String = out[item_start..i.min(out.len())].iter().collect();
        let words: Vec<&str> = item
            .split(|c: char| !is_ident_char(c) && c != ';')
            .filter(|w| !w.is_empty())
            .collect();
        let words: Vec<&str> = words
            .into_iter()
            .skip_while(|w| *w == "pub" || *w == "crate")
            .collect();
        if let ["mod", name, ";"] = words.as_slice() {
            test_mods.push((*name).to_owned());
        } else if let ["mod", name_semi] = words.as_slice()
            && let Some(name) = name_semi.strip_suffix(';')
        {
            test_mods.push(name.to_owned());
        }
        let end = i.min(out.len());
        for c in &mut out[start_char..end] {
            if *c != '\n' {
                *c = ' ';
            }
        }
        search_from = start + ATTRIBUTE.len();
    }
    (out.into_iter().collect(), test_mods)
}

/// The first segment of every `crate::` path: `crate::a::b` gives `a`, `crate::{a, b::c}`
/// gives `a` and `b`.
pub fn crate_path_heads(code: &str) -> Vec<String> {
    let chars: Vec<char> = code.chars().collect();
    let mut heads = Vec::new();
    let mut i = 0;
    while i + 5 <= chars.len() {
        let is_crate = chars[i..i + 5].iter().copied().eq("crate".chars())
            && (i == 0 || !(is_ident_char(chars[i - 1]) || chars[i - 1] == '$'))
            && !chars.get(i + 5).copied().is_some_and(is_ident_char);
        if !is_crate {
            i += 1;
            continue;
        }
        let mut j = skip_space(&chars, i + 5);
        if !(chars.get(j) == Some(&':') && chars.get(j + 1) == Some(&':')) {
            i += 5;
            continue;
        }
        j = skip_space(&chars, j + 2);
        if chars.get(j) == Some(&'{') {
            let (items, end) = group_items(&chars, j);
            heads.extend(items.iter().filter_map(|item| first_ident(item)));
            i = end;
        } else {
            let end = (j..chars.len())
                .find(|&k| !is_ident_char(chars[k]))
                .unwrap_or(chars.len());
            if end > j {
                heads.push(chars[j..end].iter().collect());
            }
            i = end.max(i + 5);
        }
    }
    heads.retain(|h| h != "self" && h != "*");
    heads
}

fn skip_space(chars: &[char], mut i: usize) -> usize {
    while chars.get(i).is_some_and(|c| c.is_whitespace()) {
        i += 1;
    }
    i
}

/// The comma-separated items of the brace group opening at `open`, and the index after it.
fn group_items(chars: &[char], open: usize) -> (Vec<String>, usize) {
    let mut items = Vec::new();
    let mut current = String::new();
    let mut depth = 0usize;
    let mut i = open;
    while let Some(&c) = chars.get(i) {
        i += 1;
        match c {
            '{' => {
                depth += 1;
                if depth == 1 {
                    continue;
                }
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => {
                items.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    items.push(current);
    (items, i)
}

fn first_ident(item: &str) -> Option<String> {
    let item = item.trim_start();
    let end = item.find(|c: char| !is_ident_char(c)).unwrap_or(item.len());
    (end > 0).then(|| item[..end].to_owned())
}

/// `pub use m::{A, b::C as D};` in a crate root: `A` and `D` are from module `m`.
fn root_reexports(code: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for statement in code.split(';') {
        let words: Vec<&str> = statement.split_whitespace().collect();
        let Some(at) = words.windows(2).position(|w| w == ["pub", "use"]) else {
            continue;
        };
        let path: String = words[at + 2..].join(" ");
        let path = path.strip_prefix("crate::").unwrap_or(&path).trim();
        let Some((module, rest)) = path.split_once("::") else {
            continue;
        };
        let module = module.trim();
        // Leaves are identifiers followed by `,`, `}` or the end; `x as y` exports `y`.
        let tokens: Vec<String> = rest
            .replace('{', " { ")
            .replace('}', " } ")
            .replace(',', " , ")
            .replace("::", " :: ")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        for (k, token) in tokens.iter().enumerate() {
            let leaf = tokens
                .get(k + 1)
                .is_none_or(|next| next == "," || next == "}");
            if leaf && token.chars().all(is_ident_char) && token != "self" {
                found.push((token.clone(), module.to_owned()));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cycle(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn a_graph_without_a_cycle_has_none() {
        let graph = ModuleGraph::from_edges([
            ("decide", "resolve"),
            ("resolve", "spec"),
            ("retry_budget", "decide"),
            ("retry_budget", "resolve"),
            ("spec", "limits"),
        ]);
        assert_eq!(graph.cycles(), Vec::<Vec<String>>::new());
    }

    #[test]
    fn every_cycle_is_reported_with_its_path() {
        let graph = ModuleGraph::from_edges([
            ("decide", "resolve"),
            ("resolve", "retry_budget"),
            ("retry_budget", "decide"),
            ("spec", "retry_budget"),
            ("retry_budget", "spec"),
            ("pattern", "duration"),
        ]);
        assert_eq!(
            graph.cycles(),
            vec![
                cycle(&["decide", "resolve", "retry_budget", "decide"]),
                cycle(&["retry_budget", "spec", "retry_budget"]),
            ]
        );
    }

    #[test]
    fn two_separate_cycles_are_two_reports() {
        let graph = ModuleGraph::from_edges([
            ("a", "b"),
            ("b", "a"),
            ("x", "y"),
            ("y", "z"),
            ("z", "x"),
            ("b", "x"),
        ]);
        assert_eq!(
            graph.cycles(),
            vec![cycle(&["a", "b", "a"]), cycle(&["x", "y", "z", "x"])]
        );
    }

    #[test]
    fn paths_are_read_from_use_items_expressions_and_attributes() {
        let code = strip_comments_and_literals(
            r#"
            //! See [`crate::docs_only`].
            use crate::{a, b::{C, D}, self};
            use crate::c::E as F;
            #[schemars(range(max = crate::limits::MAX))]
            fn f() -> crate::d::G { let s = "crate::in_string"; let c = '{'; crate::e::h() }
            macro_rules! m { () => { $crate::in_macro } }
            /* crate::in_block_comment */
            "#,
        );
        assert_eq!(
            crate_path_heads(&code),
            cycle(&["a", "b", "c", "limits", "d", "e"])
        );
    }

    #[test]
    fn test_items_are_left_out_and_test_modules_named() {
        let code = strip_comments_and_literals(
            "use crate::a;\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\n#[allow(x)]\nmod inline { use crate::b; fn f() { crate::c::d(); } }\nuse crate::e;\n",
        );
        let (code, test_mods) = without_test_items(&code);
        assert_eq!(test_mods, cycle(&["tests"]));
        assert_eq!(crate_path_heads(&code), cycle(&["a", "e"]));
    }

    #[test]
    fn root_reexports_name_their_module() {
        let found = root_reexports(
            "pub use decide::{Context, Policy as P};\npub use spec::RetryPolicy;\nuse x::Y;",
        );
        assert_eq!(
            found,
            vec![
                ("Context".to_owned(), "decide".to_owned()),
                ("P".to_owned(), "decide".to_owned()),
                ("RetryPolicy".to_owned(), "spec".to_owned()),
            ]
        );
    }

    #[test]
    fn files_map_to_their_top_level_module() {
        assert_eq!(
            top_level_module(Path::new("answer.rs")).as_deref(),
            Some("answer")
        );
        assert_eq!(
            top_level_module(Path::new("source/files.rs")).as_deref(),
            Some("source")
        );
        assert_eq!(top_level_module(Path::new("lib.rs")), None);
        assert_eq!(top_level_module(Path::new("main.rs")), None);
        assert_eq!(top_level_module(Path::new("bin/kubectl-rebound.rs")), None);
    }
}
