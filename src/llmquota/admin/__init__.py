"""Administration: policies, keys, status and usage, and the sweeper.

Services over the store for everything that is not a decision: the REST
admin endpoints and the CLI call these, never the store directly.
"""
