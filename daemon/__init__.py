"""skilltrain: hands-off skill training of an LLM screenwriter."""
