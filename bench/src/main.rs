//! The `bench` comparison tool (being built).

fn main() {}
