//! Growth allocators (being written).
