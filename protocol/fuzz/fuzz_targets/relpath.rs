//! Arbitrary text as a path from a peer or a user: `RelPath::new` and `RelPath::normalized`
//! never panic, and a path that exists keeps every rule it promises.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meshfs_protocol::{RelPath, INTERNAL_PREFIX, MAX_NAME_LEN, MAX_PATH_LEN};

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(p) = RelPath::new(s) {
        assert_eq!(p.as_str(), s);
        holds_the_rules(&p);
    }
    if let Ok(p) = RelPath::normalized(s) {
        holds_the_rules(&p);
        // Normalizing is idempotent: the result is accepted as it is.
        assert_eq!(RelPath::new(p.as_str()).as_ref(), Ok(&p));
    }
});

fn holds_the_rules(p: &RelPath) {
    let s = p.as_str();
    assert!(!s.is_empty() && s.len() <= MAX_PATH_LEN);
    assert!(!s.starts_with('/') && !s.contains('\0'));
    for c in p.components() {
        assert!(!c.is_empty() && c.len() <= MAX_NAME_LEN);
        assert!(c != "." && c != "..");
        assert!(!c.starts_with(INTERNAL_PREFIX));
    }
    // Navigation stays inside the rules and gets back where it started.
    match p.parent() {
        Some(parent) => {
            assert!(p.is_within(&parent));
            assert_eq!(parent.join(p.file_name()).as_ref(), Ok(p));
        }
        None => assert_eq!(p.file_name(), s),
    }
    let bytes = postcard::to_allocvec(p).expect("a path encodes");
    let back: RelPath = postcard::from_bytes(&bytes).expect("a valid path decodes");
    assert_eq!(&back, p);
}
