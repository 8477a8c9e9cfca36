//! README.md's example is `examples/readme.rs`, character for character,
//! and it runs: the README cannot show code that no longer compiles or
//! works.

#[path = "../examples/readme.rs"]
mod readme;

#[test]
fn the_readme_shows_examples_readme_rs_as_it_is() {
    let readme = include_str!("../README.md");
    let example = include_str!("../examples/readme.rs");
    let block = format!("```rust\n{example}```\n");
    assert!(
        readme.contains(&block),
        "README.md's example differs from examples/readme.rs: copy the file \
         into the README's ```rust block, unchanged"
    );
}

#[test]
fn the_readme_example_runs() {
    readme::main().expect("examples/readme.rs failed");
}

#[test]
fn the_readme_starts_with_the_two_commands() {
    let readme = include_str!("../README.md");
    let first_block = readme
        .split("```")
        .nth(1)
        .expect("README.md has no code block");
    let commands: Vec<&str> = first_block
        .lines()
        .skip(1) // the fence's info string
        .filter_map(|l| l.split('#').next())
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(
        commands,
        ["cargo run --release -p cqd-demo", "bash scripts/test.sh"]
    );
}
