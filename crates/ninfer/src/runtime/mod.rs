//! The runtime: sequences, sampling, generation, and the Engine.
