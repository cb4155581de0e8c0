//! kiln-kernels
