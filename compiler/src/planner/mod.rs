//! Memory placement (being written).
