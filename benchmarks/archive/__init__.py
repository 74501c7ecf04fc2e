"""One-off studies whose question is answered (docs cite their numbers); kept to reproduce
them. Type-checked, not smoke-tested: see benchmarks/README.md."""
