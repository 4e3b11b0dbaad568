"""The parity search: seeded random cases, token-exact against transformers and against the engine itself."""
