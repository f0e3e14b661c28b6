"""The store: the only code that talks to PostgreSQL.

SQL loading, the typed connector over the named statements, the embedded
server for a machine without a database, and the migrations.
"""
