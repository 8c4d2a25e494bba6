"""The agent engine: sessions, the loop, LLM adapters, tools and budgets.

Nothing here imports a platform SDK; channels translate at the edge.
"""
