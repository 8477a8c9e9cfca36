//! The topology TOML parser and validator: any text either parses or gives
//! a `TopologyError` with a line and column inside the text; a parsed
//! configuration validates or gives an error against any set of allowed
//! CPUs, never a panic; what validates serializes back to TOML that parses
//! and validates to the same plan.
#![no_main]

use std::collections::BTreeSet;

use cqd_core::topology::{TopologyConfig, TopologyError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (&str, Vec<u8>)| {
    let (text, cpus) = input;
    let config = match TopologyConfig::from_toml(text) {
        Ok(c) => c,
        Err(TopologyError::Parse { line, column, .. }) => {
            let lines = text.split('\n').count().max(1);
            assert!(line >= 1 && line <= lines, "line {line} of {lines}");
            assert!(column >= 1);
            return;
        }
        Err(e) => panic!("from_toml gave a non-parse error: {e}"),
    };
    let allowed: BTreeSet<usize> = cpus.iter().map(|&c| usize::from(c % 64)).collect();
    let Ok(plan) = config.validate_for(&allowed) else {
        return;
    };
    let _ = plan.warnings();
    let again = config.to_toml().expect("a valid config serializes");
    let back = TopologyConfig::from_toml(&again)
        .unwrap_or_else(|e| panic!("its own TOML does not parse: {e}\n{again}"));
    let replan = back
        .validate_for(&allowed)
        .unwrap_or_else(|e| panic!("its own TOML does not validate: {e}\n{again}"));
    assert_eq!(
        format!("{:?}", plan.warnings()),
        format!("{:?}", replan.warnings())
    );
    assert_eq!(
        back.to_toml().expect("serializes"),
        again,
        "not a fixed point"
    );
});
