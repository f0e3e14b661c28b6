"""Finance: the usage ledger, model prices and the reports built on them."""
