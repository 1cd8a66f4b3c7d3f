//! One map, four places: its declaration in the eBPF crate (read back from the object the agent
//! embeds and loads), its layout spec (`layout.rs`, what pinned maps are checked against), its
//! name constant in kube-router-common's `*map_names` modules (what the agent opens it by) and
//! its row in docs/maps.md. Nothing else ties them together, so these tests hold each to the
//! object, both ways, and name every gap they find. No kernel needed: they only parse the ELF.
use std::collections::{BTreeMap, BTreeSet};

use aya::maps::MapType;
use aya_obj::{maps::PinningType, EbpfSectionKind, Object};
use kube_router_common::LAYOUT_VERSION;

use super::layout::{all_specs, MapSizes, MapSpec};

/// A map as the object declares it.
#[derive(Debug)]
struct ObjectMap {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    pinned: bool,
}

/// The maps of the object the agent loads (`DATAPATH_OBJECT`), by name; not the `.bss`, `.data`
/// and `.rodata` sections, which aya also turns into maps but nobody names.
fn object_maps() -> BTreeMap<String, ObjectMap> {
    let object = Object::parse(super::DATAPATH_OBJECT).expect("parsing the embedded datapath object");
    object
        .maps
        .iter()
        .filter(|(_, map)| matches!(map.section_kind(), EbpfSectionKind::Maps | EbpfSectionKind::BtfMaps))
        .map(|(name, map)| {
            let declared = ObjectMap {
                map_type: map.map_type(),
                key_size: map.key_size(),
                value_size: map.value_size(),
                max_entries: map.max_entries(),
                map_flags: map.map_flags(),
                pinned: map.pinning() == PinningType::ByName,
            };
            (name.clone(), declared)
        })
        .collect()
}

/// The map types the datapath uses, as docs/maps.md (and bpftool) spell them.
const TYPE_NAMES: [(MapType, &str); 7] = [
    (MapType::Hash, "HASH"),
    (MapType::Array, "ARRAY"),
    (MapType::PerCpuHash, "PERCPU_HASH"),
    (MapType::PerCpuArray, "PERCPU_ARRAY"),
    (MapType::LruHash, "LRU_HASH"),
    (MapType::LpmTrie, "LPM_TRIE"),
    (MapType::RingBuf, "RINGBUF"),
];

fn type_name(map_type: u32) -> String {
    TYPE_NAMES
        .iter()
        .find(|(t, _)| *t as u32 == map_type)
        .map(|(_, name)| name.to_string())
        .unwrap_or_else(|| format!("type {map_type}"))
}

fn type_by_name(name: &str) -> Option<u32> {
    TYPE_NAMES.iter().find(|(_, n)| *n == name).map(|(t, _)| *t as u32)
}

/// Every disagreement between the layout specs and the object.
fn spec_gaps(object: &BTreeMap<String, ObjectMap>, specs: &[&MapSpec]) -> Vec<String> {
    let mut gaps = Vec::new();
    let mut specified = BTreeSet::new();
    for spec in specs {
        if !specified.insert(spec.name) {
            gaps.push(format!("layout spec: `{}` has two specs", spec.name));
        }
        let Some(map) = object.get(spec.name) else {
            gaps.push(format!("layout spec: `{}` names no map in the object", spec.name));
            continue;
        };
        if !map.pinned {
            gaps.push(format!("layout spec: `{}` is not pinned in the object; specs are for pinned maps", spec.name));
        }
        let mut differs = |what: &str, spec_says: String, object_says: String| {
            if spec_says != object_says {
                gaps.push(format!("layout spec: `{}` {what} is {spec_says}, the object's {object_says}", spec.name));
            }
        };
        differs("type", type_name(spec.map_type as u32), type_name(map.map_type));
        differs("key size", spec.key_size.to_string(), map.key_size.to_string());
        differs("value size", spec.value_size.to_string(), map.value_size.to_string());
        differs("max entries", spec.max_entries.to_string(), map.max_entries.to_string());
        differs("flags", format!("{:#x}", spec.map_flags), format!("{:#x}", map.map_flags));
        // What the loader sizes a map to by default is what the object declares.
        if let Some(sized) = MapSizes::default().max_entries(spec.name) {
            differs("default size (MapSizes)", sized.to_string(), map.max_entries.to_string());
        }
    }
    for (name, _) in object.iter().filter(|(_, map)| map.pinned) {
        if !specified.contains(name.as_str()) {
            gaps.push(format!("layout spec: pinned map `{name}` has none (layout::all_specs)"));
        }
    }
    gaps
}

/// The `pub const NAME: &str = "map";` of every `pub mod *map_names` module in
/// kube-router-common, as (module::NAME, map). Read from the source so that a constant added to
/// any such module, or a new module, is checked without a list here to keep up to date.
fn listed_map_names() -> Vec<(String, String)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../kube-router-common/src");
    let mut files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    let mut listed = Vec::new();
    for file in files.iter().filter(|f| f.extension().is_some_and(|e| e == "rs")) {
        let source = std::fs::read_to_string(file).unwrap();
        let mut module = None;
        for line in source.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix("pub mod ").and_then(|l| l.strip_suffix(" {")) {
                module = name.ends_with("map_names").then(|| name.to_string());
            } else if line == "}" {
                module = None;
            } else if let (Some(module), Some(decl)) = (&module, line.strip_prefix("pub const ")) {
                let (constant, value) = decl.split_once(": &str = ").expect("a map name constant");
                let value = value.trim_end_matches(';').trim_matches('"');
                listed.push((format!("{module}::{constant}"), value.to_string()));
            }
        }
    }
    listed
}

fn name_list_gaps(object: &BTreeMap<String, ObjectMap>, listed: &[(String, String)]) -> Vec<String> {
    let mut gaps = Vec::new();
    let mut by_name: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (constant, name) in listed {
        by_name.entry(name.as_str()).or_default().push(constant.as_str());
        match object.get(name) {
            None => gaps.push(format!("name list: {constant} = `{name}` names no map in the object")),
            Some(map) if !map.pinned => {
                gaps.push(format!("name list: {constant} = `{name}` is not pinned in the object (no pin to open)"))
            }
            Some(_) => {}
        }
        // BPF_OBJ_NAME_LEN is 16 with the NUL: a longer name is cut in the kernel's map info.
        if name.len() > 15 {
            gaps.push(format!("name list: {constant} = `{name}` is longer than 15 bytes"));
        }
    }
    for (name, constants) in &by_name {
        if constants.len() > 1 {
            gaps.push(format!("name list: `{name}` is listed by {}", constants.join(" and ")));
        }
    }
    for (name, _) in object.iter().filter(|(_, map)| map.pinned) {
        if !by_name.contains_key(name.as_str()) {
            gaps.push(format!("name list: pinned map `{name}` has no constant in a *map_names module"));
        }
    }
    gaps
}

/// A row of one of docs/maps.md's map tables (those whose first column is `name`).
#[derive(Debug)]
struct DocRow {
    line: usize,
    names: Vec<String>,
    /// Under a "Not pinned" heading.
    unpinned: bool,
    map_type: String,
    max_entries: String,
}

fn cells(line: &str) -> Vec<&str> {
    line.trim().trim_matches('|').split('|').map(str::trim).collect()
}

/// The backticked words of a cell.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

fn doc_rows(doc: &str) -> Vec<DocRow> {
    let mut rows = Vec::new();
    let mut unpinned = false;
    let mut header: Option<Vec<String>> = None;
    for (index, line) in doc.lines().enumerate() {
        if let Some(heading) = line.strip_prefix('#') {
            unpinned = heading.trim_start_matches('#').trim().starts_with("Not pinned");
        }
        if !line.starts_with('|') {
            header = None;
            continue;
        }
        let row = cells(line);
        let Some(columns) = &header else {
            header = Some(row.iter().map(|c| c.to_string()).collect());
            continue;
        };
        if columns.first().map(String::as_str) != Some("name") || row.iter().all(|c| c.starts_with("---")) {
            continue;
        }
        let column = |name: &str| columns.iter().position(|c| c == name).and_then(|i| row.get(i)).copied();
        rows.push(DocRow {
            line: index + 1,
            names: code_spans(row[0]),
            unpinned,
            map_type: column("type").unwrap_or_default().to_string(),
            max_entries: column("max entries").unwrap_or_default().to_string(),
        });
    }
    rows
}

/// The number a cell starts with (`262,144 (bytes)` is 262144).
fn leading_number(cell: &str) -> Option<u32> {
    let digits: String = cell.chars().take_while(|c| c.is_ascii_digit() || *c == ',').filter(|c| *c != ',').collect();
    digits.parse().ok()
}

fn doc_gaps(object: &BTreeMap<String, ObjectMap>, doc: &str) -> Vec<String> {
    let mut gaps = Vec::new();
    let mut documented: BTreeMap<String, usize> = BTreeMap::new();
    for row in doc_rows(doc) {
        let line = row.line;
        if row.names.is_empty() {
            gaps.push(format!("docs/maps.md:{line}: a map table row names no map"));
        }
        let type_word: String = row.map_type.chars().take_while(|c| c.is_ascii_uppercase() || *c == '_').collect();
        for name in &row.names {
            if let Some(first) = documented.insert(name.clone(), line) {
                gaps.push(format!("docs/maps.md:{line}: `{name}` has a row already (line {first})"));
            }
            let Some(map) = object.get(name) else {
                gaps.push(format!("docs/maps.md:{line}: `{name}` is no map in the object"));
                continue;
            };
            match (map.pinned, row.unpinned) {
                (true, true) => gaps.push(format!("docs/maps.md:{line}: `{name}` is pinned, not under \"Not pinned\"")),
                (false, false) => gaps.push(format!(
                    "docs/maps.md:{line}: `{name}` is not pinned, yet in a pinned map table (not under \"Not pinned\")"
                )),
                _ => {}
            }
            if type_by_name(&type_word) != Some(map.map_type) {
                gaps.push(format!(
                    "docs/maps.md:{line}: `{name}` type says {:?}, the object's is {}",
                    row.map_type,
                    type_name(map.map_type)
                ));
            }
            if leading_number(&row.max_entries) != Some(map.max_entries) {
                gaps.push(format!(
                    "docs/maps.md:{line}: `{name}` max entries says {:?}, the object's is {}",
                    row.max_entries, map.max_entries
                ));
            }
        }
    }
    for (name, map) in object {
        if !documented.contains_key(name) {
            let table = if map.pinned { "a pinned map table" } else { "the \"Not pinned\" table" };
            gaps.push(format!("docs/maps.md: `{name}` has no row (belongs in {table})"));
        }
    }
    // Where the pinned maps are: the stated layout version, and every example path's directory.
    if !doc.contains(&format!("Layout version: **{LAYOUT_VERSION}**")) {
        gaps.push(format!("docs/maps.md: does not say \"Layout version: **{LAYOUT_VERSION}**\""));
    }
    for (at, _) in doc.match_indices("kube-router/v") {
        let rest = &doc[at + "kube-router/v".len()..];
        let version: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let name: String = rest[version.len()..]
            .strip_prefix('/')
            .unwrap_or_default()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if version != LAYOUT_VERSION.to_string() {
            gaps.push(format!(
                "docs/maps.md: a path names directory v{version}, the maps are pinned in v{LAYOUT_VERSION}"
            ));
        }
        if !name.is_empty() && !object.get(&name).is_some_and(|m| m.pinned) {
            gaps.push(format!("docs/maps.md: the path .../v{version}/{name} names no pinned map"));
        }
    }
    gaps
}

/// The maps each size flag row of docs/maps.md's "Sizes" table names, against the maps
/// [`MapSizes`] sizes from that flag.
fn size_flag_gaps(doc: &str) -> Vec<String> {
    let mut gaps = Vec::new();
    let default = MapSizes::default();
    let flags: [(&str, MapSizes); 2] = [
        ("--bpf-lb-map-max", MapSizes { lb_frontends: default.lb_frontends * 2, ..default }),
        ("--bpf-ct-global-max", MapSizes { conntrack: default.conntrack * 2, ..default }),
    ];
    for (flag, changed) in flags {
        let sized: BTreeSet<String> = all_specs()
            .filter(|spec| changed.max_entries(spec.name) != default.max_entries(spec.name))
            .map(|spec| spec.name.to_string())
            .collect();
        let row = doc.lines().find(|l| l.starts_with('|') && cells(l).first().is_some_and(|c| c.contains(flag)));
        let Some(row) = row else {
            gaps.push(format!("docs/maps.md: no size table row for {flag}"));
            continue;
        };
        let named: BTreeSet<String> =
            cells(row).get(1).map(|c| code_spans(c)).unwrap_or_default().into_iter().collect();
        for missing in sized.difference(&named) {
            gaps.push(format!("docs/maps.md: {flag} sizes `{missing}`, its row does not name it"));
        }
        for extra in named.difference(&sized) {
            gaps.push(format!("docs/maps.md: {flag}'s row names `{extra}`, which it does not size"));
        }
    }
    gaps
}

fn assert_no_gaps(what: &str, gaps: Vec<String>) {
    assert!(gaps.is_empty(), "{} gap(s) between {what}:\n  {}", gaps.len(), gaps.join("\n  "));
}

fn maps_doc() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/maps.md")).unwrap()
}

#[test]
fn every_map_in_the_object_has_a_matching_layout_spec_and_every_spec_a_map() {
    let specs: Vec<&MapSpec> = all_specs().collect();
    assert_no_gaps("the object and the layout specs", spec_gaps(&object_maps(), &specs));
}

#[test]
fn every_pinned_map_has_a_name_constant_and_every_constant_names_a_pinned_map() {
    assert_no_gaps("the object and the *map_names modules", name_list_gaps(&object_maps(), &listed_map_names()));
}

#[test]
fn docs_maps_md_lists_exactly_the_objects_maps() {
    let doc = maps_doc();
    let mut gaps = doc_gaps(&object_maps(), &doc);
    gaps.extend(size_flag_gaps(&doc));
    assert_no_gaps("the object and docs/maps.md", gaps);
}

/// The checks above can fail: a spec one byte off, a spec for a map the object lacks, a
/// missing spec, a stray or missing name constant, a doc row gone and a stale pin path are each
/// reported by name.
#[test]
fn the_contract_checks_name_each_gap_they_are_shown() {
    let object = object_maps();
    let wider = MapSpec { key_size: 9, ..*all_specs().find(|s| s.name == "svc_v4").unwrap() };
    let phantom = MapSpec { name: "svc_v5", ..wider };
    let preallocated = MapSpec { map_flags: 0, ..*all_specs().find(|s| s.name == "svc_stats_v4").unwrap() };
    let skipped = ["svc_v4", "ct_v6", "svc_stats_v4"];
    let mut specs: Vec<&MapSpec> = all_specs().filter(|s| !skipped.contains(&s.name)).collect();
    specs.extend([&wider, &phantom, &preallocated]);
    let gaps = spec_gaps(&object, &specs);
    assert_eq!(
        gaps,
        [
            "layout spec: `svc_v4` key size is 9, the object's 8",
            "layout spec: `svc_v5` names no map in the object",
            "layout spec: `svc_stats_v4` flags is 0x0, the object's 0x1",
            "layout spec: pinned map `ct_v6` has none (layout::all_specs)",
        ]
        .map(String::from)
    );

    let mut listed = listed_map_names();
    listed.retain(|(_, name)| name != "pol_ct_v6");
    listed.push(("map_names::SCRATCH".into(), "work_v4".into()));
    assert_eq!(
        name_list_gaps(&object, &listed),
        [
            "name list: map_names::SCRATCH = `work_v4` is not pinned in the object (no pin to open)",
            "name list: pinned map `pol_ct_v6` has no constant in a *map_names module",
        ]
        .map(String::from)
    );

    let doc = maps_doc();
    let current = format!("kube-router/v{LAYOUT_VERSION}/");
    assert!(doc.contains(&current), "docs/maps.md shows no path in {current}");
    let older = doc.replace(&current, &format!("kube-router/v{}/", LAYOUT_VERSION - 1));
    let without_meta: String =
        older.lines().filter(|l| !l.starts_with("| `meta` |")).map(|l| format!("{l}\n")).collect();
    assert_eq!(
        doc_gaps(&object, &without_meta),
        [
            "docs/maps.md: `meta` has no row (belongs in a pinned map table)".to_string(),
            format!(
                "docs/maps.md: a path names directory v{}, the maps are pinned in v{LAYOUT_VERSION}",
                LAYOUT_VERSION - 1
            ),
        ]
    );
}
