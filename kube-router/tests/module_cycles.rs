//! No import cycle among `kube-router/src`'s modules, at the grain of a room: a top-level module,
//! or, inside a feature folder ([`FEATURE_FOLDERS`]: `services/`, `policy/`, `routing/`, `node/`),
//! each of its direct children (`routing::bgp`, `routing::fib`, `policy::engine`, …; the
//! folder's own `mod.rs` is the room named after the folder). Every `crate::X` and `super::X`
//! path (in `use` items, nested `{…}` groups and inline paths) outside a file's trailing
//! `#[cfg(test)]` module is an edge from the file's room to the room it names; a strongly
//! connected component of more than one room is a cycle and fails the test, listing the edges
//! and the file of each. Pure source reading: no build of the agent, no root.
//!
//! Why a feature folder is not one node: it holds a feature's pure core and its kernel/API edge
//! side by side (`policy::flatten` and `policy::engine`), and the shared layers (`bpf`, `k8s`,
//! `kr_metrics`) may use a feature's pure core while the feature's edge uses them. That is a
//! layering between rooms, which this test holds acyclic; folding a folder into one node would
//! report those as cycles of the folder with itself. Cycles between two features' rooms, or
//! through a shared layer (`routing::bgp -> routing::overlay -> bpf -> metrics -> kr_metrics ->
//! routing::bgp` was one), still fail.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

/// Top-level folders whose direct children are rooms of their own.
const FEATURE_FOLDERS: &[&str] = &["node", "policy", "routing", "services"];

/// Edges that close cycles nobody has cut yet, each with why it is there. Removing an entry
/// makes the test show the cycle again; an entry whose edge no longer exists is reported so it
/// can be deleted.
const ALLOWED_EDGES: &[(&str, &str, &str)] = &[];

type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// Module paths (`["routing", "bgp", "peers"]`, items included) named by `crate::`, `super::` and
/// `self::` paths in `source` (comments and the trailing test module removed), resolved against
/// `module`, the path of the file's own module.
fn crate_paths(source: &str, module: &[String]) -> BTreeSet<Vec<String>> {
    let code = match find_test_module(source) {
        Some(at) => &source[..at],
        None => source,
    };
    let code: String = code.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut paths = BTreeSet::new();
    let bytes = code.as_bytes();
    let mut at = 0;
    while at < code.len() {
        let rest = &code[at..];
        let Some(found) = ["crate::", "super::", "self::"].iter().filter_map(|k| rest.find(k).map(|i| (i, *k))).min()
        else {
            break;
        };
        let (offset, keyword) = found;
        let start = at + offset;
        at = start + keyword.len();
        // `kube_router_common::` and friends end in `crate::` too: only a path that starts here.
        if start > 0
            && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_' || bytes[start - 1] == b':')
        {
            continue;
        }
        let mut base: Vec<String> = match keyword {
            "crate::" => Vec::new(),
            "super::" => module[..module.len().saturating_sub(1)].to_vec(),
            _ => module.to_vec(),
        };
        let mut rest = &code[at..];
        while let Some(next) = rest.strip_prefix("super::") {
            base.pop();
            rest = next;
        }
        at = code.len() - rest.len();
        let (found, used) = parse_tree(rest, &base);
        paths.extend(found);
        at += used;
    }
    paths.retain(|p| !p.is_empty());
    paths
}

/// The paths of one use tree (`a::b`, `a::{b, c::{d, self}}`) after `prefix`, and how many bytes
/// of `text` it took.
fn parse_tree(text: &str, prefix: &[String]) -> (Vec<Vec<String>>, usize) {
    let mut path = prefix.to_vec();
    let mut at = 0;
    loop {
        let rest = &text[at..];
        let trimmed = rest.trim_start();
        at += rest.len() - trimmed.len();
        if let Some(group) = trimmed.strip_prefix('{') {
            at += 1;
            let mut out = Vec::new();
            let mut group = group;
            loop {
                let trimmed = group.trim_start();
                at += group.len() - trimmed.len();
                if let Some(after) = trimmed.strip_prefix('}') {
                    at += 1;
                    let _ = after;
                    return (out, at);
                }
                if trimmed.is_empty() {
                    return (out, at);
                }
                let (items, used) = parse_tree(trimmed, &path);
                out.extend(items);
                at += used;
                group = &text[at..];
                let trimmed = group.trim_start();
                if let Some(after) = trimmed.strip_prefix(',') {
                    at += group.len() - after.len();
                    group = after;
                } else {
                    at += group.len() - trimmed.len();
                    group = trimmed;
                    if !group.starts_with('}') {
                        return (out, at);
                    }
                }
            }
        }
        let ident = first_ident(trimmed);
        if ident.is_empty() {
            return (vec![path], at);
        }
        at += ident.len();
        match ident.as_str() {
            "self" => {}
            "super" => {
                path.pop();
            }
            _ => path.push(ident),
        }
        match text[at..].strip_prefix("::") {
            Some(_) => at += 2,
            None => return (vec![path], at),
        }
    }
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

/// `lib.rs`'s `use` re-exports (old paths of moved modules): alias -> the path it stands for.
fn crate_aliases(lib_rs: &str) -> BTreeMap<String, Vec<String>> {
    let mut aliases = BTreeMap::new();
    for line in lib_rs.lines() {
        let Some(tree) = line.trim().strip_prefix("pub(crate) use ").or_else(|| line.trim().strip_prefix("pub use "))
        else {
            continue;
        };
        for path in parse_tree(tree, &[]).0 {
            if let Some(last) = path.last() {
                aliases.insert(last.clone(), path.clone());
            }
        }
    }
    aliases
}

/// The room of a module path: its top-level module, or for a feature folder the folder's child
/// it names (if it is a module, a file or folder under the folder, and not an item of `mod.rs`).
fn room(path: &[String], src_root: &Path) -> String {
    let top = &path[0];
    if FEATURE_FOLDERS.contains(&top.as_str()) {
        if let Some(child) = path.get(1) {
            let folder = src_root.join(top);
            if folder.join(format!("{child}.rs")).is_file() || folder.join(child).is_dir() {
                return format!("{top}::{child}");
            }
        }
    }
    top.clone()
}

/// The module path of a source file (`routing/bgp/mod.rs` -> `routing::bgp`).
fn module_of(relative: &Path) -> Vec<String> {
    let mut module: Vec<String> =
        relative.iter().map(|c| c.to_string_lossy().trim_end_matches(".rs").to_string()).collect();
    if module.last().is_some_and(|m| m == "mod") {
        module.pop();
    }
    module
}

fn collect(dir: &Path, src_root: &Path, aliases: &BTreeMap<String, Vec<String>>, graph: &mut Graph) {
    for entry in fs::read_dir(dir).expect("reading the source tree") {
        let path = entry.expect("reading the source tree").path();
        if path.is_dir() {
            collect(&path, src_root, aliases, graph);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let relative = path.strip_prefix(src_root).expect("under src");
        // The crate roots: lib.rs only declares modules (and the aliases), main.rs is the binary's own crate.
        if relative == Path::new("lib.rs") || relative == Path::new("main.rs") {
            continue;
        }
        let module = module_of(relative);
        let from = room(&module, src_root);
        let source = fs::read_to_string(&path).expect("reading a source file");
        for mut target in crate_paths(&source, &module) {
            if let Some(real) = aliases.get(&target[0]) {
                target.splice(0..1, real.iter().cloned());
            }
            let to = room(&target, src_root);
            if to != from {
                graph.entry(from.clone()).or_default().entry(to).or_insert_with(|| relative.display().to_string());
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
fn rooms_import_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let aliases = crate_aliases(&fs::read_to_string(src.join("lib.rs")).expect("reading lib.rs"));
    let mut graph = Graph::new();
    collect(&src, &src, &aliases, &mut graph);
    for room in ["routing::bgp", "routing::router", "policy::engine", "node::egress", "bpf", "k8s"] {
        assert!(graph.contains_key(room), "the scan found the room {room}: {graph:?}");
    }
    assert!(graph["policy::engine"].contains_key("policy::flatten"), "super:: and nested groups are read");
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
    assert!(found.is_empty(), "import cycles between rooms:\n{report}");
}

#[test]
fn the_scan_sees_every_path_form_and_reports_a_cycle() {
    let source = "use crate::{a::X, b::{Y, Z}};\nuse crate::c;\nuse super::{sibling::{self, W}, super::up};\nfn f() { crate::d::g(); other_crate::e::h(); self::inner::k(); }\n// crate::commented\n#[cfg(test)]\nmod tests {\n    use crate::test_only;\n}\n";
    let module = ["f".to_string(), "g".into(), "me".into()];
    let paths: Vec<String> = crate_paths(source, &module).into_iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        ["a::X", "b::Y", "b::Z", "c", "d::g", "f::g::me::inner::k", "f::g::sibling", "f::g::sibling::W", "f::up"]
    );
    let aliases = crate_aliases("pub mod x;\npub(crate) use node::{egress, netif};\npub(crate) use routing::bgp;\n");
    assert_eq!(aliases["netif"], ["node", "netif"]);
    assert_eq!(aliases["bgp"], ["routing", "bgp"]);

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

#[test]
fn a_feature_folder_splits_into_rooms_and_other_folders_do_not() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let path = |p: &str| p.split("::").map(String::from).collect::<Vec<_>>();
    assert_eq!(room(&path("routing::bgp::peers::PEERS_ANNOTATION"), &src), "routing::bgp");
    assert_eq!(room(&path("policy::engine"), &src), "policy::engine");
    assert_eq!(room(&path("policy::PortRange"), &src), "policy");
    assert_eq!(room(&path("bpf::datapath::Datapath"), &src), "bpf");
    assert_eq!(module_of(Path::new("routing/bgp/mod.rs")), path("routing::bgp"));
}

/// The shared layers stay below the features: the API layer (`k8s`) and the pinned-map helpers
/// (`pinned`) import no feature folder, and `bpf` (loader, layout, migration, attach) reads no
/// feature's map I/O but the policy maps its layout-2 upgrade converts (`bpf::migrate`).
#[test]
fn shared_layers_import_no_feature_folder() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let aliases = crate_aliases(&fs::read_to_string(src.join("lib.rs")).expect("reading lib.rs"));
    let mut graph = Graph::new();
    collect(&src, &src, &aliases, &mut graph);
    let feature = |room: &str| FEATURE_FOLDERS.iter().any(|f| room == *f || room.starts_with(&format!("{f}::")));
    let mut wrong = Vec::new();
    for layer in ["k8s", "pinned"] {
        for (to, file) in graph.get(layer).into_iter().flatten() {
            if feature(to) {
                wrong.push(format!("{layer} -> {to} ({file})"));
            }
        }
    }
    for (to, file) in graph.get("bpf").into_iter().flatten() {
        let allowed = to == "policy::maps" && file == "bpf/migrate.rs";
        if to.ends_with("::maps") && !allowed {
            wrong.push(format!("bpf -> {to} ({file})"));
        }
    }
    assert!(graph.contains_key("k8s") && graph.contains_key("pinned"), "the scan found both layers: {graph:?}");
    assert!(wrong.is_empty(), "a shared layer imports a feature:\n{}", wrong.join("\n"));
}
