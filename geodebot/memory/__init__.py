"""Project memory: what the agent learns, kept per project, searchable and correctable."""
