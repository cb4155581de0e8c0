//! kiln-runtime: backends that execute plans, the eager executor, and its growth allocators.

pub mod alloc;
