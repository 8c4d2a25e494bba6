"""Provider-neutral LLM types and one adapter per provider."""
