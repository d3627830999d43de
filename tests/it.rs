//! The integration tests: one test binary for every file in tests/ (each file a module of it),
//! so the daemon and its dependencies are linked once, not once per file, and libtest
//! schedules every file's tests together.
//!
//! A new test file `tests/NAME.rs` is a module here: add `mod NAME;` below (kept sorted), and
//! in the file take the harness with `use crate::common;` (not `mod common;`, which would look
//! for tests/NAME/common.rs). A file without its line here would never be built or run:
//! `every_test_file_is_a_module_of_this_binary` fails if one is missing. Run one file's tests
//! with `cargo test --test it NAME::` (a filter on the module path).

mod common;

mod capture;
mod chaos;
mod cli;
mod conflicts;
mod discovery;
mod endurance;
mod hostile;
mod hostile_items;
mod hostile_load;
mod hostile_second;
mod install_races;
mod layering;
mod live_mount;
mod mount;
mod mount_scale;
mod on_demand;
mod packaging;
mod resilience;
mod status;
mod sync;
mod ui;
mod user_mount;
mod versions;
mod versions_kills;
mod wal_identity;

/// Each `tests/*.rs` file is declared above (Cargo builds only this file: `autotests = false`).
#[test]
fn every_test_file_is_a_module_of_this_binary() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this = std::fs::read_to_string(dir.join("it.rs")).unwrap();
    let declared: Vec<&str> = this
        .lines()
        .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
        .collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some(module) = name.strip_suffix(".rs") {
            if module != "it" && !declared.contains(&module) {
                missing.push(module.to_owned());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "tests/*.rs files that tests/it.rs does not declare (add `mod NAME;` there): {missing:?}"
    );
}
