"""Byte formats, knowing nothing about models: the SMOE-Q2/Q4 codec spec and its search backends, the vault
(docs/vault.md), atomic and checked outputs."""
