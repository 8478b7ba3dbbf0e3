//! The rules of docs/design.md that keep the crate easy to change, checked on its sources: `unsafe`
//! lives in `src/sys/` (the operating system), `src/gpu/` (CUDA and NCCL) and the three files
//! that lend memory to an op (docs/architecture.md names them), and no library file grows past
//! 800 lines.

use std::fs;
use std::path::{Path, PathBuf};

/// Outside `sys/` and `gpu/`, the only files with `unsafe` code.
const LENDERS: [&str; 3] = [
    "src/engine/tensor.rs",
    "src/python/tensor.rs",
    "src/device/staging.rs",
];

const MAX_LINES: usize = 800;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The crate's files, as paths from the repository root.
fn crate_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            (name, fs::read_to_string(&p).unwrap())
        })
        .collect()
}

/// Whether a line's code (what comes before a `//` comment) uses the `unsafe` keyword.
fn unsafe_code(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|word| word == "unsafe")
}

#[test]
fn unsafe_code_is_in_sys_gpu_and_the_three_lenders_alone() {
    let files = crate_files();
    assert!(files.len() > 50, "found {} files", files.len());
    let mut found = Vec::new();
    for (name, text) in &files {
        let layer = name.starts_with("src/sys/") || name.starts_with("src/gpu/");
        if layer || LENDERS.contains(&name.as_str()) {
            continue;
        }
        for (i, line) in text.lines().enumerate() {
            if unsafe_code(line) {
                found.push(format!("{name}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "unsafe outside src/sys/, src/gpu/ and {LENDERS:?}:\n{}",
        found.join("\n")
    );
    for lender in LENDERS {
        let (_, text) = files.iter().find(|(n, _)| n == lender).unwrap();
        assert!(
            text.lines().any(unsafe_code),
            "{lender} has no unsafe left: drop it from the list"
        );
    }
}

#[test]
fn no_library_file_is_over_800_lines() {
    let long: Vec<String> = crate_files()
        .into_iter()
        .map(|(name, text)| (name, text.lines().count()))
        .filter(|(_, n)| *n > MAX_LINES)
        .map(|(name, n)| format!("{name}: {n} lines"))
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_unsafe_check_sees_code_and_not_comments() {
    assert!(unsafe_code("    let x = unsafe { f() };"));
    assert!(unsafe_code("unsafe impl Send for T {}"));
    assert!(!unsafe_code("// SAFETY: unsafe is fine here"));
    assert!(!unsafe_code("//! its `unsafe`, behind safe types"));
    assert!(!unsafe_code("let unsafe_count = 1;"));
}
