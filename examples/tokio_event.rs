//! cqd's event mode driven from tokio (being written).

fn main() {}
