"""The lab: what the benchmarks and tests use to build swarms under faults, shaped links and simulated
scale. None of it ships with the package (``netlab`` needs root for namespaces and cgroups)."""
