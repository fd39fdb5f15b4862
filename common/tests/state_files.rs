//! docs/architecture.md shows the table of the daemons' files on the host; its one source is
//! `common::state::FILES`. This keeps the two equal, and prints the table to paste when not.

use std::path::Path;

#[test]
fn the_architecture_doc_lists_every_state_file() {
    let doc_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/architecture.md");
    let doc = std::fs::read_to_string(&doc_path)
        .unwrap_or_else(|e| panic!("{}: {e}", doc_path.display()));
    let (begin, end) = (
        "<!-- common::state::FILES: begin -->\n",
        "<!-- common::state::FILES: end -->",
    );
    let table = doc
        .split_once(begin)
        .and_then(|(_, rest)| rest.split_once(end))
        .map(|(t, _)| t)
        .unwrap_or_else(|| panic!("{} has no {begin:?} … {end:?}", doc_path.display()));
    let want = common::state::markdown_table();
    assert!(
        table == want,
        "{} shows another table of node state than common::state::FILES; put this between \
         the markers:\n{want}",
        doc_path.display()
    );
}
