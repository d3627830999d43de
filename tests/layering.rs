//! The map is a checked fact: `docs/architecture.md` states, for each crate, the layers of its
//! modules (a fenced block that starts with `layers DIR`, top layer first), and every
//! `crate::MODULE` a module's code names (outside comments and its `#[cfg(test)]` part) must be
//! on a line below its own. A module the map does not place, or a module the map names that does
//! not exist, fails too, so the map cannot drift from the code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers of one crate: module → line (0 = top).
struct Layers {
    dir: String,
    line_of: BTreeMap<String, usize>,
}

/// Every `layers DIR` section of the fenced `text` blocks of `doc`: a section runs to the next
/// one, a blank line or the end of its block; each of its lines is a layer.
fn layers_in(doc: &str) -> Vec<Layers> {
    let mut out: Vec<Layers> = Vec::new();
    let mut in_block = false;
    let mut current: Option<Layers> = None;
    for l in doc.lines() {
        let t = l.trim();
        if !in_block {
            in_block = t == "```text";
            continue;
        }
        if t == "```" || t.is_empty() {
            out.extend(current.take());
            in_block = t != "```";
            continue;
        }
        if let Some(dir) = t.strip_prefix("layers ") {
            out.extend(current.take());
            current = Some(Layers {
                dir: dir.trim().to_string(),
                line_of: BTreeMap::new(),
            });
        } else if let Some(c) = current.as_mut() {
            let row = c.line_of.values().max().map_or(0, |m| m + 1);
            for m in t.split_whitespace() {
                c.line_of.insert(m.to_string(), row);
            }
        }
    }
    out.extend(current);
    out
}

/// The code of a file that counts: comments and `#[cfg(test)]` items (to the end of the
/// braces that follow) left out.
fn code_of(src: &str) -> String {
    let uncommented: String = src
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = uncommented.as_str();
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        let item = &rest[i..];
        let Some(open) = item.find('{') else {
            return out;
        };
        let mut depth = 0usize;
        let mut end = item.len();
        for (j, c) in item[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// Every `crate::NAME` in `code`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // `$crate::`, `meshfs_x::crate` never occur; a preceding identifier char means
        // another path (`some_crate::`).
        let prev = rest[..i].chars().last();
        if !prev.is_some_and(|c| c.is_alphanumeric() || c == '_') && !name.is_empty() {
            out.insert(name);
        }
        rest = after;
    }
    out
}

/// The modules of the crate at `dir` (its top-level files and folders) with the `crate::`
/// names their code uses.
fn modules_of(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(dir).unwrap();
            let top = rel
                .components()
                .next()
                .unwrap()
                .as_os_str()
                .to_string_lossy()
                .trim_end_matches(".rs")
                .to_string();
            if top == "lib" || top == "main" {
                continue;
            }
            let src = std::fs::read_to_string(&p).unwrap();
            out.entry(top)
                .or_default()
                .extend(crate_paths(&code_of(&src)));
        }
    }
    out
}

/// What breaks the layering: (module, the module above or beside it that it names).
fn violations(layers: &Layers, modules: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for (m, uses) in modules {
        let Some(&line) = layers.line_of.get(m) else {
            out.push(format!(
                "{}: module {m} is not placed in the map",
                layers.dir
            ));
            continue;
        };
        for u in uses {
            // Names that are not modules (items of the crate root) are not layered.
            let Some(&other) = layers.line_of.get(u) else {
                continue;
            };
            if u != m && other <= line {
                out.push(format!(
                    "{}: {m} (line {line}) uses {u} (line {other}), which is not below it",
                    layers.dir
                ));
            }
        }
    }
    for m in layers.line_of.keys() {
        if !modules.contains_key(m) {
            out.push(format!(
                "{}: the map names {m}, which does not exist",
                layers.dir
            ));
        }
    }
    out
}

#[test]
fn every_crate_keeps_the_layering_the_architecture_map_states() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let all = layers_in(&doc);
    let dirs: Vec<&str> = all.iter().map(|l| l.dir.as_str()).collect();
    for crate_dir in ["src", "protocol/src", "sync/src", "daemon/src", "fuse/src"] {
        assert!(
            dirs.contains(&crate_dir),
            "no layers for {crate_dir} in the map"
        );
    }
    let mut broken = Vec::new();
    for layers in &all {
        broken.extend(violations(layers, &modules_of(&root.join(&layers.dir))));
    }
    assert!(
        broken.is_empty(),
        "the layering is broken:\n{}",
        broken.join("\n")
    );
}

#[test]
fn a_circle_or_an_upward_import_is_caught() {
    let doc = "```text\nlayers x/src\ntop\nmid other\nbottom\n```\n";
    let layers = &layers_in(doc)[0];
    let modules = |edges: &[(&str, &str)]| {
        let mut m: BTreeMap<String, BTreeSet<String>> = ["top", "mid", "other", "bottom"]
            .iter()
            .map(|n| (n.to_string(), BTreeSet::new()))
            .collect();
        for (a, b) in edges {
            m.get_mut(*a).unwrap().insert(b.to_string());
        }
        m
    };
    assert!(violations(layers, &modules(&[("top", "mid"), ("mid", "bottom")])).is_empty());
    // Upwards, and between two modules of one line (which could close a circle).
    assert_eq!(violations(layers, &modules(&[("bottom", "top")])).len(), 1);
    assert_eq!(violations(layers, &modules(&[("mid", "other")])).len(), 1);
    // The parser reads code, not comments or tests.
    let code = code_of(
        "use crate::a; // crate::b\n#[cfg(test)]\nmod t { use crate::e; fn g() { crate::f() } }\nfn f() { crate::c::d() }",
    );
    let names: Vec<String> = crate_paths(&code).into_iter().collect();
    assert_eq!(names, ["a", "c"]);
}
