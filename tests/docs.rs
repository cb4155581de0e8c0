//! The documents hold what they promise: a short README, a book whose chapters are all listed and
//! whose relative links resolve, generated parts (the CLI reference, the results tables) equal to
//! what their sources render, and no words about how the project was made.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every Markdown document: the README and the book's chapters.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    let src = root().join("docs/src");
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    chapters.sort();
    docs.extend(chapters);
    docs
}

#[test]
fn the_readme_is_short() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(lines <= 300, "README.md has {lines} lines: at most 300 (the rest belongs in the book)");
}

#[test]
fn every_chapter_is_in_the_summary_and_every_summary_entry_exists() {
    let summary = read(&root().join("docs/src/SUMMARY.md"));
    let listed: Vec<&str> = summary.split("](").skip(1).filter_map(|s| s.split(')').next()).collect();
    for entry in &listed {
        assert!(
            root().join("docs/src").join(entry).is_file(),
            "SUMMARY.md lists {entry}, which does not exist"
        );
    }
    for doc in documents().iter().skip(1) {
        let name = doc.file_name().unwrap().to_str().unwrap();
        if name != "SUMMARY.md" {
            assert!(listed.contains(&name), "docs/src/{name} is not in SUMMARY.md");
        }
    }
}

/// The targets of Markdown links and images (`](target)`) outside code blocks.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    let mut joined = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if !in_code {
            joined.push_str(line);
            joined.push('\n');
        }
    }
    // Inline code spans may hold `](` too: drop them.
    let prose: String = joined.split('`').step_by(2).collect::<Vec<_>>().join(" ");
    for part in prose.split("](").skip(1) {
        if let Some(target) = part.split(')').next() {
            out.push(target.split_whitespace().next().unwrap_or("").to_string());
        }
    }
    out
}

#[test]
fn relative_links_resolve() {
    let mut broken = Vec::new();
    for doc in documents() {
        for target in link_targets(&read(&doc)) {
            if target.is_empty()
                || target.contains("://")
                || target.starts_with('#')
                || target.starts_with("mailto:")
            {
                continue;
            }
            let file = target.split('#').next().unwrap();
            if !doc.parent().unwrap().join(file).exists() {
                broken.push(format!("{}: {target}", doc.strip_prefix(root()).unwrap().display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken relative links:\n{}", broken.join("\n"));
}

#[test]
fn link_targets_are_found_outside_code() {
    let t = link_targets("[a](x.md) `[b](y.md)`\n```\n[c](z.md)\n```\n![i](img.svg \"t\")");
    assert_eq!(t, vec!["x.md", "img.svg"]);
}

#[test]
fn generated_parts_are_up_to_date() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["render-docs", "--check"])
        .output()
        .expect("run kiln render-docs --check");
    assert!(
        out.status.success(),
        "the CLI reference or a results table differs from what kiln renders:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The repository's own text files: documents, sources, scripts, benches, tests, examples.
fn own_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap_or("");
        if name.starts_with('.') && name != ".ci"
            || name == "target"
            || name == "snapshots"
            || name == "__pycache__"
        {
            continue;
        }
        if path.is_dir() {
            own_files(&path, out);
        } else if ["rs", "md", "sh", "py", "toml", "json", "txt", "yml", "yaml"]
            .iter()
            .any(|x| path.extension().is_some_and(|e| e == *x))
            || path.parent().and_then(Path::file_name).is_some_and(|d| d == ".ci")
        {
            out.push(path);
        }
    }
}

#[test]
fn no_words_about_how_the_project_was_made() {
    // Built from parts, so that this file does not match itself.
    let words = [
        ["ses", "sion"].concat(),
        ["was ", "lent"].concat(),
        ["lent a ", "device"].concat(),
        ["helper", "-written"].concat(),
    ];
    let mut files = Vec::new();
    for dir in [
        "README.md",
        "docs",
        "src",
        "compiler",
        "kernels",
        "runtime",
        "comm",
        "scripts",
        "benches",
        "tests",
        "examples",
        ".ci",
    ] {
        let path = root().join(dir);
        if path.is_dir() {
            own_files(&path, &mut files);
        } else if path.is_file() {
            files.push(path);
        }
    }
    assert!(files.len() > 100, "found only {} files", files.len());
    // onnxruntime's API (its InferenceSession and SessionOptions) names nothing of how kiln was
    // made.
    let apis = [["Inference", "Ses", "sion"].concat(), ["Ses", "sion", "Options"].concat()];
    let mut found = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else { continue };
        for (i, line) in text.lines().enumerate() {
            let line_without_apis = apis.iter().fold(line.to_string(), |l, api| l.replace(api.as_str(), ""));
            let lower = line_without_apis.to_lowercase();
            if words.iter().any(|w| lower.contains(w.as_str())) {
                found.push(format!(
                    "{}:{}: {}",
                    file.strip_prefix(root()).unwrap().display(),
                    i + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(found.is_empty(), "words about how the project was made:\n{}", found.join("\n"));
}
