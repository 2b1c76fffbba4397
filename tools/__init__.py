"""Developer tools and benchmarks."""
