//! No import cycle among `kube-router/src`'s top-level modules: every `crate::X` path (in `use`
//! items, `crate::{X, Y}` groups and inline paths) outside a file's trailing `#[cfg(test)]`
//! module is an edge from the file's top-level module to `X`; a strongly connected component of
//! more than one module is a cycle and fails the test, listing the edges and the file of each.
//! Pure source reading: no build of the agent, no root.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

/// Edges that close cycles nobody has cut yet, each with why it is there. Removing an entry
/// makes the test show the cycle again; an entry whose edge no longer exists is reported so it
/// can be deleted.
const ALLOWED_EDGES: &[(&str, &str, &str)] = &[];

type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// `crate::X` targets named in `source` (comments and the trailing test module removed).
fn crate_targets(source: &str) -> BTreeSet<String> {
    let code = match find_test_module(source) {
        Some(at) => &source[..at],
        None => source,
    };
    let code: String = code.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut targets = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        // `kube_router_common::` and friends end in `crate::` too: only a path that starts here.
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
                if depth == 1 && c == ',' {
                    targets.insert(first_ident(&item));
                    item.clear();
                } else {
                    item.push(c);
                }
            }
            targets.insert(first_ident(&item));
        } else {
            targets.insert(first_ident(rest));
        }
    }
    targets.retain(|t| !t.is_empty() && t != "self");
    targets
}

fn first_ident(text: &str) -> String {
    text.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()
}

/// Where the trailing `#[cfg(test)] mod … {` starts, if there is one.
fn find_test_module(source: &str) -> Option<usize> {
    let mut offset = 0;
    let lines: Vec<&str> = source.split_inclusive('\n').collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]" {
            if let Some(next) = lines.get(i + 1) {
                let next = next.trim_start();
                if next.starts_with("mod ") && next.trim_end().ends_with('{') {
                    return Some(offset);
                }
            }
        }
        offset += line.len();
    }
    None
}

fn collect(dir: &Path, src_root: &Path, graph: &mut Graph) {
    for entry in fs::read_dir(dir).expect("reading the source tree") {
        let path = entry.expect("reading the source tree").path();
        if path.is_dir() {
            collect(&path, src_root, graph);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let relative = path.strip_prefix(src_root).expect("under src");
        // The crate roots: lib.rs only declares modules, main.rs is the binary's own crate.
        if relative == Path::new("lib.rs") || relative == Path::new("main.rs") {
            continue;
        }
        let first = relative.components().next().expect("a component").as_os_str().to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        let source = fs::read_to_string(&path).expect("reading a source file");
        for target in crate_targets(&source) {
            if target != module {
                graph
                    .entry(module.clone())
                    .or_default()
                    .entry(target)
                    .or_insert_with(|| relative.display().to_string());
            }
        }
    }
}

/// Strongly connected components of more than one module (Tarjan), each sorted.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flat_map(|e| e.keys()) {
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
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut state = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    let nodes: BTreeSet<&str> = graph
        .iter()
        .flat_map(|(from, to)| std::iter::once(from.as_str()).chain(to.keys().map(String::as_str)))
        .collect();
    for node in nodes {
        if !state.index.contains_key(node) {
            visit(&mut state, node);
        }
    }
    state.found
}

fn describe(graph: &Graph, component: &[String]) -> String {
    let mut text = format!("cycle among {}:\n", component.join(", "));
    for from in component {
        for (to, file) in graph.get(from).into_iter().flatten() {
            if component.contains(to) {
                text.push_str(&format!("  {from} -> {to}   (first in src/{file})\n"));
            }
        }
    }
    text
}

#[test]
fn top_level_modules_import_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = Graph::new();
    collect(&src, &src, &mut graph);
    assert!(graph.contains_key("bgp") && graph.contains_key("router"), "the scan found the modules: {graph:?}");
    for (from, to, _) in ALLOWED_EDGES {
        let present = graph.get(*from).is_some_and(|e| e.contains_key(*to));
        if present {
            graph.get_mut(*from).expect("present").remove(*to);
        } else {
            eprintln!("allow-listed edge {from} -> {to} no longer exists: delete it from ALLOWED_EDGES");
        }
    }
    let found = cycles(&graph);
    let report: String = found.iter().map(|c| describe(&graph, c)).collect();
    assert!(found.is_empty(), "import cycles between top-level modules:\n{report}");
}

#[test]
fn the_scan_sees_every_path_form_and_reports_a_cycle() {
    let source = "use crate::{a::X, b::{Y, Z}};\nuse crate::c;\nfn f() { crate::d::g(); other_crate::e::h(); }\n// crate::commented\n#[cfg(test)]\nmod tests {\n    use crate::test_only;\n}\n";
    let targets: Vec<String> = crate_targets(source).into_iter().collect();
    assert_eq!(targets, ["a", "b", "c", "d"]);

    let mut graph = Graph::new();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        graph.entry(from.into()).or_default().insert(to.into(), format!("{from}.rs"));
    }
    let found = cycles(&graph);
    assert_eq!(found, [vec!["a".to_string(), "b".into(), "c".into()]]);
    assert!(describe(&graph, &found[0]).contains("c -> a   (first in src/c.rs)"));
    graph.get_mut("c").expect("c").remove("a");
    assert!(cycles(&graph).is_empty());
}
