//! Backends: the seam between the runtime and the hardware (DESIGN.md §5).
