"""Device switches: accelerator detection, CUDA graphs, precision, memory format, eager regions,
process-wide switches, the CPU allocator."""
